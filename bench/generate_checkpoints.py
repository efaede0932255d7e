"""Parts 3 and 4 of the generate bench: resume start-up and `eagle3 stats` over Parquet checkpoints, against reading
the same responses as JSONL (the old scripts' way).

`make_responses` builds the responses in RESPONSE_SCHEMA (long-tailed lengths, Arrow compute), `write_like_writer`
writes them as the generate stage's writer does, `jsonl_*` are the JSONL baselines; `bench_checkpoints` times both.
"""

from __future__ import annotations

import asyncio
import json
import math
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from bench import harness
from bench.generate_params import Params
from bench.generate_prompts import FIRST_ID, IdsTokenizer
from models.common.jobs import GenerateJob
from settings.layout import RunLayout
from tasks.datasets import PromptRow
from tasks.generate.loop import generate_dataset
from tasks.generate.report import GenerateReport
from tasks.responses.checkpoints import RESPONSE_SCHEMA, compact, done_ids, summarize, write_part
from tasks.responses.stats import collect_stats, nearest_rank, stats_rows
from tasks.serving.pool import ServerPool


def make_responses(p: Params, n: int) -> pa.Table:
    """n responses in RESPONSE_SCHEMA with long-tailed lengths, as the generate stage writes them.

    Built with Arrow compute (no per-row Python), so realistic row sizes stay affordable.
    """
    rng = np.random.default_rng(p.seed + 2)
    vocab = p.sim_config().vocab_size

    def ragged(mean: float, sigma: float, cap: int) -> tuple[np.ndarray, pa.ListArray]:
        mu = math.log(mean) - sigma**2 / 2
        lengths = np.clip(np.rint(rng.lognormal(mu, sigma, n)), 1, cap).astype(np.int32)
        offsets = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)])
        values = rng.integers(FIRST_ID, vocab, int(offsets[-1]), dtype=np.int32)
        return lengths, pa.LargeListArray.from_arrays(pa.array(offsets), pa.array(values))

    plen, prompt = ragged(p.ckpt_prompt_len, 0.8, 4000)
    cap = int(round(p.ckpt_max_ratio * p.ckpt_mean_len))
    olen, output = ragged(p.ckpt_mean_len, p.sigma, cap)
    stop = olen < cap
    # The sim server's detokenisation: "t<id>" per token, space-separated.
    words = pc.binary_join_element_wise("t", pc.cast(output.values, pa.string()), "")
    text = pc.binary_join(pa.LargeListArray.from_arrays(output.offsets, words), " ")
    finished = 1.7e9 + np.sort(rng.uniform(0, 3600, n))
    return pa.table(
        {
            "id": pa.array([f"r{i:07d}" for i in range(n)]),
            "prompt_ids": prompt.cast(pa.list_(pa.int32())),
            "output_ids": output.cast(pa.list_(pa.int32())),
            "prompt_tokens": pa.array(plen),
            "completion_tokens": pa.array(olen),
            "finish_reason": pa.array(np.where(stop, "stop", "length").tolist()),
            "text": text.cast(pa.string()),
            "latency": pa.array(np.round(rng.uniform(0.5, 60, n), 3)),
            "cached_tokens": pa.array(np.zeros(n, np.int32)),
            "reasoning_tokens": pa.array(np.zeros(n, np.int32)),
            "finished_at": pa.array(np.round(finished, 3)),
        },
        schema=RESPONSE_SCHEMA,
    )


def write_like_writer(directory: Path, table: pa.Table, p: Params) -> int:
    """Parts exactly as ResponseWriter leaves them: flush_every rows a part, compaction every 64 parts."""
    parts = 0
    for off in range(0, table.num_rows, p.flush_every):
        write_part(directory, table.slice(off, p.flush_every))
        parts += 1
        if parts % p.compact_min_parts == 0:
            compact(directory, min_parts=p.compact_min_parts)
    return len(list(directory.glob("part-*.parquet")))


