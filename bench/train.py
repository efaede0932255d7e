"""Train-stage benchmark: our DeepSpeed ZeRO-2 training step against a plain PyTorch loop, in one run.

On the tiny Llama target (models/target/tiny.py, its default shape) and records made of its own
greedy continuations of the sample conversations (data/samples/*.jsonl; loss on the continuation),
whose hidden states are captured in-process with `models.capture.job.run`, one run measures the draft's
training throughput (real tokens per second) of:

- ours: `models.train` launched as the train flow launches it (tasks.runtime.launch_ranks.rank_command + run_job:
  torchrun, DS_ACCELERATOR=cpu, gloo, OMP_NUM_THREADS per rank) with `--ranks` ranks (default: 1,
  then 2), a fixed `max_steps`, and checkpoint/eval intervals past `max_steps` (the job still
  evaluates, checkpoints and exports once at the end: outside the measured window);
- the baseline: a plain PyTorch loop over the same draft and data: the same Eagle3Draft init (seed,
  config, target embedding, draft vocabulary), the same held-out split and micro batches
  (HiddenSource + epoch_batches + rank_micro_batches, same seed), the same `forward_ttt` with the
  same TargetHead, the same Metrics sums, torch.optim.AdamW with the same lr/betas/eps/weight
  decay, clip_grad_norm_ at the job's clipping and the same LambdaLR schedule. No DeepSpeed, no
  process group, no launcher. For 1 rank one fresh process at `--threads` threads (`--baseline-here`:
  in this process); for N ranks, N such processes side by side, each over the micro batches the
  deal gives that rank, without exchanging gradients: the same cores under the same conditions,
  minus the communication, the lockstep and the ZeRO machinery. The baseline is started like a job
  (a child in a new session, the N loops its children), so that both sides share the cores with
  other load on the same terms (Linux schedules each session as one group).
- in-process, interleaved (once per run, 1 rank): one process holding both a plain draft and the
  job's DeepSpeed engine (models.train.optimizer.wrap_in_deepspeed) alternates their steps on the same batch tensors,
  timing forward, backward and the rest of each step: other load hits both alike, so this isolates
  the engine's per-step cost from everything else (launcher, job loop, process, machine).

Throughput is measured over the same steps on both sides: from the end of step `--skip` to the
end of the last step (the first steps are warmup: allocator, lazy init, first-touch), tokens =
real (unpadded) tokens of those steps, all ranks. For ours it is read from metrics.jsonl: the
`tokens` and `time` of the train lines (the job logs every `--log-every` steps, default every step);
the ranks' CPU seconds over the same steps are read from /proc when those lines appear. The whole
launch (start-up, the final eval, checkpoint and export, teardown) is timed separately.

Ratio = ours tokens/s / baseline tokens/s (1.0: no overhead; 0.9: ours 10% slower). Also: the
median over steps of the paired step-time ratio (the same micro batches on both sides), tokens per
CPU second (ours/baseline), and the lockstep bound (what waiting for the slowest rank alone costs).
Nothing is asserted. With 1 rank the two sides do the same arithmetic, so their losses are also
compared at every logged step (a check that the baseline trains the same thing). Usage::

    .venv/bin/python bench/train.py [--quick] [--repeats 3] [--steps 30] [--ranks 1,2] [--json out.json]
                                    [--keep DIR] [--verbose] [--PARAM VALUE ...]   # any field of Params

`--quick` is a smoke run of the whole sequence (1 and 2 ranks, the interleaved comparison) at small
sizes: one pass of 8 steps (2 skipped), continuations of at most 32 tokens (a data set of its own).
Each ratio pairs a run with its baseline from the same pass; `--repeats N` runs the sequence N
times (every other pass in reverse order) and reports the median of the per-pass ratios. The
target, records and captured hidden states are cached in runs/bench-train/ (gitignored; the first
run generates the continuations: several minutes on 2 cores). `Params` is in bench/train_params.py,
the data in bench/train_data.py, the report in bench/train_report.py. The scaffolding (flags, launches,
spawned baselines, passes, tables, JSON) is bench/harness.py. Results and their reading:
docs/benchmarks.md ("Train").
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, models, tasks
from bench import harness  # noqa: E402  (first: the offline environment the ranks and baselines inherit)

# DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared by
# every virtualenv: another checkout's build of the same op name forces a ~45 s rebuild at the next launch).
# The pipeline's own directory, this virtualenv's (tasks/runtime/torch_extensions.py), keeps such rebuilds out of the
# bench's start-up figures and shares the one build with the pipeline; inherited by every launch.
from tasks.runtime.torch_extensions import extensions_dir  # noqa: E402

os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))

import torch  # noqa: E402

import models  # noqa: E402,F401  (flushes CPU denormals in this process, as in every rank)
from bench import train_baselines, train_report  # noqa: E402
from bench.train_data import prepare_data  # noqa: E402
from bench.train_params import Params  # noqa: E402
from models.common.job_files import TrainJobFile
from models.common.rank_protocol import TRAIN_PROGRESS  # noqa: E402
from models.train.data import HiddenSource, epoch_batches, rank_micro_batches, split_samples, steps_per_epoch  # noqa: E402
from settings.layout import RunLayout  # noqa: E402

# ---------------------------------------------------------------------------------------------
# Ours: the real job under torchrun
# ---------------------------------------------------------------------------------------------


def job_dict(p: Params, target: Path, data: Path, out_dir: Path, ranks: int) -> dict[str, Any]:
    """The JOB.json, as flows/train.py writes it, with intervals that keep checkpoints and evals at the end."""
    far, layout = p.steps + 10**6, RunLayout(data)
    job = {
        "target": {"path": str(target)},
        "out_dir": str(out_dir),
        "token_counts": str(layout.token_counts),
        "mode": "offline",
        "hidden_dir": str(layout.hidden_dir),
        "draft_vocab_size": p.draft_vocab_size,
        "ttt_steps": p.ttt_steps,
        "epochs": 1,
        "max_steps": p.steps,
        "max_batch_tokens": p.max_batch_tokens,
        "lr": p.lr,
        "warmup_ratio": p.warmup_ratio,
        "min_lr_ratio": 0.0,
        "checkpoint_every": far,
        "keep_checkpoints": 1,
        "eval_every": far,
        "eval_fraction": p.eval_fraction,
        "log_every": p.log_every,
        "seed": p.seed,
        "device": "cpu",
        "grad_accum": p.grad_accum,
        "weight_decay": p.weight_decay,
        "grad_clip": p.grad_clip,
        "precision": "fp32",
        "zero_stage": p.zero_stage,  # each rank derives its DeepSpeed config from these (models/train/optimizer.py)
    }
    TrainJobFile.model_validate(job)  # the job's own spec accepts every key and value
    return job


class MetricsWatch:
    """Polls the job's metrics.jsonl; reads the ranks' CPU seconds when the train lines of the given steps appear.

    The ranks go on computing while the poll notices a line (every `interval` s): the CPU window
    is off by at most about that much at either end.
    """

    def __init__(self, path: Path, steps: set[int], interval: float = 0.05):
        import threading

        self.path, self.steps, self.interval = path, steps, interval
        self.cpu: dict[int, tuple[float, float]] = {}  # step -> (launcher CPU s, ranks CPU s)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MetricsWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()

    def _run(self) -> None:
        offset, pending = 0, ""
        while not self.stop.wait(self.interval):
            try:
                with open(self.path) as f:
                    f.seek(offset)
                    chunk = f.read()
                    offset = f.tell()
            except OSError:
                continue
            pending += chunk
            *complete, pending = pending.split("\n")
            for line in complete:
                try:
                    x = json.loads(line)
                except ValueError:
                    continue
                if x.get("kind") == "train" and x.get("step") in self.steps and x["step"] not in self.cpu:
                    c = harness.descendants_cpu_s(os.getpid())
                    if c is not None:
                        self.cpu[x["step"]] = c


def ours(p: Params, ranks: int, target: Path, data: Path, tmp: Path, tag: str, verbose: bool) -> dict[str, Any]:
    """Launch models.train; throughput from its metrics.jsonl train lines, the launch's phases from the clock."""
    out_dir = tmp / f"draft-{tag}"
    draft = RunLayout(tmp, draft_dir=out_dir)
    step0: list[float] = []  # seconds after launch of TRAIN_PROGRESS step=0 (the first step starts)

    def on_line(line: str, t: float) -> None:
        progress = None if step0 else TRAIN_PROGRESS.parse(line)
        if progress and progress["step"] == 0:
            step0.append(t)

    with MetricsWatch(draft.metrics, {p.skip, p.steps}) as watch:
        run = harness.launch(
            "models.train",
            job_dict(p, target, data, out_dir, ranks),
            ranks=ranks,
            threads=p.threads,
            job_path=tmp / f"job-{tag}.json",
            log_path=tmp / f"log-{tag}.txt",
            verbose=verbose,
            on_line=on_line,
        )
    t0 = run.started_at
    r: dict[str, Any] = {
        "ranks": ranks,
        "ok": run.ok,
        "error": run.error,
        "step0_at": t0 + step0[0] if step0 else None,
        "wall_s": run.wall_s,
        "ops_built": run.ops_built,
    }
    if not r["ok"]:
        return r
    lines = [json.loads(x) for x in draft.metrics.read_text().splitlines() if x.strip()]
    train = {x["step"]: x for x in lines if x["kind"] == "train"}
    first, last = train[p.skip], train[p.steps]
    r["window_s"] = last["time"] - first["time"]
    r["window_tokens"] = last["tokens"] - first["tokens"]
    r["tokens_per_s"] = r["window_tokens"] / r["window_s"]
    if p.skip in watch.cpu and p.steps in watch.cpu:
        r["cpu_s"] = watch.cpu[p.steps][1] - watch.cpu[p.skip][1]  # the ranks (the torchrun agent apart)
        r["launcher_cpu_s"] = watch.cpu[p.steps][0] - watch.cpu[p.skip][0]
        r["cpu_ms_per_1k_tokens"] = 1e6 * r["cpu_s"] / r["window_tokens"]
    r["losses"] = {s: x["loss"] for s, x in sorted(train.items())}
    r["step_times"] = {s: x["time"] for s, x in sorted(train.items())}
    r["window_tokens_per_s"] = [x["tokens_per_s"] for s, x in sorted(train.items()) if s > p.skip]  # per log window
    r["tokens"] = last["tokens"]
    # the launch's phases: start-up (launch -> TRAIN_PROGRESS step=0: interpreter, imports, process group,
    # data index, draft, DeepSpeed engine), the steps (-> the last train line), the tail (final eval,
    # checkpoint, export, teardown)
    r["startup_s"] = r["step0_at"] - t0 if r["step0_at"] else None
    r["steps_s"] = last["time"] - r["step0_at"] if r["step0_at"] else None
    r["tail_s"] = t0 + r["wall_s"] - last["time"]
    r["end_to_end_tokens_per_s"] = last["tokens"] / r["wall_s"]
    ckpt = draft.checkpoints
    r["checkpoint_mb"] = sum(f.stat().st_size for f in ckpt.rglob("*") if f.is_file()) / 1e6 if ckpt.is_dir() else None
    shutil.rmtree(out_dir, ignore_errors=True)
    return r


