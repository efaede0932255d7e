"""The training recipe on the demo: which settings train a better draft on the same data, over 3 seeds.

One demo run (`eagle3 demo`'s `run_demo`: generate, records, capture, train, eval), then, on the same records,
hidden states, draft vocabulary and eval prompts, the draft trained again per recipe and seed (`train.seed`:
the draft's initial weights and the data order) and evaluated in-process (eval.backend: hf, the demo's prompts,
3 draft tokens per round). The recipes (issue 36: what the peers do differently):

- `demo`: the demo's settings (configs/demo.yaml);
- `target lm_head`: `train.lm_head_init: target` (the draft head starts at the target's rows, as speculators does);
- `betas 0.999, clip 1.0`: AdamW betas (0.9, 0.999) and gradient clipping 1.0 (speculators' and SpecForge's);
- `512-token batches`: `train.max_batch_tokens: 512`, twice the optimizer steps per epoch on the same tokens;
- `512 + target lm_head`: both.

A comparison of quality, not of speed: no baseline ratio (bench/README.md). Printed as the markdown table of
docs/benchmarks.md ("The training recipe"): per recipe the acceptance length per seed, their mean and spread, the
difference from `demo` and the optimizer steps:

    .venv/bin/python bench/recipe.py [--quick] [--keep DIR] [--json FILE]

--quick trains 1 seed of 4 epochs per recipe: a smoke run of the bench, not its figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from bench.variants import eagle3  # noqa: E402
from flows.config.file import load_config  # noqa: E402
from models.run_layout import RunLayout  # noqa: E402

# recipe -> the train settings it changes from the demo's
RECIPES: dict[str, dict[str, Any]] = {
    "demo": {},
    "target lm_head": {"lm_head_init": "target"},
    "betas 0.999, clip 1.0": {"adam_betas": [0.9, 0.999], "grad_clip": 1.0},
    "512-token batches": {"max_batch_tokens": 512},
    "512 + target lm_head": {"max_batch_tokens": 512, "lm_head_init": "target"},
}


@dataclass
class Params:
    """The knobs of one run: seeds per recipe, and the training length (configs/demo.yaml: 20 epochs)."""

    quick: bool = False
    seeds: int = 3
    epochs: int = 20

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, seeds=1, epochs=4)


def recipe_config(run_dir: Path, recipe: str, seed: int, epochs: int) -> Path:
    """The demo's resolved config with this recipe's train settings and seed, its own draft directory, the eval
    in-process on the demo's prompts (no untrained baseline, no benchmarks: the same prompts for every draft)."""
    data = yaml.safe_load(RunLayout(run_dir).demo_config.read_text())
    slug = f"{recipe.replace(' ', '-').replace(',', '').replace('.', '')}-seed{seed}"
    data["train"].update({**RECIPES[recipe], "epochs": epochs, "seed": seed, "out_dir": str(run_dir / slug)})
    data["eval"].update({"backend": "hf", "compare_untrained": False, "benchmarks": []})
    path = run_dir / f"recipe-{slug}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def figures(config: Path) -> dict[str, Any]:
    layout = load_config(config).layout
    report = json.loads(layout.eval_report.read_text())
    summary = json.loads(layout.train_summary.read_text())
    return {
        "acceptance": report["trained"]["acceptance_length"],
        "per_position": report["trained"]["per_position_acceptance"],
        "steps": summary["steps"],
        "held_out": summary["eval"]["acceptance_length"] if summary.get("eval") else None,
    }


def measure(p: Params, scratch: Path, out: dict[str, Any]) -> None:
    from rich.console import Console

    from flows.commands.demo import run_demo

    run_dir = scratch / "run"
    started = time.monotonic()
    run_demo(run_dir=run_dir, console=Console(quiet=True), overrides={"train": {"epochs": p.epochs}})
    out["wall_s"] = {"demo": round(time.monotonic() - started, 1)}
    results: dict[str, list[dict[str, Any]]] = {}
    for recipe in RECIPES:
        for seed in range(p.seeds):
            config = recipe_config(run_dir, recipe, seed, p.epochs)
            out["wall_s"][f"{recipe}, seed {seed}"] = round(eagle3("run", str(config), "--stages", "train,eval"), 1)
            results.setdefault(recipe, []).append({"seed": seed, **figures(config)})
            print(f"{recipe}, seed {seed}: {results[recipe][-1]['acceptance']:.3f}", flush=True)
    out["results"] = results


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    base = statistics.mean(r["acceptance"] for r in results["demo"])
    rows = []
    for recipe, runs in results.items():
        values = [r["acceptance"] for r in runs]
        mean = statistics.mean(values)
        rows.append(
            (
                recipe,
                " / ".join(f"{v:.3f}" for v in values),
                f"{mean:.3f}",
                f"{max(values) - min(values):.3f}",
                f"{mean / base - 1:+.1%}",
                f"{runs[0]['steps']}",
            )
        )
    head = ("recipe", "acceptance per seed", "mean", "spread (max - min)", "vs demo", "optimizer steps")
    harness.markdown_table(head, rows, align="llrrrr")


def report(out: dict[str, Any]) -> None:
    print_table(out["results"])
    print("\nwall seconds of each `eagle3` command (its Prefect server included): " + json.dumps(out["wall_s"]))


def main(argv: list[str] | None = None) -> int:
    kept = "the demo run, the recipes' configs and drafts"
    ap = harness.arguments(__doc__, Params(), keep=kept, quick="1 seed of 4 epochs per recipe: a smoke run")
    args = ap.parse_args(argv)
    p = harness.params_from(args, Params)
    import torch

    return harness.run_bench(
        "recipe", args, asdict(p), {"torch": torch.__version__}, lambda d, o: measure(p, d, o), report, kept=kept
    )


if __name__ == "__main__":
    sys.exit(main())
