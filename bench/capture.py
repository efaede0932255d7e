"""Capture-stage benchmark: our capture job against a bare forward loop, in one run.

On a tiny Llama target (models/target/tiny.py, larger than its default: hidden 256, 8 layers) and
a synthetic records set (lognormal lengths, loss on the second half, written as records parts in
RECORD_SCHEMA), one run measures:

1. Capture throughput (tokens/s) of `models.capture` launched as the pipeline launches it
   (tasks.runtime.launch_ranks.rank_command + run_job: torchrun, DS_ACCELERATOR=cpu, gloo, OMP_NUM_THREADS per
   rank), for (a) 1 rank replicate, (b) 2 ranks replicate, (c) 2 ranks ZeRO-3, against baselines
   measured in the same run, each a fresh Python process like a rank:
   - bare: a forward loop over the same batches (the 1-rank deal, models.capture.records.make_batches),
     the same model, dtype and call kwargs (`output_hidden_states=True, use_cache=False,
     logits_to_keep=1`), nothing kept or written; at the ranks' thread count, before and after (a);
   - in-process: models.capture.job.capture_batch + ShardWriter in a plain process (our per-batch code
     without the launcher): splits (a)'s overhead into code path vs launch;
   - bare on all cores: one bare process with ranks x threads threads;
   - bare side by side: `ranks` bare processes at once, each over the share the deal gives a rank:
     the baseline of (b) and (c), on the same cores under the same conditions.
   Start-up (launch -> the first rank's `CAPTURE_PROGRESS done=0` line: interpreter, imports,
   process group, records, model load) is timed apart from the forward phase (first `done=0` line
   -> the last rank's final `CAPTURE_PROGRESS` line, printed after its last shard is written); the
   tail (barriers, index.parquet, teardown) is the rest up to the launcher's exit. Lines are
   time-stamped when they reach this process. The baselines time their loop only (after a barrier
   once every process has loaded the model). CPU seconds of the forward phase are read from /proc
   for the launcher and its ranks, and from the baselines' own process clocks.
2. Stored bytes per token: shard file sizes / captured tokens, split into the hidden-state payload
   (4H values x dtype bytes: 16H at fp32, 8H at bf16), input_ids + loss_mask (5 B) and the
   safetensors header (tensor table + the JSON sample list), plus index.parquet.

Nothing is asserted and there is no target: the figures are ratios to the baselines. Usage::

    .venv/bin/python bench/capture.py [--quick] [--json out.json] [--keep DIR] [--verbose]
                                      [--PARAM VALUE ...]   # any field of Params, e.g. --hidden-size 512

Each ratio pairs a run with its baseline from the same pass; `--repeats N` runs the whole sequence
N times (every other pass in reverse order) and reports the median of the per-pass ratios. The
target build is cached in runs/bench-capture/ (gitignored; the first build takes a minute or two).
This file holds the records, our capture job's launches, the storage figures, the run and its ratios; `Params`
is in bench/capture_params.py, the baselines in bench/capture_baseline.py, the report in bench/capture_report.py.
The scaffolding (flags, launches, spawned baselines, passes, tables, JSON) is bench/harness.py.
Results and their reading: docs/benchmarks.md ("Capture").
"""

from __future__ import annotations

import math
import os
import resource
import shutil
import statistics
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, models, tasks
import numpy as np  # noqa: E402
import pyarrow.parquet as pq  # noqa: E402
import torch  # noqa: E402

from bench import capture_report, harness  # noqa: E402  (harness first: the offline env ranks and baselines inherit)
from bench.capture_baseline import Bare, baseline  # noqa: E402
from bench.capture_params import DATASET, Params  # noqa: E402
from models.capture.records import deal, load_records, make_batches  # noqa: E402
from models.capture.shards import INDEX_NAME, list_shards, read_sample, shard_metadata  # noqa: E402
from models.common.job_files import (
    CaptureJobFile,
    DatasetRecords,  # noqa: E402
)
from models.common.rank_protocol import CAPTURE_PROGRESS  # noqa: E402
from models.draft.config import default_aux_layers  # noqa: E402
from settings.layout import RunLayout  # noqa: E402
from settings.target import Target

