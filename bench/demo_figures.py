"""The demos' figures the docs quote: run each demo once, keep what it printed and what its eval wrote.

Not a ratio (bench/README.md): a record. Each demo runs as a user runs it (`eagle3 demo --run-dir DIR ...`, a fresh
run directory, the CLI's own output), then this writes, under docs/figures/:

- `<demo>.txt`: what the demo printed from its first stage table on (the stage tables, the eval's tables, the last
  line), as a user reads it with the output to a file (200 columns);
- `<demo>.json`: the figures: responses per dataset, capture and training sizes (as printed), the eval's report
  (draft/eval.json without its per-prompt lists), the last line, and how the run was made (command, date, commit,
  machine, wall time).

tests/test_docs_figures.py checks every figure the docs mark (`<!-- figure: DEMO KEY -->`, `<!-- transcript: DEMO
-->`) against these files, so a doc cannot quote a figure the demo did not print. The demos are deterministic
(seeded, byte for byte) except the speed figures (tokens/s, the speedup, wall times): a rerun changes only those.

    .venv/bin/python bench/demo_figures.py [--only llama-dev,llama-vllm,kimi] [--scratch DIR]

llama-dev ~5 min on 2 cores, llama-vllm ~6 min and kimi ~11 min after `make vllm` (plus the targets' builds on first
use: ~1 and ~3 min).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.harness import cpu_model, loadavg  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

FIGURES = REPO / "docs" / "figures"
# name -> the demo's arguments besides --run-dir (what a user types after `eagle3 demo`)
DEMOS: dict[str, list[str]] = {
    "llama-dev": [],
    "llama-vllm": ["--engine", "vllm"],
    "kimi": ["--target", "kimi"],
}
PRESETS = {  # name -> the preset the demo runs (cli/demo.py DEMO_TARGETS)
    "llama-dev": REPO / "configs" / "demo.yaml",
    "llama-vllm": REPO / "configs" / "demo.yaml",
    "kimi": REPO / "configs" / "demo-kimi.yaml",
}
FIRST_KEPT = "stage 1: generate"  # the transcript starts at this rule: before it, ports and Prefect's log lines
DROPPED_KEYS = {"per_prompt", "per_prompt_rounds"}  # eval.json's per-prompt detail: in the run directory, not here
LONG_LIST = 64  # a longer list in eval.json is per-item detail, not a figure


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--only", default=",".join(DEMOS), help=f"comma-separated demos of {', '.join(DEMOS)}")
    parser.add_argument(
        "--scratch", type=Path, default=Path("/tmp/demo-figures"), help="parent of the run directories (emptied)"
    )
    parser.add_argument("--out", type=Path, default=FIGURES, help="where the figures go")
    args = parser.parse_args(argv)
    names = [n for n in args.only.split(",") if n]
    unknown = [n for n in names if n not in DEMOS]
    if unknown:
        parser.error(f"unknown demo(s) {', '.join(unknown)}; known: {', '.join(DEMOS)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in names:
        figures, transcript = run_one(name, args.scratch / name)
        (args.out / f"{name}.txt").write_text(transcript)
        (args.out / f"{name}.json").write_text(json.dumps(figures, indent=2) + "\n")
        print(f"{name}: {figures['summary']}\n  -> {args.out / name}.json, .txt ({figures['wall_s']:.0f} s)")
    return 0


def run_one(name: str, run_dir: Path) -> tuple[dict[str, Any], str]:
    """`eagle3 demo --run-dir RUN_DIR ...` in a fresh directory; its figures and its transcript."""
    if run_dir.exists():
        shutil.rmtree(run_dir)  # a fresh run: a resumed one would print the first run's figures, not its own
    command = [str(REPO / ".venv" / "bin" / "eagle3"), "demo", "--run-dir", str(run_dir), *DEMOS[name]]
    commit = git("rev-parse", "--short", "HEAD")  # the code the demo runs: HEAD, and whether the tree differs
    uncommitted = bool(git("status", "--porcelain", "--untracked-files=no"))
    started = time.monotonic()
    load_before = loadavg()
    out = subprocess.run(command, cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ, "COLUMNS": "200"})
    wall = time.monotonic() - started
    if out.returncode != 0:
        sys.stderr.write(out.stdout[-5000:])
        raise SystemExit(f"{name}: `{' '.join(command)}` exited {out.returncode}")
    transcript = kept_transcript(out.stdout)
    report = json.loads(RunLayout(run_dir).eval_report.read_text())
    figures = {
        "demo": name,
        "command": " ".join(["eagle3", *command[1:]]),
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "uncommitted_changes": uncommitted,
        "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_before": load_before},
        "wall_s": round(wall, 1),
        "preset": preset(name),
        "generate": generated(run_dir),
        **printed_sizes(transcript),
        "eval": slim(report),
        "summary": summary_line(transcript),
    }
    return figures, transcript


def preset(name: str) -> dict[str, Any]:
    """The demo's preset as parsed, without `run_dir` (the figures do not depend on where the run goes):
    tests/test_docs_figures.py compares it with today's, so a changed preset asks for new figures."""
    import yaml

    data = yaml.safe_load(PRESETS[name].read_text())
    data.pop("run_dir", None)
    return {"file": str(PRESETS[name].relative_to(REPO)), "settings": data}


def kept_transcript(stdout: str) -> str:
    """The demo's output from its first stage rule on, trailing spaces dropped."""
    lines = stdout.splitlines()
    first = next((i for i, line in enumerate(lines) if FIRST_KEPT in line), 0)
    return "\n".join(line.rstrip() for line in lines[first:]) + "\n"


def generated(run_dir: Path) -> dict[str, Any]:
    """Responses per generated dataset and in all, and the median answer's completion tokens, from the checkpoints'
    footers (`eagle3 stats`)."""
    from tasks.responses.stats import collect_stats, total_stats

    stats = collect_stats(run_dir)
    counts = {s.dataset: s.responses for s in stats}
    return {"responses": {**counts, "total": sum(counts.values())}, "p50_length": total_stats(stats).p50_length}


def printed_sizes(transcript: str) -> dict[str, Any]:
    """The capture's and the training's sizes as the demo printed them."""
    hidden = re.search(r"hidden states: ([\d,]+) samples, ([\d,]+) tokens", transcript)
    trained = re.search(r"trained ([\d,]+) steps on ([\d,]+) tokens", transcript)
    if not hidden or not trained:
        raise SystemExit("the demo's output has no capture or train line: has its wording changed?")
    number = lambda s: int(s.replace(",", ""))  # noqa: E731
    return {
        "capture": {"samples": number(hidden[1]), "tokens": number(hidden[2])},
        "train": {"steps": number(trained[1]), "tokens": number(trained[2])},
    }


def summary_line(transcript: str) -> str:
    """The demo's last word (cli/demo.py eval_summary_line), as one line."""
    text = " ".join(transcript.split())
    start = text.rfind("acceptance length ")
    return text[start:]


def slim(value: Any) -> Any:
    """eval.json without its per-prompt detail (DROPPED_KEYS, lists longer than LONG_LIST)."""
    if isinstance(value, dict):
        return {k: slim(v) for k, v in value.items() if k not in DROPPED_KEYS}
    if isinstance(value, list):
        return [slim(v) for v in value] if len(value) <= LONG_LIST else f"<{len(value)} items: see the run's eval.json>"
    return value


def git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True).stdout.strip()


if __name__ == "__main__":
    sys.exit(main())