# ---------------------------------------------------------------------------------------------
# The baseline: a plain PyTorch loop over the same draft and data (its loops: bench/train_baselines.py)
# ---------------------------------------------------------------------------------------------


def baseline(p: Params, processes: int, target: Path, data: Path, tmp: Path, here: bool = False) -> dict[str, Any]:
    """The plain loop: a fresh process (N: side by side, each over its rank's share), or this process (`here`).

    The fresh processes are started like a job's ranks: a child in a new session (with
    `start_new_session`, as tasks.runtime.launch_ranks.run_job starts torchrun; with N > 1 it spawns the N loops and
    waits, like the torchrun agent), OMP_NUM_THREADS set. A new session is a new scheduler autogroup
    on Linux: under other load, both sides then compete for the cores on the same terms.
    """
    cfg = {
        "target_path": str(target),
        "hidden_dir": str(RunLayout(data).hidden_dir),
        "token_counts": str(RunLayout(data).token_counts),
        **{k: v for k, v in asdict(p).items()},
    }
    if here:
        assert processes == 1
        results = [train_baselines.plain_loop(cfg, 0, 1)]
    else:
        cfg_path, out_path = tmp / f"baseline-{processes}.json", tmp / f"baseline-{processes}.out.json"
        cfg_path.write_text(json.dumps(cfg))
        out_path.unlink(missing_ok=True)
        err_path = tmp / f"baseline-{processes}.stderr.txt"
        with open(err_path, "w") as err:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    str(Path(__file__).resolve()),
                    "--baseline-worker",
                    str(cfg_path),
                    str(processes),
                    str(out_path),
                ],
                env={**os.environ, "OMP_NUM_THREADS": str(p.threads), "PYTHONUNBUFFERED": "1"},
                start_new_session=True,
                stdout=subprocess.DEVNULL,
                stderr=err,
            )
            try:
                code = proc.wait(timeout=p.timeout_s)
            except BaseException:
                os.killpg(proc.pid, signal.SIGKILL)  # the session this call started: the worker and its loops
                proc.wait()
                raise
        if code != 0 or not out_path.is_file():
            raise RuntimeError(f"baseline ({processes} processes) failed ({code}):\n{err_path.read_text()[-4000:]}")
        results = json.loads(out_path.read_text())
        for x in results:
            x["losses"] = {int(k): v for k, v in x["losses"].items()}
    k = p.skip
    start = min(x["times"][k] for x in results)
    end = max(x["times"][-1] for x in results)
    window_tokens = sum(x["tokens"][-1] - x["tokens"][k] for x in results)
    cpu = sum(x["cpu"][-1] - x["cpu"][k] for x in results)
    step_s = [b - a for x in results for a, b in zip(x["times"][k:], x["times"][k + 1 :])]
    return {
        "processes": processes,
        "window_s": end - start,
        "window_tokens": window_tokens,
        "times_per_process": [x["times"] for x in results],
        "tokens_per_s": window_tokens / (end - start),
        "cpu_s": cpu,
        "cpu_ms_per_1k_tokens": 1e6 * cpu / window_tokens,
        "median_step_s": statistics.median(step_s),
        "losses": results[0]["losses"],
        "trainable_parameters": results[0]["trainable_parameters"],
        "per_epoch": results[0]["per_epoch"],
        "train_samples": results[0]["train_samples"],
    }


