"""A command's hold on its run: the config loaded once and the run directory locked once, for every flow it runs.

`eagle3 generate` loads the config and takes the lock (cli/app.py), the pipeline flow it runs finds them held, and so
does the stage flow the pipeline runs: one parse of the YAML and one lock per command. A flow started on its own (a
deployment's run, `eagle3 demo`'s pipeline) holds nothing yet, so it loads and locks for itself.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prefect import get_run_logger

from flows.config.file import load_config, save_run_config
from settings.run import RunConfig
from settings.stages import Stage
from tasks.runtime.dead_runs import end_dead_runs
from tasks.runtime.run_lock import note_flow_run, run_lock


@dataclass(frozen=True)
class _Hold:
    config: RunConfig
    stages: frozenset[str]


_holds: dict[Path, _Hold] = {}  # resolved config path -> what this process holds for it (flows may run on threads)
_guard = threading.Lock()


@contextmanager
def held_run(
    config_path: str | Path, stages: Iterable[Stage], purpose: str, config: RunConfig | None = None
) -> Iterator[RunConfig]:
    """`config_path`'s config while this process holds the run for `stages`: one writer per run directory, and per
    directory outside it that the stages write (`RunConfig.written_dirs`; shared for those they only read,
    `read_dirs`). Held already (by the command, or by the pipeline around a stage): that config, nothing loaded or
    locked again, the current flow run named in the lock. `config`: the config the caller loaded from that path."""
    key = Path(config_path).resolve()
    chosen = list(stages)
    with _guard:
        hold = _holds.get(key)
    if hold is not None and set(chosen) <= hold.stages:
        note_flow_run(hold.config.run_dir)  # tasks/runtime/dead_runs.py ends this flow run if the holder is killed
        yield hold.config
        return
    config = load_config(config_path) if config is None else config
    with run_lock(config.run_dir, purpose, also=config.written_dirs(chosen), reads=config.read_dirs(chosen)):
        with _guard:
            _holds[key] = _Hold(config, frozenset(chosen))
        try:
            yield config
        finally:
            with _guard:
                if hold is None:
                    _holds.pop(key, None)
                else:
                    _holds[key] = hold


@contextmanager
def stage_run(config_path: str, stage: Stage) -> Iterator[RunConfig]:
    """The prologue every stage flow shares: its config while `stage` holds the run (`held_run`), a killed run's flow
    runs ended (a no-op under the pipeline, which ended them: the lock reports a dead holder once), and the config as
    run saved in RUN_DIR/config.yaml first."""
    with held_run(config_path, [stage], stage) as config:
        end_dead_runs(config.run_dir, get_run_logger())
        save_run_config(config)
        yield config