def jsonl_bytes(table: pa.Table) -> bytes:
    """The same responses as the old scripts' raw_responses.jsonl lines (flat SGLang-era format).

    One JSON object per line with every RESPONSE_SCHEMA column, built with Arrow compute.
    """

    def ints(name: str) -> pa.Array:
        col = table.column(name).combine_chunks()
        joined = pc.binary_join(pa.ListArray.from_arrays(col.offsets, pc.cast(col.values, pa.string())), ",")
        return joined

    def num(name: str) -> pa.Array:
        return pc.cast(table.column(name).combine_chunks(), pa.string())

    def s(name: str) -> pa.Array:
        return table.column(name).combine_chunks()  # ids, finish reasons, "t123 t456" texts: no escaping needed

    parts = [
        '{"id": "',
        s("id"),
        '", "prompt_ids": [',
        ints("prompt_ids"),
        '], "output_ids": [',
        ints("output_ids"),
        '], "prompt_tokens": ',
        num("prompt_tokens"),
        ', "completion_tokens": ',
        num("completion_tokens"),
        ', "finish_reason": "',
        s("finish_reason"),
        '", "text": "',
        s("text"),
        '", "latency": ',
        num("latency"),
        ', "cached_tokens": ',
        num("cached_tokens"),
        ', "reasoning_tokens": ',
        num("reasoning_tokens"),
        ', "finished_at": ',
        num("finished_at"),
        "}\n",
    ]
    lines = pc.binary_join_element_wise(*[pa.scalar(x) if isinstance(x, str) else x for x in parts], "")
    lines = lines.cast(pa.large_string())
    offsets = np.frombuffer(lines.buffers()[1], dtype=np.int64)[lines.offset : lines.offset + len(lines) + 1]
    return memoryview(lines.buffers()[2])[offsets[0] : offsets[-1]].tobytes()


def jsonl_resume(path: Path) -> tuple[set[str], int]:
    """The old resume: read every line, collect the done ids, re-sum the completion tokens."""
    done: set[str] = set()
    tokens = 0
    with open(path, "rb") as f:
        for line in f:
            d = json.loads(line)
            done.add(d["id"])
            tokens += d["completion_tokens"]
    return done, tokens


def jsonl_stats(files: list[Path]) -> list[dict[str, Any]]:
    """The old stats collector, computing what collect_stats reports, per dataset file."""
    out = []
    for path in files:
        lengths: list[int] = []
        prompt = 0
        reasons: dict[str, int] = {}
        first = last = None
        with open(path, "rb") as f:
            for line in f:
                d = json.loads(line)
                lengths.append(d["completion_tokens"])
                prompt += d["prompt_tokens"]
                reasons[d["finish_reason"]] = reasons.get(d["finish_reason"], 0) + 1
                t = d["finished_at"]
                first = t if first is None or t < first else first
                last = t if last is None or t > last else last
        lengths.sort()
        total = sum(lengths)
        wall = (last - first) if first is not None else None
        out.append(
            {
                "dataset": path.stem,
                "responses": len(lengths),
                "completion_tokens": total,
                "prompt_tokens": prompt,
                "mean_length": total / len(lengths) if lengths else None,
                "p50_length": nearest_rank(lengths, 50),
                "p95_length": nearest_rank(lengths, 95),
                "finish_reasons": reasons,
                "tokens_per_s": total / wall if wall else None,
            }
        )
    return out