def run_interleaved(p: Params, target: Path, data: Path, tmp: Path) -> dict[str, Any]:
    """`interleaved` in a fresh spawned process; medians per phase over the measured steps."""
    cfg = {
        "target_path": str(target),
        "hidden_dir": str(RunLayout(data).hidden_dir),
        "token_counts": str(RunLayout(data).token_counts),
        **asdict(p),
        "steps": p.in_process_steps,
    }
    job = job_dict(Params(**{**asdict(p), "steps": p.in_process_steps}), target, data, tmp / "draft-interleaved", 1)
    (res,), _ = harness.spawn(
        train_baselines.interleaved,
        [(cfg, job)],
        threads=p.threads,
        timeout_s=p.timeout_s,
        what="interleaved run",
        together=False,
    )
    k = p.skip
    out: dict[str, Any] = {"steps_measured": len(res["tokens"]) - k, "tokens": sum(res["tokens"][k:])}
    for name, rows in res["phases"].items():
        rows = rows[k:]
        out[name] = {
            "forward_ms": 1e3 * statistics.fmean(r[0] for r in rows),  # means over the same steps
            "backward_ms": 1e3 * statistics.fmean(r[1] for r in rows),
            "rest_ms": 1e3 * statistics.fmean(r[2] for r in rows),
            "step_ms": 1e3 * statistics.fmean(sum(r) for r in rows),
            "total_s": sum(sum(r) for r in rows),
        }
        out[name]["tokens_per_s"] = out["tokens"] / out[name]["total_s"]
    out["ratio"] = out["plain"]["total_s"] / out["ours"]["total_s"]  # = ours tok/s / plain tok/s
    out["load_ms"] = 1e3 * statistics.fmean(res["load_s"][k:])  # HiddenSource.batch: read + pad (both sides pay it)
    diff = [sum(o) - sum(q) for o, q in zip(res["phases"]["ours"][k:], res["phases"]["plain"][k:])]
    out["extra_ms_per_step"] = 1e3 * statistics.median(diff)
    out["extra_ms_per_step_mean"] = 1e3 * statistics.fmean(diff)
    out["step_ratio_median"] = statistics.median(
        sum(o) / sum(q) for o, q in zip(res["phases"]["ours"][k:], res["phases"]["plain"][k:])
    )
    common = sorted(set(res["losses"]["plain"]) & set(res["losses"]["ours"]))
    out["loss_max_rel_diff"] = (
        max(
            abs(res["losses"]["ours"][s] - res["losses"]["plain"][s]) / max(1e-12, abs(res["losses"]["plain"][s]))
            for s in common
        )
        if common
        else None
    )
    return out


