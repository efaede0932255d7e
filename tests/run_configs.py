"""A run config written as a test needs it: the YAML file a user would pass to `eagle3` or a deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_run_config(path: Path, run_dir: Path, target: Path, datasets: list[dict], **sections: Any) -> Path:
    """RUN_DIR, the target, the datasets and any sections given (server=..., sampling=...), as YAML in `path`."""
    config = {"run_dir": str(run_dir), "target": {"path": str(target)}, **sections, "datasets": datasets}
    path.write_text(yaml.safe_dump(config))
    return path


REPO = Path(__file__).resolve().parents[1]

# The training-time-test steps of the tests' trainings that feed an engine or an eval (train.ttt_steps; 7 by default):
# the eval speculates 3 tokens a round (eval.num_steps), so 3 steps train every position it drafts, and the tests
# compare the engine's rounds with the in-process eval's, for which a draft needs some tokens right, not a good one.
# The training's compute is about linear in the steps: `eagle3 run --stages train` of the Kimi test demo's 2 epochs
# took 95 CPU-s with 7 steps and 62 with 3 (the same held-out acceptance estimate, 1.48 and 1.47).
TEST_TTT_STEPS = 3
# The ranks of those tests' captures and trainings where the engine is the subject (capture.num_gpus, train.num_gpus;
# the demo's 2): each rank is a process that spends ~9 CPU-s importing torch, transformers and DeepSpeed and joining
# the group before its first batch. Two or more ranks are the subject of tests/models/, tests/tasks/test_multinode.py,
# test_demo.py and the Kimi test's ZeRO-3 capture.
TEST_RANKS = 1


def write_demo_config(tmp_path: Path, target: Path, trust_remote_code: bool | None = None, **sections: Any) -> Path:
    """configs/demo.yaml for a run in tmp_path on `target` (already built), with `sections` merged over it.
    `trust_remote_code`: target.trust_remote_code; by default set when the target ships its tokenizer as code (the kimi
    build, as Kimi-K2.5 publishes it), as a config for such a target must."""
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["run_dir"] = str(tmp_path / "run")
    if trust_remote_code is None:
        trust_remote_code = (Path(target) / "tokenization_kimi.py").is_file()
    data["target"] = {"path": str(target), "trust_remote_code": trust_remote_code}
    for d in data["datasets"]:
        d["path"] = str(REPO / d["path"])
    data["eval"]["prompt_files"] = [str(REPO / p) for p in data["eval"]["prompt_files"]]
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def demo_benchmarks(limit: int) -> list[dict]:
    """configs/demo.yaml's published benchmark formats (data/benchmarks/), `limit` questions each, paths resolved: a
    shorter demo's eval still decodes each format, in-process and through the engine."""
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    return [{**b, "path": str(REPO / b["path"]), "limit": limit} for b in data["eval"]["benchmarks"]]


def short_demo(run_dir: Path, target_dir: Path, overrides: dict, **demo: Any) -> tuple[Any, str]:
    """`eagle3 demo` in `run_dir` on `target_dir`, its preset's sections updated with `overrides` (a shorter training
    and eval), `demo` the rest of run_demo's arguments (engine, target): (its config, what it printed)."""
    import io

    from rich.console import Console

    from cli.demo import run_demo

    out = io.StringIO()
    config = run_demo(
        run_dir=run_dir, console=Console(file=out, width=200), target_dir=target_dir, overrides=overrides, **demo
    )
    return config, out.getvalue()