def bench_checkpoints(p: Params, tmp: Path, out: dict[str, Any]) -> None:
    n_resume = p.resume_rows
    n_stats = p.stats_datasets * p.stats_rows_per_dataset
    per = p.stats_rows_per_dataset
    print(
        f"  making {max(n_resume, n_stats):,} responses (mean {p.ckpt_mean_len:.0f} completion tokens) ...", flush=True
    )
    t0 = time.perf_counter()
    table = make_responses(p, max(n_resume, n_stats))
    setup: dict[str, float] = {"make_s": time.perf_counter() - t0}

    # The same responses as JSONL: one 100k-line file (resume) and one file per dataset (stats).
    t0 = time.perf_counter()
    jsonl = tmp / "raw_responses.jsonl"
    files = [tmp / "jsonl" / f"D{k:02d}.jsonl" for k in range(p.stats_datasets)]
    files[0].parent.mkdir(parents=True, exist_ok=True)
    step = per
    with open(jsonl, "wb") as big:
        for off in range(0, max(n_resume, n_stats), step):
            chunk = jsonl_bytes(table.slice(off, step))
            if off < n_resume:
                big.write(chunk if off + step <= n_resume else jsonl_bytes(table.slice(off, n_resume - off)))
            if off // step < len(files):
                files[off // step].write_bytes(chunk)
    setup["write_jsonl_s"] = time.perf_counter() - t0

    # -- 3: resume ------------------------------------------------------------------------------
    t0 = time.perf_counter()
    resumed = RunLayout(tmp / "resume")
    responses_dir, rejects_dir = resumed.responses("big"), resumed.rejects("big")
    parts = write_like_writer(responses_dir, table.slice(0, n_resume), p)
    setup["write_parts_s"] = time.perf_counter() - t0
    print(
        f"  resume: {n_resume:,} responses in {parts} parts ({_mb(responses_dir)} MB) vs JSONL ({_mb(jsonl)} MB) ...",
        flush=True,
    )

    def ours():
        before = summarize(responses_dir)
        skip = done_ids(responses_dir) | done_ids(rejects_dir)
        return skip, before.completion_tokens

    ours_s, ours_times, (skip, tokens) = harness.best_of(p.repeats, ours)
    base_s, base_times, (base_ids, base_tokens) = harness.best_of(p.jsonl_repeats, lambda: jsonl_resume(jsonl))

    # The whole generate_dataset call on the fully done dataset: it returns without sending
    # (the server is never contacted), so this is its start-up plus its closing summary.
    prompts = [
        PromptRow(id=i, messages=[{"role": "user", "content": "1"}]) for i in table.column("id").to_pylist()[:n_resume]
    ]
    settings = GenerateJob(dataset="big", sampling_params={"max_new_tokens": p.max_new_tokens})

    async def call() -> tuple[float, GenerateReport]:
        async with ServerPool(["http://127.0.0.1:9"], max_concurrency=1) as pool:  # all done: never contacted
            t0 = time.perf_counter()
            report = await generate_dataset(
                prompts,
                pool=pool,
                tokenizer=IdsTokenizer(),
                layout=resumed,
                source=jsonl,
                settings=settings,
                vocab_size=None,
            )
            return time.perf_counter() - t0, report

    calls = [asyncio.run(call()) for _ in range(p.repeats)]
    call_times = [c[0] for c in calls]
    report = calls[-1][1]
    out["resume"] = {
        "responses": n_resume,
        "parts": parts,
        "parquet_mb": _mb(responses_dir),
        "jsonl_mb": _mb(jsonl),
        "jsonl_bytes_per_response": jsonl.stat().st_size / n_resume,
        "completion_tokens_mean": tokens / n_resume,
        "ours_s": ours_s,
        "ours_times": ours_times,
        "jsonl_s": base_s,
        "jsonl_times": base_times,
        "ratio": base_s / ours_s if ours_s > 0 else math.inf,
        "generate_dataset_noop_s": min(call_times),
        "generate_dataset_noop_times": call_times,
        "consistent": skip == base_ids
        and tokens == base_tokens
        and report.responses == n_resume
        and report.new_responses == 0,
    }
    jsonl.unlink()

    # -- 4: stats -------------------------------------------------------------------------------
    t0 = time.perf_counter()
    run = tmp / "stats"
    for k in range(p.stats_datasets):
        write_like_writer(RunLayout(run).responses(f"D{k:02d}"), table.slice(k * per, per), p)
    setup["write_stats_s"] = time.perf_counter() - t0
    del table
    n_parts = len(list(RunLayout(run).responses_root.glob("*/part-*.parquet")))
    print(
        f"  stats: {p.stats_datasets} datasets x {per:,} responses, {n_parts} parts "
        f"({_mb(run)} MB) vs JSONL ({_mb(tmp / 'jsonl')} MB) ...",
        flush=True,
    )
    ours_s, ours_times, stats = harness.best_of(p.repeats, lambda: stats_rows(collect_stats(run), total=True))
    base_s, base_times, base = harness.best_of(p.jsonl_repeats, lambda: jsonl_stats(files))
    consistent = len(stats) == len(base) + 1 and all(
        a["responses"] == b["responses"]
        and a["completion_tokens"] == b["completion_tokens"]
        and a["p50_length"] == b["p50_length"]
        and a["p95_length"] == b["p95_length"]
        and a["finish_reasons"] == dict(sorted(b["finish_reasons"].items()))
        for a, b in zip(stats[:-1], base)
    )
    # The command itself, end to end: interpreter start and imports included.
    eagle3 = Path(sys.executable).with_name("eagle3")
    cli_s = None
    if eagle3.exists():
        t0 = time.perf_counter()
        done = subprocess.run([str(eagle3), "stats", str(run), "--json"], capture_output=True, text=True)
        cli_s = time.perf_counter() - t0 if done.returncode == 0 else None
    out["stats"] = {
        "datasets": p.stats_datasets,
        "responses": n_stats,
        "parts": n_parts,
        "parquet_mb": _mb(run),
        "jsonl_mb": _mb(tmp / "jsonl"),
        "ours_s": ours_s,
        "ours_times": ours_times,
        "jsonl_s": base_s,
        "jsonl_times": base_times,
        "ratio": base_s / ours_s if ours_s > 0 else math.inf,
        "consistent": consistent,
        "cli_end_to_end_s": cli_s,
    }
    out["checkpoint_setup_s"] = setup


def _mb(path: Path) -> float:
    files = [path] if path.is_file() else [f for f in path.rglob("*") if f.is_file()]
    return round(sum(f.stat().st_size for f in files) / 2**20, 1)