FIRST_ID = 8  # record ids are drawn from [FIRST_ID, vocab): clear of the special tokens 0..7
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# ---------------------------------------------------------------------------------------------
# Records
# ---------------------------------------------------------------------------------------------


def make_records(p: Params, records_dir: Path, vocab: int) -> dict[str, Any]:
    """`p.records` records in RECORD_SCHEMA parts: lognormal lengths, random ids, loss on the second half."""
    rng = np.random.default_rng(p.seed + 1)
    mu = math.log(p.mean_len) - p.sigma**2 / 2
    lengths = np.clip(np.rint(rng.lognormal(mu, p.sigma, p.records)), p.min_len, p.max_len).astype(int)
    rows = [
        harness.record_row(f"{DATASET}-{i:06d}", rng.integers(FIRST_ID, vocab, n, dtype=np.int32).tolist(), n // 2)
        for i, n in enumerate(lengths.tolist())
    ]
    parts = harness.write_records(rows, records_dir, p.records_per_part)
    return {"records": len(rows), "parts": parts, "tokens": int(lengths.sum()), **harness.length_summary(lengths)}


# ---------------------------------------------------------------------------------------------
# 1. Our capture job (the pipeline's launcher path)
# ---------------------------------------------------------------------------------------------


@dataclass
class Launch:
    label: str
    mode: str
    ranks: int
    ok: bool = False
    error: str | None = None
    samples: int = 0
    tokens: int = 0
    wall_s: float = 0.0  # launch -> launcher exit
    planned_s: float | None = (
        None  # launch -> rank 0's "pending over" line (interpreter, imports, process group, records)
    )
    startup_s: float | None = None  # launch -> first rank's done=0 line (model loaded)
    startup_last_rank_s: float | None = None  # launch -> last rank's done=0 line
    forward_s: float | None = None  # first done=0 line -> last rank's final progress line (shards written)
    tail_s: float | None = None  # last final line -> launcher exit (barrier, index, teardown)
    tokens_per_s: float | None = None  # steady state: tokens / forward_s
    end_to_end_tokens_per_s: float | None = None  # tokens / wall_s (what metadata.json's tokens_per_s measures)
    per_rank: list[dict[str, Any]] = field(default_factory=list)
    children_cpu_s: float | None = None  # user+sys CPU of the launcher and its ranks, start-up included
    forward_cpu_s: float | None = None  # the ranks' CPU over the forward phase (read from /proc at the progress lines)
    launcher_cpu_s: float | None = None  # the launcher's (torchrun agent) over the same span
    ops_built: list[str] = field(default_factory=list)  # torch extensions (re)built during this launch
    storage: dict[str, Any] | None = None
    check: dict[str, Any] | None = None
    pass_no: int = 0


def launch(
    p: Params,
    label: str,
    mode: str,
    ranks: int,
    target: Path,
    records_dir: Path,
    out_dir: Path,
    job_path: Path,
    log_path: Path,
    verbose: bool,
) -> Launch:
    job = CaptureJobFile(
        target=Target(path=str(target)),
        datasets=[DatasetRecords(name=DATASET, records_dir=str(records_dir))],
        out_dir=str(out_dir),
        mode=mode,
        dtype=p.dtype,
        max_batch_tokens=p.max_batch_tokens,
        shard_tokens=p.shard_tokens,
        launch_tokens=None,
        device="cpu",
    )
    r = Launch(label, mode, ranks)
    started: dict[int, float] = {}
    last: dict[int, tuple[float, int, int, int]] = {}  # rank -> (t, done, total, tokens) of its latest line
    cpu_at: dict[float, tuple[float, float]] = {}  # time of a progress line -> CPU s of (launcher, ranks) then

    def on_line(line: str, t: float) -> None:
        progress = CAPTURE_PROGRESS.parse(line)
        if progress:
            rank, done = progress["rank"], progress["done"]
            if done == 0 and rank not in started:
                started[rank] = t
            last[rank] = (t, done, progress["total"], progress["tokens"])
            c = harness.descendants_cpu_s(os.getpid())
            if c is not None:
                cpu_at[t] = c
        elif r.planned_s is None and "pending over" in line:
            r.planned_s = t

    usage0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    run = harness.launch(
        "models.capture",
        job.model_dump(mode="json"),
        ranks=ranks,
        threads=p.threads,
        job_path=job_path,
        log_path=log_path,
        verbose=verbose,
        on_line=on_line,
    )
    usage1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    r.ok, r.error, r.wall_s, r.ops_built = run.ok, run.error, run.wall_s, run.ops_built
    r.children_cpu_s = (usage1.ru_utime - usage0.ru_utime) + (usage1.ru_stime - usage0.ru_stime)
    r.per_rank = [
        {
            "rank": k,
            "start_s": started.get(k),
            "end_s": v[0],
            "done": v[1],
            "total": v[2],
            "tokens": v[3],
            "tokens_per_s": v[3] / (v[0] - started[k]) if k in started and v[0] > started[k] else None,
        }
        for k, v in sorted(last.items())
    ]
    r.samples = sum(v[1] for v in last.values())
    r.tokens = sum(v[3] for v in last.values())
    if r.ok and started and len(last) == ranks:
        first, last_start = min(started.values()), max(started.values())
        end = max(v[0] for v in last.values())
        r.startup_s, r.startup_last_rank_s = first, last_start
        r.forward_s = end - first
        r.tail_s = r.wall_s - end
        r.tokens_per_s = r.tokens / r.forward_s if r.forward_s > 0 else None
        if first in cpu_at and end in cpu_at:
            r.launcher_cpu_s = cpu_at[end][0] - cpu_at[first][0]
            r.forward_cpu_s = cpu_at[end][1] - cpu_at[first][1]
        r.end_to_end_tokens_per_s = r.tokens / r.wall_s
    return r


def writer_alone(
    lengths: list[int], hidden: int, dtype: torch.dtype, aux_layers: list[int], shard_tokens: int, out_dir: Path
) -> dict[str, Any]:
    """ShardWriter alone (concatenation, safetensors, fsync, rename) over samples of these lengths, no forward."""
    from models.capture.shards import ShardWriter

    g = torch.Generator().manual_seed(0)
    n_max = max(lengths)
    aux = torch.randn(n_max, 3 * hidden, generator=g).to(dtype)  # views of these, as capture_batch yields
    last = torch.randn(n_max, hidden, generator=g).to(dtype)
    ids, mask = torch.zeros(n_max, dtype=torch.int32), torch.ones(n_max, dtype=torch.uint8)
    t0, cpu0 = time.perf_counter(), time.process_time()
    with ShardWriter(out_dir, 0, shard_tokens, aux_layers=aux_layers) as writer:
        for i, n in enumerate(lengths):
            writer.add(f"w{i}", DATASET, ids[:n], mask[:n], aux[:n], last[:n])
    wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    size = sum(f.stat().st_size for f in list_shards(out_dir))
    tokens = sum(lengths)
    return {
        "tokens": tokens,
        "bytes": size,
        "shards": len(writer.written),
        "wall_s": wall,
        "cpu_s": cpu,
        "mb_per_s": size / wall / 1e6,
        "us_per_token": 1e6 * wall / tokens,
    }


# ---------------------------------------------------------------------------------------------
# 2. Stored bytes per token
# ---------------------------------------------------------------------------------------------


def storage(out_dir: Path) -> dict[str, Any]:
    """Shard bytes split into payload, ids + mask and header; read from the files themselves."""
    shards = list_shards(out_dir)
    total = header = tokens = samples = 0
    hidden = dtype_bytes = None
    for path in shards:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))  # safetensors: u64 header length, JSON header, data
        meta = shard_metadata(path)
        hidden, dtype_bytes = meta["hidden_size"], DTYPE_BYTES[meta["dtype"]]
        total += path.stat().st_size
        header += 8 + n
        tokens += meta["num_tokens"]
        samples += len(meta["samples"])
    if not tokens:
        return {"shards": len(shards), "tokens": 0}
    payload = 4 * hidden * dtype_bytes  # aux [3H] + last [H] per token
    ids_mask = 4 + 1  # int32 input_ids + uint8 loss_mask
    index = out_dir / INDEX_NAME
    index_bytes = index.stat().st_size if index.is_file() else 0
    return {
        "shards": len(shards),
        "samples": samples,
        "tokens": tokens,
        "hidden_size": hidden,
        "dtype_bytes": dtype_bytes,
        "shard_bytes": total,
        "bytes_per_token": total / tokens,
        "payload_per_token": payload,
        "ids_mask_per_token": ids_mask,
        "header_bytes": header,
        "header_per_token": header / tokens,
        "header_per_sample": header / samples,
        "data_matches_layout": total - header == tokens * (payload + ids_mask),
        "overhead_pct": 100 * (total / tokens - payload) / payload,
        "index_bytes": index_bytes,
        "index_per_token": index_bytes / tokens,
        "overhead_with_index_pct": 100 * ((total + index_bytes) / tokens - payload) / payload,
        "planner_per_token": payload + ids_mask,  # tasks/capture/plan.py: 4H x dtype bytes + 5
    }


