"""What the benches that train drafts on a demo run share: the `eagle3` CLI run and timed, the demo run in this
process and timed, and an eval's figures in-process and in the real vLLM, with their table cells.

bench/variants.py, recipe.py, peers.py and kimi_drafts.py run `eagle3 demo` once (`run_demo`), train drafts again on
its records and hidden states through `eagle3 run CONFIG --stages ...`, and measure them with `eagle3 eval CONFIG
--draft DIR`; each keeps its own configs, rows and tables.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.harness import REPO  # first: the offline environment
from flows.config.file import load_config


def eagle3(*args: str) -> float:
    """Run the CLI (its own temporary Prefect server); the wall seconds. Raises with its output's tail on failure."""
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    started = time.monotonic()
    done = subprocess.run(
        [str(Path(sys.executable).parent / "eagle3"), *args], capture_output=True, text=True, env=env, cwd=REPO
    )
    if done.returncode:
        raise RuntimeError(f"eagle3 {' '.join(args)} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return time.monotonic() - started


def run_demo_timed(run_dir: Path, overrides: dict[str, Any] | None, **options: Any) -> tuple[Any, float]:
    """`eagle3 demo` (cli/demo.py `run_demo`) in this process, its Prefect server too, quiet, into `run_dir`
    with these config overrides (and `options`: engine, target): its resolved config and its wall seconds."""
    from rich.console import Console

    from cli.demo import run_demo

    started = time.monotonic()
    config = run_demo(run_dir=run_dir, console=Console(quiet=True), overrides=overrides, **options)
    return config, time.monotonic() - started


def evaluate_draft(config: Path, draft: Path) -> tuple[dict[str, Any], float, dict[str, Any]]:
    """`eagle3 eval CONFIG --draft DIR` with `eval.backend: both`: the figures of its report in-process and in vLLM
    (acceptance, per position, vLLM's per round, whether the two agree prompt by prompt, on how many prompts), its
    wall seconds, and the whole report."""
    eval_s = eagle3("eval", str(config), "--draft", str(draft))
    _, report_path, _ = load_config(config).layout.eval_of(str(draft))
    report = json.loads(report_path.read_text())
    hf, engine = report["trained"], report["engine"]["overall"]
    figures = {
        "acceptance": hf["acceptance_length"],
        "per_position": hf["per_position_acceptance"],
        "vllm_per_round": engine["per_round"],
        "vllm_equal": report["engine_vs_hf"]["equal"],
        "prompts": report["engine_vs_hf"]["prompts_compared"],
    }
    return figures, eval_s, report


def eval_cells(r: dict[str, Any]) -> list[str]:
    """An eval's figures (`evaluate_draft`) as table cells: acceptance in-process, vLLM's per round, whether they
    agree (on how many prompts), per position."""
    return [
        f"{r['acceptance']:.3f}",
        f"{r['vllm_per_round']:.3f}",
        f"{'yes' if r['vllm_equal'] else 'NO'} ({r['prompts']} prompts)",
        " / ".join(f"{a:.2f}" for a in r["per_position"]),
    ]


COMMAND_WALLS = "wall seconds of each `eagle3` command (its Prefect server included)"


def print_walls(walls: dict[str, Any], label: str = "wall seconds") -> None:
    """A report's closing line: the wall seconds of the demo and of what the bench ran on it (its `wall_s`)."""
    print(f"\n{label}: " + json.dumps(walls))