def lockstep_bound(p: Params, train_samples: list, world: int) -> dict[str, Any]:
    """What lockstep alone costs N ranks against N free-running processes over the measured steps.

    Every rank of the job waits for the slowest at each step (gradients are reduced every step); a
    side-by-side baseline process runs its own share freely. With a micro batch's cost taken as its
    padded tokens (B x longest), the bound is max_r sum_s cost[r, s] / sum_s max_r cost[r, s]: the
    ours/baseline ratio to expect with no communication and no other overhead (1.0 for 1 rank).
    """
    per_epoch = steps_per_epoch(len(epoch_batches(train_samples, p.max_batch_tokens, p.seed, 0)), world, p.grad_accum)
    cost = [[0] * p.steps for _ in range(world)]
    step = epoch = 0
    while step < p.steps:
        batches = epoch_batches(train_samples, p.max_batch_tokens, p.seed, epoch)
        for in_epoch in range(per_epoch):
            if step >= p.steps:
                break
            for r in range(world):
                cost[r][step] = sum(
                    len(b) * max(x.length for x in b)
                    for b in rank_micro_batches(batches, in_epoch, r, world, p.grad_accum)
                )
            step += 1
        epoch += 1
    window = range(p.skip, p.steps)
    free = max(sum(cost[r][s] for s in window) for r in range(world))
    locked = sum(max(cost[r][s] for r in range(world)) for s in window)
    return {
        "bound": free / locked,
        "padded_tokens_per_rank_step": sum(cost[r][s] for r in range(world) for s in window) / (world * len(window)),
    }


