"""The training recipe on the demo: which settings train a better draft on the same data, over 3 seeds.

One demo run (`eagle3 demo`'s `run_demo`: generate, records, capture, train, eval), then, on the same records,
hidden states, draft vocabulary and eval prompts, the draft trained again per recipe and seed (`train.seed`:
the draft's initial weights and the data order) and evaluated in-process (eval.backend: hf, the demo's prompts,
3 draft tokens per round). The recipes (issue 36: what the peers do differently):

- `demo`: the demo's settings (configs/demo.yaml; 512-token batches since round 1 of docs/benchmarks.md,
  `norm_before_fc` since round 2);
- `no norm_before_fc`: the demo before round 2 adopted `norm_before_fc` (round 2's baseline);
- `target lm_head`: `train.lm_head_init: target` (the draft head starts at the target's rows, as speculators does);
- `betas 0.999, clip 1.0`: AdamW betas (0.9, 0.999) and gradient clipping 1.0 (speculators' and SpecForge's);
- `equal TTT weights`: `train.ttt_step_weight: 1.0` (every TTT step's loss weighs alike, as speculators');
- `speculators' norms`: `train.norm_before_fc` and `norm_before_residual` (speculators' draft layer);
- `norm_before_fc`: that one alone (SGLang 0.5.23 serves it; not norm_before_residual);
- `Muon`: `train.optimizer: muon` (speculators' optimizer for the matrices);
- `speculators' recipe`: all of speculators' choices above at once.

A comparison of quality, not of speed: no baseline ratio (bench/README.md). Printed as the markdown table of
docs/benchmarks.md ("The training recipe"): per recipe the acceptance length per seed, their mean and spread, the
difference from `demo` and the optimizer steps:

    .venv/bin/python bench/recipe.py [--quick] [--only 'RECIPE,RECIPE'] [--skip-demo] [--keep DIR] [--json FILE]

--only runs those recipes and the demo's (--skip-demo: not the demo's); --quick trains 1 seed of 4 epochs per
recipe: a smoke run of the bench, not its figures.
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from bench.demo_drafts import COMMAND_WALLS, eagle3, print_walls, run_demo_timed  # noqa: E402
from flows.config.file import load_config  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

# recipe -> the train settings it changes from the demo's (configs/demo.yaml: max_batch_tokens 512 since round 1)
RECIPES: dict[str, dict[str, Any]] = {
    "demo": {},
    "no norm_before_fc": {"norm_before_fc": False},  # round 2's baseline: the demo before it adopted the norm
    # round 1 (docs/benchmarks.md): the head's start and the peers' AdamW settings
    "target lm_head": {"lm_head_init": "target"},
    "betas 0.999, clip 1.0": {"adam_betas": [0.9, 0.999], "grad_clip": 1.0},
    # round 2: what vLLM's speculators does that ours did not (bench/peer_trainers/speculators.py)
    "equal TTT weights": {"ttt_step_weight": 1.0},
    "speculators' norms": {"norm_before_fc": True, "norm_before_residual": True},
    "norm_before_fc": {"norm_before_fc": True},  # the half of speculators' norms that SGLang 0.5.23 serves
    "Muon": {"optimizer": "muon", "zero_stage": 0},  # ZeRO-1/2 clip Muon's update (train.optimizer's docstring)
    "speculators' recipe": {
        "ttt_step_weight": 1.0,
        "norm_before_fc": True,
        "norm_before_residual": True,
        "optimizer": "muon",
        "zero_stage": 0,
        "lm_head_init": "target",
        "adam_betas": [0.9, 0.999],
        "grad_clip": 1.0,
    },
}


@dataclass
class Params:
    """The knobs of one run: seeds per recipe, and the training length (configs/demo.yaml: 20 epochs)."""

    quick: bool = False
    seeds: int = 3
    epochs: int = 20
    only: str = ""  # comma-separated recipe names (the demo's runs too: the table's baseline); "" = all
    skip_demo: bool = False  # not the demo's seeds (their figures are reproducible: a previous run's); no "vs demo"

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, seeds=1, epochs=4)


KEPT = "the demo run, the recipes' configs and drafts"  # what --keep DIR keeps
QUICK = "1 seed of 4 epochs per recipe: a smoke run"  # what --quick runs


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
    run_dir = scratch / "run"
    _, demo_s = run_demo_timed(run_dir, {"train": {"epochs": p.epochs}})
    out["wall_s"] = {"demo": round(demo_s, 1)}
    results: dict[str, list[dict[str, Any]]] = {}
    for recipe in [r for r in chosen(p.only) if not (p.skip_demo and r == "demo")]:
        for seed in range(p.seeds):
            config = recipe_config(run_dir, recipe, seed, p.epochs)
            out["wall_s"][f"{recipe}, seed {seed}"] = round(eagle3("run", str(config), "--stages", "train,eval"), 1)
            results.setdefault(recipe, []).append({"seed": seed, **figures(config)})
            print(f"{recipe}, seed {seed}: {results[recipe][-1]['acceptance']:.3f}", flush=True)
    out["results"] = results


def chosen(only: str) -> list[str]:
    """The recipes to run: `demo` and those named in `only` (all when empty), in RECIPES' order."""
    names = {n.strip() for n in only.split(",") if n.strip()}
    unknown = sorted(names - set(RECIPES))
    if unknown:
        raise SystemExit(f"--only: unknown recipe(s) {unknown}; known: {list(RECIPES)}")
    return [r for r in RECIPES if not names or r == "demo" or r in names]


def print_table(results: dict[str, list[dict[str, Any]]]) -> None:
    base = statistics.mean(r["acceptance"] for r in results["demo"]) if "demo" in results else None
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
                f"{mean / base - 1:+.1%}" if base else "",
                f"{runs[0]['steps']}",
            )
        )
    head = ("recipe", "acceptance per seed", "mean", "spread (max - min)", "vs demo", "optimizer steps")
    harness.markdown_table(head, rows, align="llrrrr")


def report(out: dict[str, Any]) -> None:
    print_table(out["results"])
    print_walls(out["wall_s"], COMMAND_WALLS)


def main(argv: list[str] | None = None) -> int:
    return harness.bench_main("recipe", __doc__, Params, measure, report, argv, kept=KEPT, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