def check_against_bare(out_dir: Path, kept: dict) -> dict[str, Any]:
    """Max abs difference between stored rows and the bare forward's for the kept samples."""
    index = {(row["dataset"], row["id"]): row for row in pq.read_table(out_dir / INDEX_NAME).to_pylist()}
    worst = 0.0
    for key, (aux, last) in kept.items():
        row = index[key]
        got = read_sample(out_dir / row["shard"], row["offset"], row["length"])
        worst = max(
            worst,
            (got["aux_hidden"].float() - aux.float()).abs().max().item(),
            (got["last_hidden"].float() - last.float()).abs().max().item(),
        )
    return {"samples_compared": len(kept), "max_abs_diff": worst, "samples_indexed": len(index)}


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def run(p: Params, tmp: Path, out: dict[str, Any], verbose: bool) -> None:
    from safetensors import safe_open
    from transformers import AutoConfig

    target, build_s = p.build_target("bench-capture", max_position_embeddings=max(4096, p.max_len))
    config = AutoConfig.from_pretrained(target)
    n_params = 0
    for f in target.glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as st:
            n_params += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    aux_layers = default_aux_layers(p.num_layers)
    pad_id = config.pad_token_id if isinstance(config.pad_token_id, int) else 0
    records_dir = RunLayout(tmp).records(DATASET)
    rec = make_records(p, records_dir, config.vocab_size)
    samples, _, _ = load_records([DatasetRecords(name=DATASET, records_dir=str(records_dir))], config.vocab_size)
    batches = make_batches(deal(samples, 1)[0], p.max_batch_tokens)  # exactly the 1-rank capture's batches
    tokens = sum(s.length for s in samples)
    padded = sum(len(b) * max(s.length for s in b) for b in batches)
    out["setup"] = {
        "target": str(target),
        "target_build_or_reuse_s": build_s,
        "parameters": n_params,
        "vocab_size": config.vocab_size,
        "aux_layers": aux_layers,
        "records": rec,
        "captured_tokens": tokens,
        "batches_1_rank": len(batches),
        "padded_tokens_1_rank": padded,
        "padding_pct": 100 * (padded - tokens) / padded,
    }
    print(
        f"  records: {rec['records']} ({rec['parts']} parts), {tokens:,} tokens (mean {rec['mean_len']:.0f}, "
        f"p95 {rec['p95_len']}, max {rec['max_len']}); 1-rank deal: {len(batches)} batches, "
        f"{100 * (padded - tokens) / padded:.1f}% padding",
        flush=True,
    )

    # The stored rows are compared with the bare loop's for the longest and the shortest sample.
    keep = {(batches[0][0].dataset, batches[0][0].id), (batches[-1][-1].dataset, batches[-1][-1].id)}
    kept: dict = {}
    bares: list[Bare] = []
    launches: list[Launch] = []

    def base(label: str, kind: str, processes: int, threads: int, k: int) -> None:
        print(f"  {label} ...", flush=True)
        out_dir = tmp / f"hidden-inproc-{k}" if kind == "in-process" else None
        b, rows = baseline(
            p,
            label,
            kind,
            processes,
            threads,
            target,
            records_dir,
            pad_id,
            aux_layers,
            keep=keep if kind == "bare" and not kept else None,
            out_dir=out_dir,
        )
        if out_dir is not None:
            shutil.rmtree(out_dir, ignore_errors=True)
        kept.update(rows)
        b.pass_no = k
        bares.append(b)

    def capture(label: str, mode: str, ranks: int, k: int) -> None:
        tag = f"{mode}-{ranks}-{k}"
        print(f"  {label}: torchrun --nproc_per_node {ranks}, OMP_NUM_THREADS={p.threads} ...", flush=True)
        out_dir = tmp / f"hidden-{tag}"
        r = launch(
            p,
            label,
            mode,
            ranks,
            target,
            records_dir,
            out_dir,
            tmp / f"job-{tag}.json",
            tmp / f"log-{tag}.txt",
            verbose,
        )
        r.pass_no = k
        if r.ok:
            r.storage = storage(out_dir)
            r.check = check_against_bare(out_dir, kept)
        else:
            print(f"    FAILED:\n{r.error}", flush=True)
        shutil.rmtree(out_dir, ignore_errors=True)  # ~4 KB a token at fp32: keep the disk free
        launches.append(r)

    def writer(k: int) -> None:
        print("  ShardWriter alone (no forward) ...", flush=True)
        torch.set_num_threads(p.threads)
        out_dir = tmp / f"hidden-writer-{k}"
        w = writer_alone(
            [s.length for b in batches for s in b],
            config.hidden_size,
            getattr(torch, p.dtype),
            aux_layers,
            p.shard_tokens,
            out_dir,
        )
        shutil.rmtree(out_dir, ignore_errors=True)
        out.setdefault("writer_alone", []).append({**w, "pass_no": k})

    t, n = p.threads, p.ranks
    sequence: list[Callable[[int], None]] = [
        lambda k: base(f"bare, {t} thread(s), before", "bare", 1, t, k),
        lambda k: capture("(a) 1 rank, replicate", "replicate", 1, k),
        lambda k: base("in-process capture_batch + ShardWriter", "in-process", 1, t, k),
        writer,
        lambda k: base(f"bare, {t} thread(s), after", "bare", 1, t, k),
        lambda k: base(f"bare, 1 process x {n * t} threads", "bare-all-cores", 1, n * t, k),
        lambda k: base(f"bare, {n} processes x {t} thread(s) side by side", "bare-parallel", n, t, k),
        lambda k: capture(f"(b) {n} ranks, replicate", "replicate", n, k),
        lambda k: capture(f"(c) {n} ranks, zero3", "zero3", n, k),
    ]
    for k, step in harness.passes(sequence, p.repeats, announce=True):
        step(k)

    out["bare"] = [b.__dict__ for b in bares]
    out["launches"] = [r.__dict__ for r in launches]
    out["ratios"] = ratios(p, bares, launches)
    w = min(out["writer_alone"], key=lambda x: x["wall_s"])
    bare_us = 1e6 / out["ratios"]["bare_tokens_per_s"]
    out["writer"] = {**w, "bare_forward_us_per_token": bare_us, "share_of_bare_forward": w["us_per_token"] / bare_us}


