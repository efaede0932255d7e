"""Our trainer against the reference trainers, vLLM's speculators and SGLang's SpecForge, on identical data.

One demo run (`eagle3 demo`'s `run_demo`: generate, records, capture, train, eval), then the same 1-layer EAGLE-3 draft
trained again by each trainer on its training split, its captured hidden states and its draft vocabulary (d2t/t2d), with
the same settings (bench/peer_trainers/__init__.py `PeerJob`: 20 epochs, lr 0.002, 7 TTT steps, 512-token packs per
optimizer step on one process):

- `ours`: `eagle3 run --stages train` on one rank (`train.num_gpus: 1`, `max_batch_tokens: 512`; the demo's recipe
  otherwise, `norm_before_fc` included), and again with speculators' whole draft layer (`ours + speculators' norms`:
  `norm_before_residual` too, which SGLang 0.5.23 does not serve); both at `--ours-seeds` seeds (default 3: the
  spread), the peers at the first seed only;
- `speculators 0.9.0` and `SpecForge 0.2.0`: each its own training command, in a venv of its own made by the bench
  (bench/peer_trainers/<peer>.py; their small CPU patches under bench/peer_trainers/patches/, each saying why),
  with its own recipe otherwise (optimizer, initialisation, norms: each module's docstring lists them).

Every draft, and the demo's own (2 ranks, 1,024 tokens per step), is then measured by `eagle3 eval CONFIG --draft DIR`
with `eval.backend: both` on the demo's prompts: in-process (HF) and in the real vLLM 0.32 (.venv-vllm, `make vllm`)
serving the target with that draft, the two counts compared prompt by prompt (`engine_vs_hf`).

A comparison of quality and training speed, not a wall-clock target (bench/README.md): tokens/s is each trainer's
trained tokens over the wall time of its whole training command (start-up included), on the same machine in the same
run. Printed as the markdown table of docs/benchmarks.md ("Against the reference trainers"):

    .venv/bin/python bench/peers.py [--quick] [--ours-seeds N] [--epochs N] [--keep DIR] [--json FILE]

The peers' venvs are kept in runs/peers/ (made once, ~4 and ~2.5 minutes). On 2 otherwise idle cores each
training takes a few minutes and each eval about 2 (its vLLM server included); speculators slows down twenty-fold
when another process shares the cores, so run nothing else meanwhile. --epochs 5 gives the early columns of
docs/benchmarks.md; --quick trains 4 epochs: a smoke run of the bench, not its figures.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402
from bench.demo_drafts import eagle3, eval_cells, evaluate_draft, print_walls, run_demo_timed  # noqa: E402
from bench.peer_trainers import PeerJob, PeerRun, specforge, speculators  # noqa: E402
from flows.config.file import load_config  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

VENVS = REPO / "runs" / "peers"  # the peers' venvs, kept between runs
PEERS = {"speculators 0.9.0": speculators, "SpecForge 0.2.0": specforge}
OURS, DEMO = "ours", "ours, the demo's (2 ranks)"
OURS_NORMS = "ours + speculators' norms"
NORMS = {"norm_before_fc": True, "norm_before_residual": True}  # speculators' draft layer (docs/benchmarks.md)


@dataclass
class Params:
    """The knobs of one run: the training length of every draft (configs/demo.yaml: 20 epochs) and the seed."""

    quick: bool = False
    epochs: int = 20
    seed: int = 0  # every trainer's first seed; the peers train this one only
    ours_seeds: int = 3  # ours, with and without speculators' norms, trained at seed, seed + 1, ...: their spread

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, epochs=4, ours_seeds=1)

    def validate(self) -> None:
        if self.epochs < 1 or self.ours_seeds < 1:
            raise SystemExit(f"--epochs and --ours-seeds must be at least 1 (got {self.epochs}, {self.ours_seeds})")


KEPT = "the demo run, each trainer's data, logs and draft, the eval reports"  # what --keep DIR keeps
QUICK = "4 epochs per trainer: a smoke run"  # what --quick runs


def run_config(run_dir: Path, name: str, train: dict[str, Any]) -> Path:
    """The demo's resolved config with these train settings and its own draft directory, and the eval in-process AND
    in the real vLLM (started by the eval with each draft) on the demo's prompts only."""
    from cli.demo import demo_server

    layout = RunLayout(run_dir)
    data = yaml.safe_load(layout.demo_config.read_text())
    data["train"].update({**train, "out_dir": str(run_dir / name)})
    data["eval"].update({"backend": "both", "compare_untrained": False, "benchmarks": [], "baseline": False})
    config = load_config(layout.demo_config)
    data["server"] = demo_server(config, "vllm", data["server"]["url"]).model_dump(mode="json", exclude_none=True)
    path = run_dir / f"peers-{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def train_ours(
    run_dir: Path, job: PeerJob, name: str = OURS, extra: dict[str, Any] | None = None
) -> tuple[Path, PeerRun]:
    """Ours on the job's settings (and `extra` train settings), one rank: the config it ran with and what it cost."""
    train: dict[str, Any] = {"num_gpus": 1, "max_batch_tokens": job.max_batch_tokens, "epochs": job.epochs}
    train.update({"seed": job.seed, "lr": job.lr, "ttt_steps": job.ttt_steps, **(extra or {})})  # one layer
    slug = "ours" if name == OURS else "ours-norms"
    config = run_config(run_dir, f"{slug}-{job.epochs}-epochs-seed-{job.seed}", train)
    train_s = eagle3("run", str(config), "--stages", "train")
    layout = load_config(config).layout
    summary = json.loads(layout.train_summary.read_text())
    run = PeerRun(seeded(name, job.seed), layout.final, summary["steps"], summary["tokens"], round(train_s, 1), 0.0)
    return config, run


