"""The run directory's layout: each path where the docs say, the output directories settings move, and no
path of it spelled anywhere but settings/layout.py."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from settings.layout import LOCK_NAME, RunLayout

REPO = Path(__file__).resolve().parents[2]
LAYOUT_FILE = REPO / "settings" / "layout.py"
SCANNED = ("settings", "flows", "tasks", "models", "emulators", "bench")

# (file, literal) -> why that literal there is not a path of the run directory.
ALLOWED = {
    (
        "models/capture/vllm_hidden.py",
        ".lock",
    ): "LOCK_SUFFIX: the suffix of a per-file lock beside the vLLM connector's "
    "request files (f'{path}.lock'), not the run directory's write lock",
}


def test_every_path_under_the_run_directory():
    run = Path("/runs/kimi")
    layout = RunLayout(run)
    assert layout.run_dir == run
    assert layout.config == Path("/runs/kimi/config.yaml")
    assert layout.demo_config == Path("/runs/kimi/demo-config.yaml")
    assert layout.lock == Path("/runs/kimi/.lock")
    assert layout.responses_root == Path("/runs/kimi/responses")
    assert layout.responses("B1") == Path("/runs/kimi/responses/B1")
    assert layout.rejects_root == Path("/runs/kimi/rejects")
    assert layout.rejects("B1") == Path("/runs/kimi/rejects/B1")
    assert layout.passthrough("A1") == Path("/runs/kimi/passthrough/A1")
    assert layout.records_root == Path("/runs/kimi/records")
    assert layout.records("B1") == Path("/runs/kimi/records/B1")
    assert layout.token_counts == Path("/runs/kimi/records/token_counts.parquet")
    assert layout.hub_record("H1") == Path("/runs/kimi/datasets/H1.json")
    assert layout.job("capture") == Path("/runs/kimi/jobs/capture.json")
    assert layout.job("train") == Path("/runs/kimi/jobs/train.json")
    assert layout.job("eval") == Path("/runs/kimi/jobs/eval.json")
    assert layout.logs == Path("/runs/kimi/logs")
    assert layout.hidden_dir == Path("/runs/kimi/hidden")
    assert layout.engine_dir == Path("/runs/kimi/engine")
    assert layout.draft_dir == Path("/runs/kimi/draft")
    assert layout.checkpoints == Path("/runs/kimi/draft/checkpoints")
    assert layout.final == Path("/runs/kimi/draft/final")
    assert layout.metrics == Path("/runs/kimi/draft/metrics.jsonl")
    assert layout.train_summary == Path("/runs/kimi/draft/train_summary.json")
    assert layout.eval_report == Path("/runs/kimi/draft/eval.json")
    assert layout.eval_raw == Path("/runs/kimi/draft/.eval-raw.json")
    assert layout.training_plot == Path("/runs/kimi/draft/training.png")
    assert layout.ds_config == Path("/runs/kimi/draft/ds_config.json")
    assert layout.tensorboard == Path("/runs/kimi/draft/tensorboard")
    assert LOCK_NAME == ".lock"


def test_settings_move_the_output_directories_out_of_the_run_directory():
    layout = RunLayout(
        "/runs/kimi",
        hidden_dir=Path("/nvme/hidden-k25"),
        draft_dir="/shared/draft-k25",
        engine_dir=Path("/dev/shm/connector"),
    )
    assert layout.run_dir == Path("/runs/kimi")  # a str is taken as a path
    assert layout.hidden_dir == Path("/nvme/hidden-k25")
    assert layout.engine_dir == Path("/dev/shm/connector")
    assert layout.draft_dir == Path("/shared/draft-k25")
    # the draft's entries follow it; everything else stays in RUN_DIR
    assert layout.checkpoints == Path("/shared/draft-k25/checkpoints")
    assert layout.final == Path("/shared/draft-k25/final")
    assert layout.metrics == Path("/shared/draft-k25/metrics.jsonl")
    assert layout.eval_report == Path("/shared/draft-k25/eval.json")
    assert layout.eval_raw == Path("/shared/draft-k25/.eval-raw.json")
    assert layout.records("B1") == Path("/runs/kimi/records/B1")
    assert layout.token_counts == Path("/runs/kimi/records/token_counts.parquet")
    assert layout.job("train") == Path("/runs/kimi/jobs/train.json")
    assert layout.logs == Path("/runs/kimi/logs")
    assert layout.lock == Path("/runs/kimi/.lock")


def test_a_layout_is_a_value():
    assert RunLayout("/r") == RunLayout(Path("/r"), hidden_dir=Path("/r/hidden"))  # the default, spelled out
    assert RunLayout("/r") != RunLayout("/r", hidden_dir=Path("/elsewhere"))
    with pytest.raises(AttributeError):
        RunLayout("/r").run_dir = Path("/s")  # type: ignore[misc]
    with pytest.raises(TypeError):
        RunLayout("/r", "/h")  # type: ignore[misc]  # the output directories are named, never positional


def test_a_damaged_part_is_moved_to_the_same_place_under_quarantine():
    layout = RunLayout(Path("/runs/kimi"))
    assert layout.quarantine(layout.responses("B1")) == Path("/runs/kimi/quarantine/responses/B1")
    assert layout.quarantine(layout.rejects("B1")) == Path("/runs/kimi/quarantine/rejects/B1")
    assert layout.quarantine(Path("/elsewhere/B1")) == Path("/runs/kimi/quarantine")  # not under RUN_DIR
    assert RunLayout.of_dataset_dir(Path("/runs/kimi/responses/B1")) == layout
    assert RunLayout.of_dataset_dir(Path("/runs/kimi/records/B1")).token_counts == Path(
        "/runs/kimi/records/token_counts.parquet"
    )


# --- no path of the layout spelled outside settings/layout.py -------------------------------------------------------


def layout_names() -> set[str]:
    """The names settings/layout.py joins into paths: the str operands of its `/`, the names of its `_Entry`s
    and its module-level str constants."""
    tree = ast.parse(LAYOUT_FILE.read_text())
    names = {
        node.value.value
        for node in tree.body
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
    }
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            names |= {
                side.value
                for side in (node.left, node.right)
                if isinstance(side, ast.Constant) and isinstance(side.value, str)
            }
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_Entry":
            name = node.args[1]
            if isinstance(name, ast.Constant) and isinstance(name.value, str):
                names.add(name.value)
    return names


def test_the_scan_knows_the_layout():
    assert {
        "responses",
        "rejects",
        "passthrough",
        "records",
        "token_counts.parquet",
        "datasets",
        "quarantine",
        "jobs",
        "logs",
        "hidden",
        "engine",
        "draft",
        "checkpoints",
        "final",
        "metrics.jsonl",
        "train_summary.json",
        "eval.json",
        ".eval-raw.json",
        "config.yaml",
        "demo-config.yaml",
        ".lock",
    } <= layout_names()


def _spelled(path: Path, names: set[str]):
    """(line, literal) for each layout name in `path` used as a path: a file name (it has a dot) anywhere, a
    directory name where a path is built (`/`, Path(...), joinpath, os.path.join, a glob pattern), compared with a
    name, or given a CONSTANT's name of its own."""
    tree = ast.parse(path.read_text(), str(path))
    parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Constant) and isinstance(node.value, str)):
            continue
        value, parent = node.value, parents.get(node)
        if isinstance(parent, ast.JoinedStr):
            continue  # a piece of an f-string: text for a person, not a path
        if value in names and "." in value:
            yield node.lineno, value
        elif value in names and _builds_a_path(parent):
            yield node.lineno, value
        elif isinstance(parent, ast.Call) and _called(parent) in ("glob", "rglob") and value.split("/")[0] in names:
            yield node.lineno, value