def ratios(p: Params, bares: list[Bare], launches: list[Launch]) -> dict[str, Any]:
    """Each run against its baseline measured in the same pass, then the median over the passes.

    Baselines: (a) and in-process: the mean of the pass's bare loops before and after them;
    more ranks: the pass's bare processes side by side. Pairing within a pass keeps slow drifts of
    the machine's other load out of the ratios; the median keeps one disturbed pass out.
    """
    med = statistics.median

    def of(kind: str, k: int) -> list[Bare]:
        return [b for b in bares if b.kind == kind and b.pass_no == k]

    base: dict[int, dict[str, float]] = {}
    for k in range(p.repeats):
        one, par, allc = of("bare", k), of("bare-parallel", k), of("bare-all-cores", k)
        base[k] = {
            "tps": statistics.fmean(b.tokens_per_s for b in one),
            "cpt": statistics.fmean(b.cpu_s / b.tokens for b in one),
            "spread": (max(b.tokens_per_s for b in one) - min(b.tokens_per_s for b in one))
            / statistics.fmean(b.tokens_per_s for b in one),
            "par_tps": par[0].tokens_per_s if par else math.nan,
            "par_cpt": par[0].cpu_s / par[0].tokens if par else math.nan,
            "all_tps": allc[0].tokens_per_s if allc else math.nan,
        }
    bare_tps = med(x["tps"] for x in base.values())
    res: dict[str, Any] = {
        "bare_tokens_per_s": bare_tps,
        "bare_cpu_ms_per_1k_tokens": 1e6 * med(x["cpt"] for x in base.values()),
        "bare_spread_pct": 100 * max(x["spread"] for x in base.values()),
        "bare_startup_s": min(b.startup_s for b in bares if b.kind == "bare"),
        "bare_parallel_tokens_per_s": med(x["par_tps"] for x in base.values()),
        "bare_all_cores_tokens_per_s": med(x["all_tps"] for x in base.values()),
        "parallel_speedup": med(x["par_tps"] / x["tps"] for x in base.values()),
        "all_cores_speedup": med(x["all_tps"] / x["tps"] for x in base.values()),
        "per_pass_baselines": base,
        "runs": {},
    }
    entries = [b for b in bares if b.kind == "in-process"] + [r for r in launches if r.tokens_per_s]
    for label in dict.fromkeys(e.label for e in entries):
        rows = []
        for e in (e for e in entries if e.label == label):
            b, ranks = base[e.pass_no], getattr(e, "ranks", 1)
            tps_b, cpt_b = (b["par_tps"], b["par_cpt"]) if ranks > 1 else (b["tps"], b["cpt"])
            cpu = e.forward_cpu_s if isinstance(e, Launch) else e.cpu_s
            e2e = getattr(e, "end_to_end_tokens_per_s", None)
            rows.append(
                {
                    "pass_no": e.pass_no,
                    "tokens_per_s": e.tokens_per_s,
                    "baseline_tokens_per_s": tps_b,
                    "overhead_ratio": tps_b / e.tokens_per_s,  # baseline / ours: > 1 = ours slower
                    "cpu_ratio": (cpu / e.tokens) / cpt_b if cpu else None,  # CPU per token, ours / baseline
                    "vs_bare_1_process": b["tps"] / e.tokens_per_s,
                    "vs_bare_all_cores": b["all_tps"] / e.tokens_per_s,
                    "end_to_end_ratio": tps_b / e2e if e2e else None,
                }
            )
        ranks = getattr(next(e for e in entries if e.label == label), "ranks", 1)
        summary = {key: harness.median_of(r[key] for r in rows) for key in rows[0] if key != "pass_no"}
        summary.update(
            ranks=ranks,
            passes=rows,
            overhead_ratio_range=harness.range_of(r["overhead_ratio"] for r in rows),
            baseline=f"bare, {p.ranks} processes" if ranks > 1 else "bare, 1 process (before+after)/2",
        )
        res["runs"][label] = summary
    return res


def main(argv: list[str] | None = None) -> int:
    kept = "records, jobs and rank logs"
    args = harness.arguments(__doc__, Params(), keep=kept, verbose=True).parse_args(argv)
    p = harness.params_from(args, Params)

    import transformers

    return harness.run_bench(
        "capture",
        args,
        dict(p.__dict__),
        {"torch": torch.__version__, "transformers": transformers.__version__},
        lambda tmp, out: run(p, tmp, out, args.verbose),
        lambda out: capture_report.print_report(p, out),
        kept=kept,
    )


if __name__ == "__main__":
    sys.exit(main())
