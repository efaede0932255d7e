"""Draft shapes for Kimi on the Kimi-K2.5-shaped demo: Llama-style against MLA, plain against YaRN rope, EAGLE-3
against 3.1, each measured in the real vLLM 0.32 on the same prompts.

One `eagle3 demo --target kimi` run (`run_demo`: generate through the real vLLM, records, the capture under ZeRO-3,
its own Llama-style EAGLE-3 draft, the eval), then on the same records, hidden states and draft vocabulary, one draft
per row (`train.draft_arch`, `train.draft_rope`, `train.draft_variant`; 1 layer, the demo's 20 epochs and settings):

- `llama, eagle3, YaRN`: the Llama-style draft with the target's YaRN (`draft_rope: target`, the default);
- `llama, eagle3, plain`: the same with plain RoPE at the target's base (`draft_rope: plain`);
- `llama, eagle3.1, YaRN`: the Llama-style draft with EAGLE-3.1's two changes;
- `mla, eagle3, YaRN`: the MLA draft (models/draft/mla.py) with the target's rope, YaRN x64 (`draft_rope: target`);
- `mla, eagle3, plain`: the MLA draft with plain rope at the target's base (`draft_rope: plain`);
- `mla, eagle3.1, YaRN`: the MLA draft with EAGLE-3.1's changes.

Each draft is measured by `eagle3 eval CONFIG --draft DIR` with `eval.backend: both` on the demo's prompts: in-process
and in the real vLLM (.venv-vllm, `make vllm`) serving the target with that draft (MLA kept on for an MLA draft:
tasks/serving/vllm.py `shape_words`), the two counts compared prompt by prompt. The table: acceptance, vLLM's count,
per position, the draft's parameters (its own tensors: no embedding, no vocabulary map), optimizer steps and
training tokens/s (trained tokens over the wall time of `eagle3 run --stages train`, its Prefect server included).

The same eval also decodes the long-context set (data/eval/long_context.jsonl, tools/long_context_set.py: 24
conversations of 280-2,754 tokens, 64 new tokens each) as the benchmark `long_context`, in-process and in vLLM
(started with --max-model-len 4096 for it). The second table: each draft's acceptance length per verify round on it,
vLLM's beside it, the in-process rounds by context position (models/eval/context.py, the eval's default buckets),
and whether vLLM's rounds, placed from its per-round counts (`--per-request-spec-decode-metrics detailed`), fall in
the same buckets with the same tokens.
The drafts were trained on records of at most ~400 tokens.

`--target kimi-long` does the same on the demo of long answers (`eagle3 demo --target kimi-long`,
configs/demo-kimi-long.yaml: the Kimi-shaped target trained on a book, its records cut to their first 1,024 tokens,
10 epochs), and its second table is the demo's own benchmark: chapters 6-10 of the book (data/eval/long_answers.jsonl),
answers of 112-1,942 tokens decoded to their end, by context position in-process and as vLLM placed each round.

`--reuse DIR` evaluates the drafts of a run this bench kept (`--keep`: DIR is its `run` directory) again, without the
demo and the training: both tables, with no training tokens/s (the training did not run). `--demo DIR` trains and
evaluates the rows on a run directory of `eagle3 demo --target T` made beforehand (the same demo the bench would
run), instead of running the demo again; the rows' configs and drafts are written into it.

A comparison of quality, not a wall-clock target (bench/README.md). Printed as the markdown table of
docs/variants.md ("Draft shapes for Kimi"):

    .venv/bin/python bench/kimi_drafts.py [--target kimi|kimi-long] [--quick] [--epochs N] [--keep DIR] [--json FILE]
                                          [--reuse DIR | --demo DIR]

--epochs defaults to the demo's (kimi 20, kimi-long 10). --quick trains 4 epochs: a smoke run of the bench, not
its figures. Run nothing else meanwhile (the tokens/s).
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from safetensors import safe_open

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from bench.demo_drafts import eagle3, eval_cells, evaluate_draft, print_walls, run_demo_timed  # noqa: E402
from flows.config.file import load_config  # noqa: E402
from models.export.format import EMBED, WEIGHTS_FILE  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

# row -> the train settings it sets over the Kimi demo's (configs/demo-kimi.yaml)
ROWS: dict[str, dict[str, str]] = {
    "llama, eagle3, YaRN": {"draft_arch": "llama", "draft_variant": "eagle3", "draft_rope": "target"},
    "llama, eagle3, plain": {"draft_arch": "llama", "draft_variant": "eagle3", "draft_rope": "plain"},
    "llama, eagle3.1, YaRN": {"draft_arch": "llama", "draft_variant": "eagle3.1", "draft_rope": "target"},
    "mla, eagle3, YaRN": {"draft_arch": "mla", "draft_variant": "eagle3", "draft_rope": "target"},
    "mla, eagle3, plain": {"draft_arch": "mla", "draft_variant": "eagle3", "draft_rope": "plain"},
    "mla, eagle3.1, YaRN": {"draft_arch": "mla", "draft_variant": "eagle3.1", "draft_rope": "target"},
}


# the long-context set as the eval's benchmark: every row, 64 new tokens after up to 2,754 prompt tokens
LONG_CONTEXT = {
    "name": "long_context",
    "path": str(REPO / "data" / "eval" / "long_context.jsonl"),
    "format": "chat",
    "limit": None,
    "max_new_tokens": 64,
}
MAX_MODEL_LEN = 4096

# target -> the benchmark of the second table: the long-context set added to the Kimi demo's eval, or (None) the
# demo's own (kimi-long: its long answers, configs/demo-kimi-long.yaml)
TARGETS: dict[str, dict[str, Any] | None] = {"kimi": LONG_CONTEXT, "kimi-long": None}


@dataclass
class Params:
    """The knobs of one run: the demo and the training length of every draft (0: the demo's, configs/demo-kimi.yaml
    20 epochs, configs/demo-kimi-long.yaml 10)."""

    quick: bool = False
    target: str = "kimi"
    epochs: int = 0
    reuse: str = ""  # a kept run directory (RUN of --keep): evaluate its drafts again, no demo, no training
    demo: str = ""  # a run directory of `eagle3 demo --target TARGET`: train and evaluate the rows on it

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, epochs=4)

    def validate(self) -> None:
        if self.target not in TARGETS:
            raise SystemExit(f"--target {self.target}: must be one of {', '.join(TARGETS)}")
        if self.epochs < 0:
            raise SystemExit(f"--epochs {self.epochs}: must be 0 (the demo's) or more")
        if self.reuse and self.demo:
            raise SystemExit("--reuse and --demo: give one (--reuse evaluates kept drafts, --demo trains them)")
        for flag, given, what in (
            (
                "--reuse",
                self.reuse,
                "the `run` directory of a run this bench kept (--keep DIR writes DIR/bench-kimi-drafts-*/run)",
            ),
            ("--demo", self.demo, f"the run directory of `eagle3 demo --target {self.target} --run-dir DIR`"),
        ):
            if not given:
                continue
            config = RunLayout(Path(given)).demo_config
            if not config.is_file():
                raise SystemExit(f"{flag} {given}: no demo config there; give {what}")
            shape = yaml.safe_load(config.read_text())["target"].get("tiny_shape")
            if shape != self.target:
                raise SystemExit(
                    f"{flag} {given}: a demo of the {shape} target, not {self.target}; give --target {shape}"
                )
        trained = [row_dir(Path(self.demo), name) for name in ROWS if self.demo]
        if any(d.exists() for d in trained):
            raise SystemExit(
                f"--demo {self.demo}: {next(d for d in trained if d.exists())} is there from an earlier run, and its "
                "training would resume instead of being timed; delete the draft-* directories there, or evaluate "
                f"them again with --reuse {self.demo}"
            )


KEPT = "the Kimi demo run, each row's config, draft and eval report"  # what --keep DIR keeps
QUICK = "4 epochs per draft: a smoke run"  # what --quick runs


def row_dir(run_dir: Path, name: str) -> Path:
    """Where a row's draft trains in the demo's run directory: draft-<row, as a slug>."""
    return run_dir / f"draft-{row_slug(name)}"


def row_slug(name: str) -> str:
    return name.replace(", ", "-").replace(".", "").lower()


def row_config(run_dir: Path, name: str, epochs: int, target: str = "kimi") -> Path:
    """The demo's resolved config with this row's draft settings and directory (`epochs` 0: the demo's), its server
    the real vLLM as the demo starts it for this draft (--max-model-len MAX_MODEL_LEN), and the eval in-process AND
    in vLLM on the demo's prompts and the target's benchmark (TARGETS)."""
    from cli.demo import demo_server

    data = yaml.safe_load(RunLayout(run_dir).demo_config.read_text())
    data["train"].update({**ROWS[name], "out_dir": str(row_dir(run_dir, name))})
    if epochs:
        data["train"]["epochs"] = epochs
    data["eval"].update(
        {
            "backend": "both",
            "compare_untrained": False,
            "baseline": False,
            "prompt_files": [str(REPO / "data" / "eval" / "prompts.jsonl")],  # this checkout's (for --reuse)
        }
    )
    if TARGETS[target] is not None:
        data["eval"]["benchmarks"] = [TARGETS[target]]
    path = run_dir / f"kimi-{row_slug(name)}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    server = demo_server(load_config(path), "vllm", data["server"]["url"])  # MLA on or off for this draft
    data["server"] = server.model_dump(mode="json", exclude_none=True)
    command = data["server"]["command"]  # vLLM's CPU command (tasks/serving/vllm.py cpu_command): room for the set
    command[command.index("--max-model-len") + 1] = str(MAX_MODEL_LEN)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def draft_parameters(draft_dir: Path) -> int:
    """The export's own weights: every tensor but the target's embedding and the vocabulary map."""
    with safe_open(str(draft_dir / WEIGHTS_FILE), framework="pt") as f:
        total = 0
        for name in f.keys():
            if name in (EMBED, "d2t", "t2d"):
                continue
            count = 1
            for size in f.get_slice(name).get_shape():
                count *= size
            total += count
    return total


def measure_row(config: Path, benchmark: str, train: bool = True) -> dict[str, Any]:
    """Train the row's draft (unless `train` is False: it is there), evaluate it in-process and in vLLM; its figures."""
    train_s = eagle3("run", str(config), "--stages", "train") if train else None
    layout = load_config(config).layout
    summary = json.loads(layout.train_summary.read_text())
    final = layout.final
    figures, eval_s, report = evaluate_draft(config, final)
    return {
        **figures,
        "parameters": draft_parameters(final),
        "steps": summary["steps"],
        "tokens": summary["tokens"],
        "train_s": round(train_s, 1) if train_s is not None else None,
        "eval_s": round(eval_s, 1),
        "long_context": long_context(report, benchmark),
    }


def long_context(report: dict[str, Any], benchmark: str) -> dict[str, Any]:
    """The long benchmark's figures in an eval report (the long-context set, or kimi-long's long answers): per verify
    round in-process and in vLLM, the rounds by context position in-process and as vLLM placed them (its per-round
    counts)."""
    b = report["benchmarks"][benchmark]
    return {
        "per_round": b["hf"]["acceptance_length"],
        "vllm_per_round": b["engine"]["per_round"],
        "vllm_prompts": b["engine"]["prompts"],
        "prompts": b["hf"]["prompts"],
        "by_context": b["hf"]["by_context"],
        "vllm_by_context": b["engine"].get("by_context"),
        "vllm_unplaced": len(b["engine"].get("unplaced") or {}),
    }


def measure(p: Params, scratch: Path, out: dict[str, Any]) -> None:
    run_dir = Path(p.reuse or p.demo) if p.reuse or p.demo else scratch / "run"
    demo_s = 0.0
    if not (p.reuse or p.demo):
        overrides = {"train": {"epochs": p.epochs}} if p.epochs else None
        _, demo_s = run_demo_timed(run_dir, overrides, engine="vllm", target=p.target)
    out["wall_s"] = {"demo": round(demo_s, 1)}
    out["benchmark"] = benchmark_name(p.target, run_dir)
    out["results"] = {}
    for name in ROWS:
        config = row_config(run_dir, name, p.epochs, p.target)
        out["results"][name] = measure_row(config, out["benchmark"], train=not p.reuse)
        print(f"{name}: acceptance {out['results'][name]['acceptance']:.3f}", flush=True)


def benchmark_name(target: str, run_dir: Path) -> str:
    """The second table's benchmark: TARGETS' one, or the demo's own (its config's first)."""
    chosen = TARGETS[target]
    if chosen is not None:
        return str(chosen["name"])
    return str(yaml.safe_load(RunLayout(run_dir).demo_config.read_text())["eval"]["benchmarks"][0]["name"])


def report(out: dict[str, Any]) -> None:
    head = [
        "draft",
        "acceptance (in-process)",
        "vLLM 0.32, per round",
        "same as vLLM, round by round",
        "per position",
        "draft parameters",
        "optimizer steps",
        "training tokens/s",
    ]
    rows = [
        [
            name,
            *eval_cells(r),
            f"{r['parameters']:,}",
            r["steps"],
            f"{r['tokens'] / r['train_s']:,.0f}" if r["train_s"] else "-",
        ]
        for name, r in out["results"].items()
    ]
    harness.markdown_table(head, rows, align="lrrllrrr")
    buckets = sorted(
        {(b["from"], b["label"]) for r in out["results"].values() for b in r["long_context"]["by_context"]}
    )
    head = [
        "draft",
        f"{out.get('benchmark', 'long_context').replace('_', ' ')}, per round",
        "vLLM 0.32, per round",
        *[f"{label} tokens" for _, label in buckets],
        "vLLM's buckets",
    ]
    rows = []
    for name, r in out["results"].items():
        lc = r["long_context"]
        found = {b["from"]: b for b in lc["by_context"]}
        rows.append(
            [
                name,
                f"{lc['per_round']:.3f}",
                f"{lc['vllm_per_round']:.3f} ({lc['vllm_prompts']} prompts)",
                *[
                    f"{found[f]['acceptance_length']:.3f} ({found[f]['rounds']:,})" if f in found else "-"
                    for f, _ in buckets
                ],
                vllm_buckets(lc),
            ]
        )
    print()
    harness.markdown_table(head, rows, align="lrr" + "r" * len(buckets) + "l")
    print_walls(out["wall_s"])


def vllm_buckets(lc: dict[str, Any]) -> str:
    """`same` when vLLM's rounds by context position (placed from its per-round counts) are the in-process ones in
    every bucket, else vLLM's own; `-` from a run without them."""
    theirs = lc.get("vllm_by_context")
    if theirs is None:
        return "-"
    unplaced = f", {lc['vllm_unplaced']} prompts unplaced" if lc.get("vllm_unplaced") else ""
    if theirs == lc["by_context"]:
        return f"same in all {len(theirs)}{unplaced}"
    return " / ".join(f"{b['acceptance_length']:.3f} ({b['rounds']:,})" for b in theirs) + unplaced


def main(argv: list[str] | None = None) -> int:
    return harness.bench_main("kimi-drafts", __doc__, Params, measure, report, argv, kept=KEPT, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
