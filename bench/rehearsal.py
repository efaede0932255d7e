"""The reference run rehearsed at a fraction of its size: what our own costs do as the work grows to the seeds' numbers.

    .venv/bin/python bench/rehearsal.py --size 0.01|0.1|1 [--json out.json] [--keep DIR]
    .venv/bin/python bench/rehearsal_report.py --merge s001.json s01.json s1.json   # the tables and the slopes

The seeds' ten datasets at `--size` (bench/rehearsal_data.py: their prompt counts, answer lengths and budgets scaled,
in each public set's row format) run through the pipeline's own commands, each a process of its own as a user runs
them, against a simulated SGLang engine with no decode time (so our client, not the server, is what is measured) and a
Prefect server of the bench's own:

1. generate (`eagle3 run CFG --stages generate`), killed with SIGKILL twice at random points (shares of the planned
   tokens the engine has served), then run again to its end; `eagle3 stats RUN_DIR --json` every `--stats-every-s`
   throughout, each call timed. Then: no id twice, every set complete or stopped by its budget within
   2 x max_new_tokens, the engine asked for no rid twice.
2. records (`--stages records`) and `eagle3 plan`;
3. capture (the real DeepSpeed capture on a tiny target of hidden size 8: FLOPs are not the question, our path is)
   killed once when a share of its shards are written, and resumed; train (the real ZeRO-2 job, `--train-steps`
   steps) killed once, and resumed from its last checkpoint;
4. Prefect's side: flow runs, task runs, log lines, artifacts, its database.

Per stage: wall time, our CPU seconds (the CLI, its launcher and ranks; the engine and Prefect apart), per 1M tokens,
the peak RSS of each kind of process, disk and files. docs/bench-rehearsal.md holds the figures and the method.
"""

from __future__ import annotations

import json
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness  # noqa: E402
from bench import rehearsal_data as data  # noqa: E402
from bench import rehearsal_prefect as prefect_side  # noqa: E402
from bench import rehearsal_procs as procs  # noqa: E402
from bench.rehearsal_report import print_report  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

BENCH = "rehearsal"
SITE = Path(__file__).resolve().parent / "rehearsal_site"  # the synthetic target forward of the capture ranks


@dataclass
class Params:
    """The rehearsal's size and its kill points."""

    size: float = 0.01  # share of the reference run: 0.01, 0.1, 1
    seed: int = 0  # the data, the kill points
    kills: int = 2  # SIGKILLs of generate before the run that finishes
    stats_every_s: float = 10.0  # `eagle3 stats` while generate runs
    flush_interval_s: float = 60.0  # generate.flush_interval_s (its default; --quick: 3, so that a kill finds parts)
    train_steps: int = 300
    checkpoint_every: int = 50
    ranks: int = 2  # capture and train ranks (CPU, gloo)
    browser: bool = False  # time two pages of Prefect's UI in headless Chromium (make rehearsal-browser)
    quick: bool = False

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(size=0.01, flush_interval_s=3.0, train_steps=30, checkpoint_every=10, stats_every_s=3.0, quick=True)

    def validate(self) -> None:
        if not 0 < self.size <= 1:
            raise SystemExit(f"--size must be in (0, 1], got {self.size}")
        if self.train_steps < 2 * self.checkpoint_every:
            raise SystemExit("--train-steps must be at least 2 x --checkpoint-every (a kill between checkpoints)")


def target(p: Params) -> tuple[Path, int, int]:
    """The tiny target (hidden size 8, random weights, the tiny tokenizer): its path, vocabulary and stop id."""
    from models.target.tiny import build_tiny_target
    from models.target.tokenizer import load_tokenizer

    path = build_tiny_target(
        harness.REPO / "runs" / BENCH / "target",
        train_steps=0,
        hidden_size=8,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=16,
        num_layers=8,
        max_position_embeddings=65536,
    )
    tokenizer = load_tokenizer(str(path), trust_remote_code=False)
    return path, len(tokenizer), int(tokenizer.eos_token_id)


def sections(p: Params) -> dict[str, Any]:
    """The capture and train settings: 2 CPU ranks, the reference's shard size, a short training on samples cut to
    1,024 tokens (the draft's attention is FLOPs, not our path)."""
    return {
        "generate": {"log_interval_s": 10, "flush_interval_s": p.flush_interval_s},
        "capture": {
            "backend": "deepspeed",
            "num_gpus": p.ranks,
            "mode": "replicate",
            "dtype": "bfloat16",
            "max_batch_tokens": 16384,
            "shard_tokens": 16384,
        },
        "train": {
            "num_gpus": p.ranks,
            "draft_vocab_size": 1024,
            "max_batch_tokens": 1024,
            "max_steps": p.train_steps,
            "checkpoint_every": p.checkpoint_every,
            "eval_every": 10**9,
            "log_every": 10,
        },
    }


def planned_tokens(size: float, answers: dict[str, int]) -> float:
    """The completion tokens generate should write: per set, its budget or all its answers, whichever is less."""
    budget = data.REFERENCE_BUDGET * size
    return sum(min(budget, answers[d.name] * d.answer_mean) for d in data.DATASETS if d.name.startswith("B"))