def _called(call: ast.Call) -> str | None:
    func = call.func
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _builds_a_path(parent: ast.AST | None) -> bool:
    if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Div):
        return True
    if isinstance(parent, ast.Call) and _called(parent) in ("Path", "PurePath", "joinpath", "join"):
        return True
    if isinstance(parent, ast.Assign):  # `RESPONSES = "responses"`: a second declaration of the name
        return all(isinstance(t, ast.Name) and t.id.isupper() for t in parent.targets)
    # `part.parent.name == "responses"`: a directory told by its name
    return isinstance(parent, ast.Compare) and any(
        isinstance(side, ast.Attribute) and side.attr in ("name", "stem") for side in (parent.left, *parent.comparators)
    )


def test_no_path_of_the_run_directory_is_spelled_outside_the_layout():
    names = layout_names()
    found, allowed_seen = [], set()
    for package in SCANNED:
        for path in sorted((REPO / package).rglob("*.py")):
            if path == LAYOUT_FILE:
                continue
            rel = str(path.relative_to(REPO))
            for line, value in _spelled(path, names):
                if (rel, value) in ALLOWED:
                    allowed_seen.add((rel, value))
                else:
                    found.append(f"{rel}:{line}: {value!r} (ask settings/layout.py's RunLayout for the path)")
    assert found == []
    assert allowed_seen == set(ALLOWED), "an allow-list entry no longer matches anything: remove it"


def test_drafts_of_the_same_name_elsewhere_keep_a_report_each(tmp_path):
    """eval --draft DIR: the report folder is the draft's name and a digest of its resolved path, so two trainers'
    `final` do not overwrite each other's eval.json; the same draft, however written, is the same folder."""
    layout = RunLayout(tmp_path / "run")
    (tmp_path / "a" / "final").mkdir(parents=True)
    (tmp_path / "b" / "final").mkdir(parents=True)
    a, b = layout.eval_of(str(tmp_path / "a" / "final")), layout.eval_of(str(tmp_path / "b" / "final"))
    assert a[0] == tmp_path / "a" / "final"
    assert a[1].parent != b[1].parent and a[1].parent.parent == b[1].parent.parent == tmp_path / "run" / "evals"
    assert a[1].parent.name.startswith("final-") and len(a[1].parent.name) == len("final-") + 8
    assert layout.eval_of(str(tmp_path / "b" / ".." / "a" / "final"))[1] == a[1]
    assert layout.eval_of("final")[1] == layout.eval_report  # the run's own drafts keep draft/eval.json