def seeded(name: str, seed: int) -> str:
    return f"{name} (seed {seed})"


def demo_run(run_dir: Path) -> PeerRun:
    """The demo's own draft as it trained (its wall time is not measured apart from the demo's)."""
    layout = RunLayout(run_dir)
    summary = json.loads(layout.train_summary.read_text())
    return PeerRun(DEMO, layout.final, summary["steps"], summary["tokens"], 0.0, 0.0)


def evaluate(config: Path, run: PeerRun) -> dict[str, Any]:
    """`eagle3 eval CONFIG --draft DIR` (both backends); the figures of its report."""
    figures, wall_s, _ = evaluate_draft(config, run.draft_dir)
    return {**figures, "eval_s": round(wall_s, 1)}


def measure(p: Params, scratch: Path, out: dict[str, Any]) -> None:
    run_dir = scratch / "run"
    config, demo_s = run_demo_timed(run_dir, {"train": {"epochs": p.epochs}})
    out["wall_s"] = {"demo": round(demo_s, 1)}
    job = PeerJob(run_dir=run_dir, target=Path(config.target.path), epochs=p.epochs, seed=p.seed)
    runs = [demo_run(run_dir)]
    eval_config = None  # the first one's config evaluates every draft: vLLM serves them all
    for seed in range(p.seed, p.seed + p.ours_seeds):
        seed_job = replace(job, seed=seed)
        ours_config, ours = train_ours(run_dir, seed_job)
        eval_config = eval_config or ours_config
        runs += [ours, train_ours(run_dir, seed_job, OURS_NORMS, NORMS)[1]]
    for name, peer in PEERS.items():
        started = time.monotonic()
        python = peer.ensure_venv(VENVS)
        out["wall_s"][f"{name} venv"] = round(time.monotonic() - started, 1)
        runs.append(peer.train(python, job, scratch / name.split()[0]))
        print(f"{name}: {runs[-1].optimizer_steps} steps in {runs[-1].train_s:.0f} s", flush=True)
    assert eval_config is not None
    results = {}
    for run in runs:
        results[run.trainer] = {**json_safe(run), **evaluate(eval_config, run)}
        print(f"{run.trainer}: acceptance {results[run.trainer]['acceptance']:.3f}", flush=True)
    out["results"] = results


def json_safe(run: PeerRun) -> dict[str, Any]:
    return {k: str(v) if isinstance(v, Path) else v for k, v in asdict(replace(run)).items()}


def table(results: dict[str, dict[str, Any]]) -> None:
    """The markdown table of docs/benchmarks.md, one row per draft."""
    head = [
        "trainer",
        "acceptance (in-process)",
        "vLLM 0.32, per round",
        "same as vLLM",
        "per position",
        "optimizer steps",
        "trained tokens",
        "training tokens/s",
        "training wall (s)",
    ]
    rows = []
    for name, r in results.items():
        rows.append(
            [
                name,
                *eval_cells(r),
                r["optimizer_steps"],
                f"{r['trained_tokens']:,}",
                f"{r['trained_tokens'] / r['train_s']:,.0f}" if r["train_s"] else "—",
                f"{r['train_s']:.0f}" if r["train_s"] else "—",
            ]
        )
    harness.markdown_table(head, rows, align="lrrllrrrr")


def seed_means(results: dict[str, dict[str, Any]]) -> None:
    """Per trainer trained at several seeds: the mean acceptance and the spread (max - min) over its seeds."""
    by_trainer: dict[str, list[float]] = {}
    for name, r in results.items():
        by_trainer.setdefault(name.split(" (seed ")[0], []).append(r["acceptance"])
    for name, values in by_trainer.items():
        if len(values) > 1:
            mean, spread = statistics.mean(values), max(values) - min(values)
            print(f"{name}: mean {mean:.3f} over {len(values)} seeds, spread {spread:.3f}")


def report(out: dict[str, Any]) -> None:
    table(out["results"])
    print()
    seed_means(out["results"])
    print_walls(out["wall_s"])


def main(argv: list[str] | None = None) -> int:
    return harness.bench_main("peers", __doc__, Params, measure, report, argv, kept=KEPT, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