def tree_size(path: Path) -> dict[str, Any]:
    files = total = 0
    for item in path.rglob("*") if path.exists() else ():
        if item.is_file():
            files += 1
            total += item.stat().st_size
    return {"files": files, "mb": round(total / 2**20, 2)}


def generate(p: Params, cfg: Path, run_dir: Path, sim: procs.Server, env: dict, logs: Path, out: dict) -> None:
    from tasks.responses.checkpoints import summarize

    answers = data.answers(out["data"])
    planned = planned_tokens(p.size, answers)
    rng = random.Random(p.seed)
    points = sorted(rng.uniform(0.15, 0.85) for _ in range(p.kills))
    layout_responses = RunLayout(run_dir).responses_root

    def on_disk() -> int:
        return (
            sum(summarize(d).completion_tokens for d in layout_responses.iterdir()) if layout_responses.is_dir() else 0
        )

    runs = []
    with procs.StatsLoop(run_dir, p.stats_every_s, env) as stats:
        for k, share in enumerate([*points, None]):
            kill = None
            if share is not None:  # a share of what is still to do when the run starts: every run gets somewhere
                start = procs.sim_stats(sim.url)["served_tokens"]
                threshold = start + share * max(planned - on_disk(), 0.05 * planned)

                def kill(threshold: float = threshold) -> dict | None:
                    served = procs.sim_stats(sim.url)["served_tokens"]
                    return {"served_tokens": served, "threshold": round(threshold)} if served >= threshold else None

            print(
                f"  generate, run {k + 1}" + (f": killed at {share:.0%} of what is left" if share else ""), flush=True
            )
            run = procs.run_cli(
                [procs.EAGLE3, "run", str(cfg), "--stages", "generate"],
                "generate",
                logs / f"generate-{k + 1}.log",
                env,
                kill,
            )
            if run.killed_at is not None:
                run.killed_at["on_disk_tokens"] = on_disk()
            runs.append(asdict(run))
    out["generate"] = {
        "runs": runs,
        "planned_tokens": round(planned),
        "kill_shares": points,
        "stats": stats.calls,
        "sim": procs.sim_stats(sim.url),
        "checks": generate_checks(p, run_dir, answers),
    }


def generate_checks(p: Params, run_dir: Path, answers: dict[str, int]) -> dict[str, Any]:
    """Per set: rows, distinct ids, rejects, tokens; complete (every answer given or a named reject) or stopped by
    its budget within 2 x max_new_tokens."""
    import pyarrow.parquet as pq

    from tasks.responses.checkpoints import live_parts, summarize
    from tasks.responses.rejects import reject_counts

    budget = round(data.REFERENCE_BUDGET * p.size)
    slack = 2 * data.MAX_NEW_TOKENS
    checks = {}
    for d in data.DATASETS:
        if not d.name.startswith("B"):
            continue
        directory = RunLayout(run_dir).responses(d.name)
        ids = [i for part in live_parts(directory) for i in pq.read_table(part, columns=["id"])["id"].to_pylist()]
        rejects = sum(reject_counts(RunLayout(run_dir).rejects(d.name)).values())
        spent = summarize(directory).completion_tokens
        complete = len(ids) + rejects >= answers[d.name]
        ok = len(ids) == len(set(ids)) and spent <= budget + slack and (complete or spent >= budget - slack)
        checks[d.name] = {
            "rows": len(ids),
            "distinct": len(set(ids)),
            "rejects": rejects,
            "answers": answers[d.name],
            "tokens": spent,
            "budget": budget,
            "complete": complete,
            "ok": ok,
        }
    return checks


def stage(name: str, argv_tail: list[str], cfg: Path, env: dict, logs: Path, kill=None, k: int = 1) -> dict:
    print(f"  {name}, run {k}" + (" (killed once)" if kill else ""), flush=True)
    run = procs.run_cli(
        [procs.EAGLE3, *argv_tail, str(cfg), *(["--stages", name] if argv_tail == ["run"] else [])],
        name,
        logs / f"{name}-{k}.log",
        env,
        kill,
    )
    return asdict(run)


def killed_and_resumed(name: str, cfg: Path, env: dict, logs: Path, kill) -> list[dict]:
    first = stage(name, ["run"], cfg, env, logs, kill, 1)
    return [first, stage(name, ["run"], cfg, env, logs, None, 2)]


def capture_kill(hidden: Path, expected_shards: int, share: float):
    def kill() -> dict | None:
        shards = len(list(hidden.glob("shard-*.safetensors"))) if hidden.is_dir() else 0
        return {"shards": shards} if shards >= max(1, share * expected_shards) else None

    return kill


def train_kill(metrics: Path, step: int):
    def kill() -> dict | None:
        if not metrics.is_file():
            return None
        lines = metrics.read_text().splitlines()
        steps = [json.loads(line).get("step", 0) for line in lines if line.startswith("{")]
        return {"step": max(steps)} if steps and max(steps) >= step else None

    return kill


