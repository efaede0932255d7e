"""EAGLE-3 against EAGLE-3.1, and hidden states stored native against fp8, side by side on the demo.

One demo run (`eagle3 demo`'s `run_demo`: generate, records, a capture in the tiny target's float32, an EAGLE-3
draft, the eval), then on the same records and the same held-out prompts:

- `eagle3, bf16`: a capture with the target in bfloat16 (`capture.dtype`), stored so, and an EAGLE-3 draft on it;
- `eagle3, fp8`: the same bfloat16 forward stored as fp8 (`capture.storage: fp8`), and an EAGLE-3 draft on it;
- `eagle3.1`: a draft with `train.draft_variant: eagle3.1` on the demo's float32 capture;
- `eagle3.1, fp8`: the same on the fp8 capture.

Each new draft is evaluated in-process (eval.backend: hf, the demo's prompts and settings); the demo's own
draft is the first row. A comparison of quality, not of speed: no baseline ratio (bench/README.md). Printed
as the markdown table of docs/variants.md:

    .venv/bin/python bench/variants.py [--quick] [--keep DIR] [--json FILE]   # 22 min on 2 cores

--quick trains each draft 4 epochs instead of 20 (866 s on 2 cores): a smoke run of the bench, not its figures.
"""

from __future__ import annotations

import json
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
from models.capture.shards import METADATA_NAME, list_shards  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

# name -> (capture.out_dir under RUN_DIR, or None for the demo's own; capture.dtype; capture.storage;
# train.draft_variant)
VARIANTS = {
    "eagle3": (None, "auto", "native", "eagle3"),
    "eagle3, bf16": ("hidden-bf16", "bfloat16", "native", "eagle3"),
    "eagle3, fp8": ("hidden-fp8", "bfloat16", "fp8", "eagle3"),
    "eagle3.1": (None, "auto", "native", "eagle3.1"),
    "eagle3.1, fp8": ("hidden-fp8", "bfloat16", "fp8", "eagle3.1"),
}


@dataclass
class Params:
    """The knobs of one run: the demo's training length for every draft (configs/demo.yaml: 20 epochs)."""

    quick: bool = False
    epochs: int = 20

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, epochs=4)


KEPT = "the demo run, the variants' configs, captures and drafts"  # what --keep DIR keeps
QUICK = "4 epochs per draft instead of 20: a smoke run"  # what --quick runs


def variant_config(run_dir: Path, name: str, epochs: int) -> Path:
    """The demo's resolved config with this variant's capture directory, storage, draft variant and draft directory
    (the demo's own config for its own draft, EAGLE-3 on the native capture)."""
    hidden, dtype, storage, draft_variant = VARIANTS[name]
    demo = RunLayout(run_dir).demo_config
    if (hidden, draft_variant) == (None, "eagle3"):
        return demo
    data = yaml.safe_load(demo.read_text())
    data["train"]["epochs"] = epochs
    if hidden is not None:
        data["capture"].update({"out_dir": str(run_dir / hidden), "dtype": dtype, "storage": storage})
    slug = name.replace(", ", "-").replace(".", "")
    data["train"].update({"draft_variant": draft_variant, "out_dir": str(run_dir / f"draft-{slug}")})
    if draft_variant == "eagle3.1":  # EAGLE-3.1's norm per aux feature replaces the demo's one over all of them
        data["train"]["norm_before_fc"] = False
    data["eval"]["backend"] = "hf"
    path = run_dir / f"variant-{slug}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def figures(config: Path) -> dict:
    """What the table shows of one variant: its capture's bytes and speed, its loss curve, its measured acceptance."""
    layout = load_config(config).layout
    meta = json.loads((layout.hidden_dir / METADATA_NAME).read_text())
    losses = [
        (line["step"], line["loss"])
        for line in map(json.loads, layout.metrics.read_text().splitlines())
        if line["kind"] == "train"
    ]
    report = json.loads(layout.eval_report.read_text())
    trained = report["trained"]
    return {
        "storage": meta.get("storage", "native"),
        "dtype": meta["dtype"],
        "bytes_per_token": sum(p.stat().st_size for p in list_shards(layout.hidden_dir)) / meta["tokens"],
        "capture_tokens_per_s": meta["tokens_per_s"],
        "loss": [losses[0], losses[len(losses) // 2], losses[-1]],
        "acceptance_per_round": trained["acceptance_length"],
        "per_position": trained["per_position_acceptance"],
        "rounds": trained["rounds"],
        "ttt_estimate": (report.get("ttt_estimate") or {}).get("acceptance_length"),
        "prompts": report["prompts"],
    }


def print_table(results: dict[str, dict]) -> None:
    rows = []
    for name, f in results.items():
        rows.append(
            (
                name,
                f"{f['storage']} ({f['dtype']})",
                f"{f['bytes_per_token']:,.0f}",
                f"{f['capture_tokens_per_s']:,.0f}",
                " / ".join(f"{v:.3f} (step {s})" for s, v in f["loss"]),
                f"{f['acceptance_per_round']:.3f}",
                " / ".join(f"{a:.3f}" for a in f["per_position"]),
                f"{f['rounds']:,}",
                "" if f["ttt_estimate"] is None else f"{f['ttt_estimate']:.3f}",
            )
        )
    head = (
        "draft",
        "storage",
        "bytes/token",
        "capture tokens/s",
        "loss (first / middle / last step)",
        "acceptance per round",
        "per position",
        "rounds",
        "TTT estimate",
    )
    harness.markdown_table(head, rows, align="llrrlrlrr")


def measure(p: Params, scratch: Path, out: dict[str, Any]) -> None:
    run_dir = scratch / "run"
    _, demo_s = run_demo_timed(run_dir, {"train": {"epochs": p.epochs}})  # `eagle3 demo` with the epochs
    walls = {"demo": demo_s}
    configs = {}
    for name, (hidden, _, _, draft_variant) in VARIANTS.items():
        configs[name] = variant_config(run_dir, name, p.epochs)
        if (hidden, draft_variant) == (None, "eagle3"):
            continue  # the demo's own draft
        captured = hidden is None or (run_dir / hidden / METADATA_NAME).is_file()
        stages = "train,eval" if captured else "capture,train,eval"
        walls[name] = eagle3("run", str(configs[name]), "--stages", stages)
    out["results"] = {name: figures(path) for name, path in configs.items()}
    out["wall_s"] = walls


def report(out: dict[str, Any]) -> None:
    print_table(out["results"])
    print_walls(out["wall_s"], COMMAND_WALLS)


def main(argv: list[str] | None = None) -> int:
    return harness.bench_main("variants", __doc__, Params, measure, report, argv, kept=KEPT, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
