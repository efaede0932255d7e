"""The prologue every stage flow shares: its config loaded, the run directory locked for it, the config saved."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger

from flows.config.file import load_config, save_run_config
from flows.config.schema import RunConfig
from tasks.dead_runs import end_dead_runs
from tasks.run_lock import run_lock


@contextmanager
def stage_run(config_path: str, stage: str) -> Iterator[RunConfig]:
    """`config_path`'s config while `stage` holds the run: one writer per run directory, and per directory outside it
    that the stage writes (`RunConfig.written_dirs`; shared for those it only reads, `read_dirs`), with the config as
    run saved in RUN_DIR/config.yaml first (tasks/run_lock.py: a process that already holds the lock, the pipeline,
    takes it again)."""
    config = load_config(config_path)
    with run_lock(config.run_dir, stage, also=config.written_dirs([stage]), reads=config.read_dirs([stage])):
        end_dead_runs(config.run_dir, get_run_logger())  # a stage deployment started on its own (else: the pipeline)
        save_run_config(config)
        yield config