# ---------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------


def run(p: Params, tmp: Path, out: dict[str, Any], verbose: bool) -> None:
    target, _ = p.build_target("bench-train")
    print("  records (greedy continuations) + captured hidden states (built once, then reused) ...", flush=True)
    info = prepare_data(p, target)
    data = Path(info["root"])
    source = HiddenSource(RunLayout(data).hidden_dir, p.max_batch_tokens)
    train_samples, held = split_samples(source.samples, p.eval_fraction)
    batches = epoch_batches(train_samples, p.max_batch_tokens, p.seed, 0)
    real = sum(s.length for b in batches for s in b)
    padded = sum(len(b) * max(s.length for s in b) for b in batches)
    out["setup"] = {
        "target": str(target.relative_to(harness.REPO)),
        "data": str(data.relative_to(harness.REPO)),
        **info,
        "train_samples": len(train_samples),
        "held_out": len(held),
        "batches_per_epoch": len(batches),
        "tokens_per_epoch": real,
        "padding_pct": 100 * (padded - real) / padded,
        "tokens_per_batch": real / len(batches),
        "lockstep": {str(n): lockstep_bound(p, train_samples, n) for n in p.rank_list()},
    }
    print(
        f"  data: {info['records']} records, {info['tokens']:,} tokens ({info['loss_tokens']:,} loss tokens), "
        f"{len(train_samples)} train / {len(held)} held out; {len(batches)} micro batches per epoch "
        f"(max_batch_tokens {p.max_batch_tokens}, {100 * (padded - real) / padded:.1f}% padding)",
        flush=True,
    )

    if p.in_process_steps > p.skip:
        print(
            f"  in-process, interleaved: the plain step and the job's DeepSpeed step alternately, {p.in_process_steps} "
            "steps each, one spawned process ...",
            flush=True,
        )
        out["interleaved"] = run_interleaved(p, target, data, tmp)
        x = out["interleaved"]
        print(f"    ours/plain {x['ratio']:.3f}, {x['extra_ms_per_step']:+.1f} ms per step", flush=True)

    runs: list[dict[str, Any]] = []
    order = [(kind, n) for n in p.rank_list() for kind in ("baseline", "ours")]
    for k, (kind, n) in harness.passes(order, p.repeats):
        if kind == "baseline":
            here = p.baseline_here and n == 1
            what = "in this process" if here else f"{n} spawned process(es)" + (" side by side" if n > 1 else "")
            print(f"  pass {k + 1}: baseline, plain PyTorch loop, {what}, {p.threads} thread(s) each ...", flush=True)
            r = baseline(p, n, target, data, tmp, here=here)
        else:
            print(
                f"  pass {k + 1}: ours, torchrun --nproc_per_node {n} -m models.train, OMP_NUM_THREADS={p.threads} ...",
                flush=True,
            )
            r = ours(p, n, target, data, tmp, f"{n}-{k}", verbose)
            if not r["ok"]:
                print(f"    FAILED:\n{r['error']}", flush=True)
        r.update(kind=kind, n=n, pass_no=k)
        if r.get("tokens_per_s"):
            print(
                f"    {r['tokens_per_s']:,.0f} tok/s over steps {p.skip + 1}-{p.steps} ({r['window_s']:.1f} s)",
                flush=True,
            )
        runs.append(r)
    out["runs"] = runs
    out["ratios"] = ratios(p, runs)


