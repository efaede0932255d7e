"""`eagle3 generate` parses its config once and takes the run lock once (cli/app.py -> flows/pipeline.py -> the
generate flow, flows/stage_run.py `held_run`), and a stage flow started on its own still loads and locks for itself.

The counts are of calls to the real functions, wherever a module holds a reference to them (a `from x import f`
copies the reference, so each copy is replaced)."""

from __future__ import annotations

import sys
from pathlib import Path

import pyarrow.parquet as pq
import yaml
from typer.testing import CliRunner

import cli.app
import flows.generate
import flows.pipeline  # noqa: F401  (imported before counting: its references are replaced too)
import flows.stage_run  # noqa: F401
from flows.config import file as config_file
from tasks.runtime import run_lock as run_lock_module

REPO = Path(__file__).resolve().parents[2]


def count_calls(monkeypatch, module, name: str) -> list[tuple]:
    """Replace every module-level reference to `module.name` with one that records its positional arguments."""
    original = getattr(module, name)
    calls: list[tuple] = []

    def counting(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    for mod in list(sys.modules.values()):
        for attr, value in list(getattr(mod, "__dict__", {}).items()):
            if value is original:
                monkeypatch.setattr(mod, attr, counting)
    return calls


def passthrough_config(tmp_path: Path, target: Path) -> Path:
    """A run of one passthrough dataset (the demo's): generate copies it, no server is needed."""
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": str(target)},
        "datasets": [
            {"name": "A1_chat", "kind": "passthrough", "path": str(REPO / "data/samples/passthrough_chat.jsonl")}
        ],
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def test_eagle3_generate_loads_the_config_once_and_locks_the_run_once(tmp_path, tiny_target_dir, monkeypatch):
    path = passthrough_config(tmp_path, tiny_target_dir)
    loads = count_calls(monkeypatch, config_file, "load_config")
    locks = count_calls(monkeypatch, run_lock_module, "run_lock")

    result = CliRunner().invoke(cli.app.app, ["generate", str(path)])

    assert result.exit_code == 0, result.output
    assert [Path(a[0]) for a in loads] == [path]
    assert [Path(a[0]).resolve() for a in locks] == [(tmp_path / "run").resolve()]
    rows = pq.read_table(tmp_path / "run/passthrough/A1_chat").num_rows  # the stage ran under that one hold
    assert rows == sum(1 for line in (REPO / "data/samples/passthrough_chat.jsonl").open() if line.strip())


def test_a_stage_flow_run_on_its_own_loads_and_locks_for_itself(tmp_path, tiny_target_dir, monkeypatch):
    path = passthrough_config(tmp_path, tiny_target_dir)
    loads = count_calls(monkeypatch, config_file, "load_config")
    locks = count_calls(monkeypatch, run_lock_module, "run_lock")

    from prefect.utilities.asyncutils import run_coro_as_sync

    run_coro_as_sync(flows.generate.generate(str(path)))  # as a deployment of the generate flow runs it
    assert len(loads) == 1 and len(locks) == 1
    run_coro_as_sync(flows.generate.generate(str(path)))  # the hold ended with the first run: taken again
    assert len(loads) == 2 and len(locks) == 2