def measure(scratch: Path, out: dict[str, Any], p: Params) -> None:
    target_dir, vocab, eos = target(p)
    t0 = time.monotonic()
    out["data"] = data.write_data(
        harness.REPO / "runs" / BENCH / f"data-s{p.size:g}-seed{p.seed}", p.size, p.seed, vocab
    )
    out["data_s"] = round(time.monotonic() - t0, 2)
    logs = scratch / "cli-logs"  # what each command printed
    logs.mkdir(parents=True)
    run_dir = scratch / "run"
    layout = RunLayout(run_dir)
    with procs.ProcWatch() as watch:
        prefect = procs.start_prefect(scratch)
        sim = procs.start_sim(scratch, data.length_rules(scratch / "length-rules.json"), target_dir, vocab, eos, p.seed)
        try:
            env = {"PREFECT_API_URL": prefect.url + "/api", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
            cfg = data.write_config(
                scratch / "rehearsal.yaml", run_dir, target_dir, out["data"], p.size, sim.url, sections(p)
            )
            generate(p, cfg, run_dir, sim, env, logs, out)
            out["records"] = {"runs": [stage("records", ["run"], cfg, env, logs)]}
            out["plan"] = {"runs": [stage("plan", ["plan"], cfg, env, logs)]}
            tokens = record_tokens(run_dir)
            rng = random.Random(p.seed + 1)
            expected = max(1, tokens["tokens"] // 16384)
            synthetic = {**env, "PYTHONPATH": str(SITE), "REHEARSAL_SYNTHETIC_FORWARD": "1"}
            out["capture"] = {
                "runs": killed_and_resumed(
                    "capture", cfg, synthetic, logs, capture_kill(layout.hidden_dir, expected, rng.uniform(0.3, 0.8))
                )
            }
            step = max(p.checkpoint_every + 1, round(rng.uniform(0.3, 0.8) * p.train_steps))
            out["train"] = {"runs": killed_and_resumed("train", cfg, env, logs, train_kill(layout.metrics, step))}
            out["checks"] = later_checks(layout, tokens)
            busiest = prefect_side.figures(Path(prefect.extra["home"]))["busiest_flow_run"]
            if busiest is not None:
                out["prefect_api_s"] = prefect_side.api_times(prefect.url, busiest["id"])
                if p.browser:
                    print("  Prefect's UI in headless Chromium", flush=True)
                    out["prefect_pages"] = prefect_side.page_loads(prefect.url, busiest["id"])
        finally:
            sim.stop()
            prefect.stop()
        watch.scan()
        out["prefect"] = prefect_side.figures(Path(prefect.extra["home"]))
        out["processes"] = {
            role: watch.summary(role)
            for role in ("generate", "stats-call", "records", "plan", "capture", "train", "sim", "prefect")
        }
    out["disk"] = {
        name: tree_size(path)
        for name, path in (
            ("responses", layout.responses_root),
            ("records", layout.records_root),
            ("hidden", layout.hidden_dir),
            ("draft", layout.draft_dir),
        )
    }
    out["tokens"] = {"completion": sum(c["tokens"] for c in out["generate"]["checks"].values()), **tokens}


def record_tokens(run_dir: Path) -> dict[str, int]:
    """Records and their tokens, from the records parts (the loss tokens too)."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    records = tokens = loss = 0
    for part in sorted(RunLayout(run_dir).records_root.glob("*/part-*.parquet")):
        table = pq.read_table(part, columns=["input_ids", "loss_mask"])
        records += table.num_rows
        tokens += pc.sum(pc.list_value_length(table["input_ids"])).as_py() or 0
        loss += pc.sum(pc.list_flatten(table["loss_mask"])).as_py() or 0
    return {"records": records, "tokens": tokens, "loss_tokens": loss}


def later_checks(layout: Any, tokens: dict[str, int]) -> dict[str, Any]:
    """Capture: every sample once; train: the last step reached."""
    from models.capture.shards import iter_shard_index

    keys = [(row["dataset"], row["id"]) for row in iter_shard_index(layout.hidden_dir)]
    steps = [
        json.loads(line).get("step", 0) for line in layout.metrics.read_text().splitlines() if line.startswith("{")
    ]
    return {
        "captured": len(keys),
        "captured_distinct": len(set(keys)),
        "records": tokens["records"],
        "train_last_step": max(steps, default=0),
    }


def main() -> int:
    import signal

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout's SIGTERM still stops the servers
    args = harness.arguments(__doc__, Params(), keep="the run directory, its config and logs").parse_args()
    p = harness.params_from(args, Params)
    versions = {}
    for name in ("prefect", "deepspeed", "torch", "pyarrow"):
        from importlib.metadata import version

        versions[name] = version(name)
    return harness.run_bench(
        BENCH,
        args,
        asdict(p),
        versions,
        lambda scratch, out: measure(scratch, out, p),
        print_report,
        kept="the rehearsal's run directory and logs",
    )


if __name__ == "__main__":
    sys.exit(main())