def ratios(p: Params, runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Each launch against the baseline of the same pass and rank count; medians over the passes."""
    res: dict[str, Any] = {}
    for n in p.rank_list():
        rows = []
        for k in range(p.repeats):
            b = next((r for r in runs if r["kind"] == "baseline" and r["n"] == n and r["pass_no"] == k), None)
            o = next((r for r in runs if r["kind"] == "ours" and r["n"] == n and r["pass_no"] == k), None)
            b1 = next((r for r in runs if r["kind"] == "baseline" and r["n"] == 1 and r["pass_no"] == k), None)
            if not (b and o and o.get("tokens_per_s")):
                continue
            row = {
                "pass_no": k,
                "ours": o["tokens_per_s"],
                "baseline": b["tokens_per_s"],
                "ratio": o["tokens_per_s"] / b["tokens_per_s"],
                # tokens per CPU second, ours / baseline (ranks' CPU; the torchrun agent's apart)
                "cpu_ratio": b["cpu_ms_per_1k_tokens"] / o["cpu_ms_per_1k_tokens"]
                if o.get("cpu_ms_per_1k_tokens")
                else None,
                "end_to_end_ratio": o["end_to_end_tokens_per_s"] / b["tokens_per_s"],
                "per_rank_vs_1_process": (o["tokens_per_s"] / n / b1["tokens_per_s"]) if b1 else None,
                "baseline_per_process_vs_1": (b["tokens_per_s"] / n / b1["tokens_per_s"]) if b1 else None,
                "startup_s": o["startup_s"],
                "tail_s": o["tail_s"],
                "wall_s": o["wall_s"],
                "steps_s": o["steps_s"],
            }
            # paired: the same steps (the same micro batches) on both sides, window by window between logged steps;
            # the baseline's window = its slowest process's (what lockstep would have made it); median over windows
            marks = [s for s in sorted(o["step_times"]) if s >= p.skip]
            pairs = [
                max(t[e] - t[a] for t in b["times_per_process"]) / (o["step_times"][e] - o["step_times"][a])
                for a, e in zip(marks, marks[1:])
            ]
            row["paired_ratio"] = harness.median_of(pairs)
            if n == 1:
                common = sorted(set(o["losses"]) & set(int(s) for s in b["losses"]))
                diffs = [abs(o["losses"][s] - b["losses"][s]) / max(1e-12, abs(b["losses"][s])) for s in common]
                row["loss_max_rel_diff"] = max(diffs) if diffs else None
                row["loss_first_last"] = (b["losses"][common[0]], b["losses"][common[-1]]) if common else None
            rows.append(row)
        if not rows:
            continue
        summary = {
            key: harness.median_of(r[key] for r in rows)
            for key in (
                "ours",
                "baseline",
                "ratio",
                "end_to_end_ratio",
                "startup_s",
                "tail_s",
                "wall_s",
                "steps_s",
                "paired_ratio",
                "cpu_ratio",
                "per_rank_vs_1_process",
                "baseline_per_process_vs_1",
            )
        }
        summary.update(
            {f"{key}_range": harness.range_of(r[key] for r in rows) for key in ("ratio", "paired_ratio", "cpu_ratio")}
        )
        if n == 1:
            d = [r["loss_max_rel_diff"] for r in rows if r.get("loss_max_rel_diff") is not None]
            summary["loss_max_rel_diff"] = max(d) if d else None
            summary["loss_first_last"] = rows[0].get("loss_first_last")
        summary["passes"] = rows
        res[str(n)] = summary
    return res


def main(argv: list[str] | None = None) -> int:
    kept = "jobs and rank logs"
    ap = harness.arguments(
        __doc__,
        Params(),
        keep=kept,
        verbose=True,
        quick="a smaller run (1 pass of 8 steps, short continuations): smoke test of the bench",
    )
    ap.add_argument("--baseline-worker", nargs=3, metavar=("CFG", "N", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.baseline_worker:
        cfg_path, n, out_path = args.baseline_worker
        train_baselines.baseline_worker(cfg_path, int(n), out_path)
        return 0
    p = harness.params_from(args, Params)

    import deepspeed
    import transformers

    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "deepspeed": deepspeed.__version__,
    }
    return harness.run_bench(
        "train",
        args,
        asdict(p),
        versions,
        lambda tmp, out: run(p, tmp, out, args.verbose),
        lambda out: train_report.print_report(p, out),
        kept=kept,
    )


if __name__ == "__main__":
    sys.exit(main())
