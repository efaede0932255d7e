"""GPU check: the capture, train, export and eval path on one GPU (deepspeed launcher, NCCL, bf16), measured.

One script that a machine with one GPU, PyTorch and transformers but no internet runs in under 8
minutes (bench/gpu_check.sh installs the wheels it lacks first: docs/gpu-check.md). It runs the
pipeline's own code, the way the stage tasks run it, without Prefect:

1. target   models.target.tiny.build_tiny_target, widened (default hidden 1024, 16 layers);
2. records  the target's own greedy continuations of random prompts (in this process, on the GPU),
            written as the records stage writes them (tasks/records/build.py: parts + token counts);
3. capture  `models.capture` (replicate, bf16) launched by tasks.launch_ranks.rank_command with the
            deepspeed launcher on 1 GPU and followed with tasks.launch_ranks.follow_job;
4. train    `models.train` (DeepSpeed ZeRO-2, bf16, NCCL) likewise, a few hundred steps, a checkpoint
            and the export at the end;
5. export   the export in draft/final/ validated (SGLang and vLLM) and loaded back (models.export.eagle3);
6. eval     `models.eval`: chain speculative decoding, trained and untrained draft.

Each phase runs under its own time limit, cut to what is left of the whole run's `--budget-s`; a
launched job past its limit is killed (tasks.launch_ranks.run_job), an in-process phase interrupted. A
phase that fails is reported with its error and the phases that need it are skipped; the figures
of every phase that ran are kept. The JSON (`--json`, default $OUT/gpu_check.json where $OUT is
set, else runs/gpu-check/gpu_check.json) is rewritten after every phase, and the eval's after
every prompt (`Check.progress`), so a run killed from outside, or an eval killed at its limit
(`timed_out`), still leaves what it measured; every launched process's output goes, time-stamped,
to gpu_check.log beside it. Exit status 0 only when every phase passed.

Figures: capture tokens/s (forward phase: first to last progress line; and launch to exit), train
steps/s and tokens/s (between metrics.jsonl train lines, the first `--skip-steps` left out), the
first and final training loss, the held-out TTT acceptance estimate, export size, the eval's
acceptance length (trained, untrained), wall time per phase, and each launched process's peak
memory from its `RANK_MEMORY` line (models/ranks/harness.py: host RSS; CUDA allocator peak allocated and
reserved), the GPU's name and memory, torch / CUDA / NCCL / DeepSpeed / transformers versions.

`--cpu-smoke` runs the same sequence on this machine: a small target, torchrun + gloo, fp32, a few
steps, in well under a minute (tests/bench/test_gpu_check.py runs it). Its figures only show the
path works. Usage::

    bash bench/gpu_check.sh [--FLAG VALUE ...]              # the GPU machine (docs/gpu-check.md)
    .venv/bin/python bench/gpu_check.py --cpu-smoke [--rank-launcher deepspeed] [--json out.json]
        [--keep DIR] [--verbose]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, models, tasks
from bench import harness  # noqa: E402  (first: the offline environment the ranks inherit)
from models.common.run_layout import RunLayout  # noqa: E402  (plain Python: `work` is laid out as a run directory)

DATASET = "check"
REPORT_RESERVE_S = 10.0  # kept from the budget for the report


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@dataclass
class Params(harness.TargetParams):
    """Every knob of one check (printed and saved with the figures). Defaults: the GPU run."""

    quick: bool = False  # --cpu-smoke: the small CPU preset
    device: str = "cuda"  # cuda: deepspeed launcher, NCCL, bf16; cpu: torchrun, gloo, fp32
    precision: str = "auto"  # auto: bf16 on cuda, fp32 on cpu; bf16 / fp32 to choose (bf16 on CPU: the dtype path here)
    # auto: deepspeed on cuda, torchrun on cpu; `--cpu-smoke --rank-launcher deepspeed`: the GPU run's launcher on CPU
    rank_launcher: str = "auto"
    seed: int = 0
    # the target (models/target/tiny.py); vocab_size is an upper bound: the BPE trainer decides
    hidden_size: int = 1024
    num_layers: int = 16
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 2816
    vocab_size: int = 2048
    target_train_steps: int = harness.tiny_target_default("train_steps")  # the target's own training when built
    # records: the target's greedy continuations of random prompts
    prompts: int = 512
    prompt_tokens: int = 64
    new_tokens: int = 448
    gen_batch: int = 512  # prompts per generate() call
    # capture
    capture_batch_tokens: int = 32768
    shard_tokens: int = 65536
    # train
    steps: int = 300
    skip_steps: int = 20  # train steps left out of the throughput (warmup: allocator, kernels); a multiple of log_every
    log_every: int = 10
    train_batch_tokens: int = 8192
    ttt_steps: int = 7
    lr: float = 3e-3
    warmup_ratio: float = 0.05
    draft_vocab_size: int = 32000  # capped by the target's vocab
    eval_fraction: float = 0.1
    # eval
    eval_prompts: int = 32
    eval_new_tokens: int = 96
    eval_num_steps: int = 3
    # time: the whole run, then each phase (cut to what is left of the whole)
    budget_s: float = 420.0
    target_s: float = 120.0
    records_s: float = 120.0
    capture_s: float = 150.0
    train_s: float = 240.0
    export_s: float = 60.0
    eval_s: float = 150.0

    @classmethod
    def quick_preset(cls) -> Params:
        """--cpu-smoke: the same path on CPU at toy sizes (a target half the demo's width, random weights)."""
        # by stage, as the fields above
        target = dict(hidden_size=64, num_layers=8, num_heads=2, num_kv_heads=1, intermediate_size=128)
        records = dict(prompts=24, prompt_tokens=16, new_tokens=40, gen_batch=24)
        capture = dict(capture_batch_tokens=2048, shard_tokens=4096)
        train = dict(steps=6, skip_steps=2, log_every=1, train_batch_tokens=512, lr=2e-3, eval_fraction=0.25)
        evaluate = dict(eval_prompts=2, eval_new_tokens=12)
        return cls(
            quick=True,
            device="cpu",
            budget_s=240.0,
            target_train_steps=0,  # a random target: the smoke only shows the path works
            **target,
            **records,
            **capture,
            **train,
            **evaluate,
        )

    @property
    def launcher(self) -> str:
        if self.rank_launcher != "auto":
            return self.rank_launcher
        return "deepspeed" if self.device == "cuda" else "torchrun"

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")

    def validate(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise SystemExit(f"--device must be cuda or cpu, got {self.device!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise SystemExit(f"--precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.rank_launcher not in ("auto", "deepspeed", "torchrun"):
            raise SystemExit(f"--rank-launcher must be auto, deepspeed or torchrun, got {self.rank_launcher!r}")
        if not 0 <= self.skip_steps < self.steps or self.skip_steps % self.log_every:
            raise SystemExit(
                f"--skip-steps must be in [0, --steps) and a multiple of --log-every, "
                f"got {self.skip_steps} (steps {self.steps}, log every {self.log_every})"
            )


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Params]:
    ap = harness.arguments(
        __doc__,
        Params(),
        keep="the target, records, hidden states and draft",
        verbose=True,
        quick="same as --cpu-smoke",
    )
    ap.add_argument(
        "--cpu-smoke",
        dest="quick",
        action="store_true",
        help="the small CPU preset: torchrun, gloo, fp32, a few steps (this machine, < 1 min)",
    )
    args = ap.parse_args(argv)
    return args, harness.params_from(args, Params)


# ---------------------------------------------------------------------------------------------
# The run: phases, their limits, the JSON
# ---------------------------------------------------------------------------------------------


class PhaseTimeout(Exception):
    """An in-process phase ran past its limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise PhaseTimeout in this (main) thread once `seconds` have passed (checked between Python bytecodes)."""

    def expired(signum, frame):  # noqa: ARG001 - signal handler signature
        raise PhaseTimeout(f"ran past its time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Check:
    """One check: the phases in order, each timed and limited, the figures written after each."""

    def __init__(self, p: Params, json_path: Path, log_path: Path, work: Path, verbose: bool):
        self.p, self.json_path, self.log_path, self.work, self.verbose = p, json_path, log_path, work, verbose
        self.started = time.monotonic()
        self.deadline = self.started + p.budget_s
        self.out: dict[str, Any] = {"params": asdict(p), "machine": machine(p), "phases": {}, "ok": None}
        self.running: tuple[str, float] | None = None  # the phase under way and when it started
        self.partial: dict[str, Any] = {}  # its figures so far (`progress`): kept if it fails or runs out of time
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w", buffering=1)
        self.save()

    def save(self) -> None:
        self.out["total_s"] = round(time.monotonic() - self.started, 2)
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(self.out, indent=2, default=str) + "\n")
        tmp.replace(self.json_path)

    def phase(
        self,
        name: str,
        cap_s: float,
        fn: Callable[[float], dict[str, Any]],
        *,
        needs: tuple[str, ...] = (),
        in_process: bool = False,
    ) -> dict[str, Any] | None:
        """Run `fn(limit_s)` as phase `name`; its figures (or its error) go into the JSON. Returns the figures or None.

        A phase that fails, runs out of time (`timed_out`) or is stopped keeps the figures it gave
        `progress` so far beside its error.
        """
        phases = self.out["phases"]
        missing = [n for n in needs if not phases.get(n, {}).get("ok")]
        left = self.deadline - REPORT_RESERVE_S - time.monotonic()
        limit = min(cap_s, left)
        if missing or limit < 5:
            why = (
                f"needs {', '.join(missing)}, which did not pass"
                if missing
                else f"no time left ({left:.0f} s of the budget)"
            )
            phases[name] = {"ok": False, "skipped": why}
            print(f"== {name}: skipped ({why})", flush=True)
            self.save()
            return None
        print(f"== {name} (limit {limit:.0f} s) ...", flush=True)
        self.note(f"=== phase {name} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        self.running, self.partial = (name, t0), {}
        try:
            with time_limit(limit) if in_process else contextlib.nullcontext():
                figures = fn(limit)
            result = {"ok": True, "wall_s": round(time.monotonic() - t0, 2), **figures}
        except SystemExit as e:  # SIGTERM (terminate_with_exit): this phase's figure says so, and the check ends here
            phases[name] = {
                "ok": False,
                "wall_s": round(time.monotonic() - t0, 2),
                **self.partial,
                "error": f"{e}: the check was stopped",
            }
            self.running = None
            print(f"   STOPPED after {phases[name]['wall_s']:.1f} s: {e}", flush=True)
            self.save()
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a figure of the check; the next phases still report
            from tasks.launch_ranks import JobTimedOut

            result = {
                "ok": False,
                "wall_s": round(time.monotonic() - t0, 2),
                **self.partial,
                "timed_out": isinstance(e, (PhaseTimeout, JobTimedOut)),
                "error": f"{type(e).__name__}: {e}"[-4000:],
            }
            self.note(traceback.format_exc())
            print(
                f"   {'TIMED OUT' if result['timed_out'] else 'FAILED'} after {result['wall_s']:.1f} s: "
                f"{result['error'][-1500:]}",
                flush=True,
            )
        self.running = None
        phases[name] = result
        if result["ok"]:
            print(f"   ok in {result['wall_s']:.1f} s", flush=True)
        self.save()
        return result if result["ok"] else None

    def progress(self, **figures: Any) -> None:
        """Figures of the running phase so far, into the JSON now: what a phase killed at its limit leaves."""
        assert self.running is not None, "progress outside a phase"
        name, t0 = self.running
        self.partial.update(figures)
        self.out["phases"][name] = {
            "ok": False,
            "running": True,
            "wall_s": round(time.monotonic() - t0, 2),
            **self.partial,
        }
        self.save()

    def note(self, line: str) -> None:
        """A line into gpu_check.log, stamped with the seconds since the check started."""
        self.log.write(f"{time.monotonic() - self.started:9.3f} {line}\n")
        if self.verbose:
            print(f"      | {line}", flush=True)

    def launch(
        self,
        module: str,
        job_path: Path,
        protocol: Any,
        limit_s: float,
        *,
        single_process: bool = False,
        on_progress: Callable[[Any], None] | None = None,
    ) -> dict[str, Any]:
        """Launch `python -m module --job JOB` as the stage tasks do; its protocol lines, their times, its memory.

        One rank (`single_process` False; one GPU): tasks.launch_ranks.rank_command with this check's launcher; the eval
        job runs as one process, as tasks/eval/tasks.py starts it. The output is followed with
        tasks.launch_ranks.follow_job, so a failing rank raises its own exception; the launch is killed
        at `limit_s` (JobTimedOut). `on_progress` gets each progress message as it comes.
        """
        from models.common.rank_protocol import RANK_MEMORY
        from tasks.launch_ranks import follow_job, rank_command, run_job

        if single_process:
            command, env = [sys.executable, "-m", module, "--job", str(job_path)], {"OMP_NUM_THREADS": "1"}
        else:
            command, env = rank_command(module, ["--job", str(job_path)], num_ranks=1, launcher=self.p.launcher)
        # The ranks import models/ from this checkout (no editable install on the GPU machine) and the
        # carried wheels from PYTHONPATH (bench/gpu_check.sh puts them there).
        env = {
            **env,
            "PYTHONPATH": os.pathsep.join(x for x in (str(harness.REPO), os.environ.get("PYTHONPATH")) if x),
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.note("launch: " + " ".join(command))
        messages: list[tuple[float, Any]] = []  # (time.time(), Message)
        memory: list[dict[str, int]] = []
        started = time.time()

        def on_line(line: str) -> None:
            self.note(line)
            found = RANK_MEMORY.parse(line)
            if found is not None:
                memory.append(found)

        def on_message(message: Any) -> None:
            messages.append((time.time(), message))
            if message.kind is protocol.progress:  # follow_job logs the events itself
                self.note(message.line)
                if on_progress is not None:
                    on_progress(message)

        follow_job(
            command,
            protocol=protocol,
            log=on_line,
            on_message=on_message,
            env=env,
            run=functools.partial(run_job, timeout_s=limit_s),
        )
        ended = time.time()
        return {"started": started, "ended": ended, "messages": messages, "memory": memory}


def memory_figures(memory: list[dict[str, int]]) -> dict[str, Any]:
    """The largest peaks over a launch's processes (RANK_MEMORY lines), in GiB."""
    gib = 2**30
    out: dict[str, Any] = {"host_peak_rss_gib": round(max((m["host_peak_rss"] for m in memory), default=0) / gib, 3)}
    if any("gpu_peak_allocated" in m for m in memory):
        out["gpu_peak_allocated_gib"] = round(max(m.get("gpu_peak_allocated", 0) for m in memory) / gib, 3)
        out["gpu_peak_reserved_gib"] = round(max(m.get("gpu_peak_reserved", 0) for m in memory) / gib, 3)
    return out


def dir_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) if path.is_dir() else 0


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine(p: Params) -> dict[str, Any]:
    """The machine's facts: CPU, Python, the packages' versions, the GPU (name, memory, driver) where there is one."""
    import torch

    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "processor": harness.cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{
            name: version(name)
            for name in ("deepspeed", "transformers", "tokenizers", "safetensors", "pydantic", "pyarrow")
        },
        "cuda_available": torch.cuda.is_available(),
        "loadavg_start": harness.loadavg(),
        # the deepspeed launcher maps it to its ranks' GPUs (tasks/launch_ranks.py `local_devices`)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpus=torch.cuda.device_count(),
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_capability=f"{props.major}.{props.minor}",
        )
        with contextlib.suppress(Exception):  # a tuple in torch 2.x, an int before; a figure, never a failure
            nccl = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            facts["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
                or None
            )
    return facts


# ---------------------------------------------------------------------------------------------
# The phases
# ---------------------------------------------------------------------------------------------


def build_target(p: Params, work: Path) -> dict[str, Any]:
    """The widened tiny target; its parameters counted from the checkpoint's headers."""
    from safetensors import safe_open

    from models.target.tiny import build_tiny_target

    target = build_tiny_target(work / "target", **p.target_shape(), train_steps=p.target_train_steps, device=p.device)
    params = 0
    for f in sorted(target.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for key in st.keys():
                params += math.prod(st.get_slice(key).get_shape())
    config = json.loads((target / "config.json").read_text())
    return {
        "path": str(target),
        "params_m": round(params / 1e6, 1),
        "vocab_size": config["vocab_size"],
        "hidden_size": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "checkpoint_mb": round(dir_bytes(target) / 1e6, 1),
    }


def make_records(p: Params, work: Path, target: Path) -> dict[str, Any]:
    """Records of the target's greedy continuations of random prompts (loss on the continuation), and token counts.

    Generated on the check's device in its dtype, eos suppressed (`min_new_tokens`): every record has
    the same length, so the capture and training throughputs measure full batches. The labels the
    draft learns are the target's own distributions (from the captured final hidden states), not these
    tokens, so suppressing eos biases nothing the draft is trained on.
    """
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    from tasks.records.build import count_tokens

    hf_logging.set_verbosity_error()
    device = torch.device(p.device)
    dtype = torch.bfloat16 if p.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype).to(device).eval()
    vocab = int(model.config.vocab_size)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    g = torch.Generator().manual_seed(p.seed)
    prompts = torch.randint(8, vocab, (p.prompts, p.prompt_tokens), generator=g)  # ids 0..7: the special tokens
    rows, generated = [], 0
    t0 = time.perf_counter()
    with torch.no_grad():
        for k in range(0, p.prompts, p.gen_batch):
            chunk = prompts[k : k + p.gen_batch].to(device)
            out = model.generate(
                chunk,
                attention_mask=torch.ones_like(chunk),
                max_new_tokens=p.new_tokens,
                min_new_tokens=p.new_tokens,
                do_sample=False,
                pad_token_id=0,
            ).cpu()
            generated += (out.shape[1] - p.prompt_tokens) * out.shape[0]
            rows += [harness.record_row(f"g{k + i:05d}", seq.tolist(), p.prompt_tokens) for i, seq in enumerate(out)]
    generate_s = time.perf_counter() - t0
    figures = {
        "records": len(rows),
        "tokens": sum(r["num_tokens"] for r in rows),
        "loss_tokens": sum(r["num_loss_tokens"] for r in rows),
        "generate_s": round(generate_s, 2),
        "generate_tokens_per_s": round(generated / generate_s, 1),
    }
    if device.type == "cuda":
        figures["gpu_peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the ranks get the GPU to themselves (but for this process's context)
    layout = RunLayout(work)
    harness.write_records(rows, layout.records(DATASET), rows_per_part=256)
    count_tokens([layout.records(DATASET)], layout.token_counts, vocab)
    return figures


def capture(check: Check, limit_s: float, target: Path) -> dict[str, Any]:
    """`models.capture` on 1 rank (replicate): tokens/s of the forward phase and of the whole launch, stored bytes."""
    from models.capture.shards import list_shards
    from models.common.jobs import CaptureJob
    from models.common.rank_protocol import CAPTURE
    from tasks.launch_ranks import write_job

    p, layout = check.p, RunLayout(check.work)
    job = CaptureJob(
        target_path=str(target),
        datasets=[{"name": DATASET, "records_dir": str(layout.records(DATASET))}],
        out_dir=str(layout.hidden_dir),
        device=p.device,
        mode="replicate",
        dtype="bfloat16" if p.bf16 else "float32",
        max_batch_tokens=p.capture_batch_tokens,
        shard_tokens=p.shard_tokens,
        launch_tokens=None,
    )
    job_path = layout.job("capture")
    write_job(job, job_path, kept=lambda: "nothing yet", resume="run the check again")
    run = check.launch("models.capture", job_path, CAPTURE, limit_s)
    progress = [(t, m.values) for t, m in run["messages"]]
    if not progress:
        raise RuntimeError("the capture printed no progress")
    (t_first, _), (t_last, last) = progress[0], progress[-1]
    forward_s = max(1e-9, t_last - t_first)
    stored = sum(f.stat().st_size for f in list_shards(layout.hidden_dir))
    return {
        "samples": last["done"],
        "tokens": last["tokens"],
        "startup_s": round(t_first - run["started"], 2),
        "forward_s": round(forward_s, 2),
        "tokens_per_s": round(last["tokens"] / forward_s, 1),
        "end_to_end_tokens_per_s": round(last["tokens"] / (run["ended"] - run["started"]), 1),
        "stored_gb": round(stored / 1e9, 3),
        "bytes_per_token": round(stored / max(1, last["tokens"]), 1),
        **memory_figures(run["memory"]),
    }


def train(check: Check, limit_s: float, target: Path) -> dict[str, Any]:
    """`models.train` (ZeRO-2) on 1 rank: steps/s and tokens/s between metrics lines, losses, the held-out estimate."""
    from models.common.draft_jobs import TrainJob
    from models.common.rank_protocol import TRAIN, TRAIN_PROGRESS
    from tasks.launch_ranks import write_job

    p, layout = check.p, RunLayout(check.work)
    job = TrainJob(
        target_path=str(target),
        out_dir=str(layout.draft_dir),
        token_counts=str(layout.token_counts),
        mode="offline",
        hidden_dir=str(layout.hidden_dir),
        draft_vocab_size=p.draft_vocab_size,
        ttt_steps=p.ttt_steps,
        max_steps=p.steps,
        max_batch_tokens=p.train_batch_tokens,
        lr=p.lr,
        warmup_ratio=p.warmup_ratio,
        checkpoint_every=p.steps,
        keep_checkpoints=1,
        eval_every=p.steps,
        eval_fraction=p.eval_fraction,
        log_every=p.log_every,
        seed=p.seed,
        device=p.device,
        precision="bf16" if p.bf16 else "fp32",
    )  # the optimizer: the train section's declared defaults
    job_path = layout.job("train")
    write_job(job, job_path, kept=lambda: "nothing yet", resume="run the check again")
    run = check.launch("models.train", job_path, TRAIN, limit_s)
    step0 = next((t for t, m in run["messages"] if m.kind is TRAIN_PROGRESS and m.values["step"] == 0), None)
    lines = [json.loads(x) for x in layout.metrics.read_text().splitlines() if x.strip()]
    train_lines = [x for x in lines if x["kind"] == "train"]
    first = next(x for x in train_lines if x["step"] >= max(p.skip_steps, p.log_every))
    last = train_lines[-1]
    window_s = max(1e-9, last["time"] - first["time"])
    summary = json.loads(layout.train_summary.read_text())
    held_out = summary.get("eval") or {}
    figures = {
        "steps": last["step"],
        "tokens": last["tokens"],
        "window_steps": last["step"] - first["step"],
        "steps_per_s": round((last["step"] - first["step"]) / window_s, 3),
        "tokens_per_s": round((last["tokens"] - first["tokens"]) / window_s, 1),
        "startup_s": round(step0 - run["started"], 2) if step0 else None,
        "tail_s": round(run["ended"] - last["time"], 2),  # final eval, checkpoint, export, teardown
        "first_loss": train_lines[0]["loss"],
        "final_loss": last["loss"],
        "held_out_loss": held_out.get("loss"),
        "held_out_acceptance_length": held_out.get("acceptance_length"),
        "checkpoint_mb": round(dir_bytes(layout.checkpoints) / 1e6, 1),
        **memory_figures(run["memory"]),
    }
    if not all(math.isfinite(x) for x in (figures["first_loss"], figures["final_loss"])):
        raise RuntimeError(f"the training loss is not finite: {figures['first_loss']} -> {figures['final_loss']}")
    return figures


def check_export(p: Params, work: Path) -> dict[str, Any]:
    """The export in draft/final/: validated for SGLang and vLLM and loaded back (models.export.eagle3), its size."""
    import torch

    from models.export.eagle3 import load_exported_draft
    from models.export.sglang import validate_export
    from models.export.vllm import validate_export_vllm

    final = RunLayout(work).final
    problems = validate_export(final) + [f"vLLM: {x}" for x in validate_export_vllm(final)]
    if problems:
        raise ValueError(f"{final} is not a valid EAGLE-3 export: {problems}")
    draft = load_exported_draft(final, dtype=torch.float32)
    config = json.loads((final / "config.json").read_text())
    return {
        "path": str(final),
        "export_mb": round(dir_bytes(final) / 1e6, 2),
        "params_m": round(sum(x.numel() for x in draft.parameters()) / 1e6, 2),
        "torch_dtype": config.get("torch_dtype") or config.get("dtype"),
        "draft_vocab_size": config.get("draft_vocab_size"),
        "architectures": config.get("architectures"),
    }


def evaluate(check: Check, limit_s: float, target: Path) -> dict[str, Any]:
    """`models.eval`: acceptance length of the trained and the untrained draft on held-out prompts.

    Each prompt's figures (its EVAL_PROGRESS line: new tokens, verify rounds, accepted draft tokens)
    go into the JSON as they come, with the acceptance length so far (`partial_eval`): an eval
    killed at its limit leaves them, the trained draft's first (models/eval/job.py runs it first).
    """
    from models.common.draft_jobs import EvalJob
    from models.common.rank_protocol import EVAL
    from tasks.launch_ranks import write_job

    p, layout = check.p, RunLayout(check.work)
    raw = layout.eval_raw
    job = EvalJob(
        prompts=p.eval_prompts,
        max_new_tokens=p.eval_new_tokens,
        num_steps=p.eval_num_steps,
        device=p.device,
        compare_untrained=True,
        eval_fraction=p.eval_fraction,
        seed=p.seed,
        target_path=str(target),
        datasets=[{"name": DATASET, "records_dir": str(layout.records(DATASET))}],
        draft_dir=str(layout.final),
        out=str(raw),
    )
    job_path = layout.job("eval")
    write_job(job, job_path, kept=lambda: "the export", resume="run the check again")
    per_prompt: dict[str, list[dict[str, int]]] = {}

    def on_progress(message: Any) -> None:
        v = message.values
        if "rounds" not in v:
            return
        per_prompt.setdefault(v["draft"], []).append(
            {"prompt": v["done"], "new_tokens": v["new_tokens"], "rounds": v["rounds"], "accepted": v["accepted"]}
        )
        check.progress(num_steps=p.eval_num_steps, **partial_eval(per_prompt, total=v["total"]))

    run = check.launch("models.eval", job_path, EVAL, limit_s, single_process=True, on_progress=on_progress)
    result = json.loads(raw.read_text())
    trained, untrained = result["trained"], result.get("untrained", {})
    return {
        "prompts": result["prompts"],
        "device": result["device"],
        "num_steps": p.eval_num_steps,
        "acceptance_length": trained["acceptance_length"],
        "per_position": trained["per_position_acceptance"],
        "untrained_acceptance_length": untrained.get("acceptance_length"),
        "rounds": trained["rounds"],
        "new_tokens": trained["new_tokens"],
        "per_prompt": per_prompt,
        **memory_figures(run["memory"]),
    }


def partial_eval(per_prompt: dict[str, list[dict[str, int]]], *, total: int) -> dict[str, Any]:
    """The eval's figures from the prompts done so far: acceptance length per draft (SGLang's, over their rounds)."""

    def length(prompts: list[dict[str, int]]) -> float | None:
        rounds = sum(x["rounds"] for x in prompts)
        return round((sum(x["accepted"] for x in prompts) + rounds) / rounds, 4) if rounds else None

    trained, untrained = per_prompt.get("trained", []), per_prompt.get("untrained", [])
    return {
        "prompts": total,
        "prompts_done": {name: len(x) for name, x in per_prompt.items()},
        "acceptance_length": length(trained),
        "untrained_acceptance_length": length(untrained),
        "rounds": sum(x["rounds"] for x in trained),
        "new_tokens": sum(x["new_tokens"] for x in trained),
        "per_prompt": per_prompt,
    }


# ---------------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------------


def report(out: dict[str, Any]) -> None:
    m, ph = out["machine"], out["phases"]

    def get(phase: str, key: str, fmt: str = "") -> str:
        value = ph.get(phase, {}).get(key)
        return "-" if value is None else format(value, fmt) if fmt else str(value)

    print("\nphases")
    harness.table(
        ["phase", "ok", "wall s", "what"],
        [
            [
                name,
                "yes"
                if r.get("ok")
                else "skipped"
                if "skipped" in r
                else "TIMED OUT"
                if r.get("timed_out")
                else "FAILED",
                get(name, "wall_s", ".1f"),
                (r.get("skipped") or r.get("error", ""))[:90].replace("\n", " "),
            ]
            for name, r in ph.items()
        ],
    )
    print("\nfigures")
    harness.table(
        ["figure", "value"],
        [
            ["target: parameters (M) / vocab", f"{get('target', 'params_m')} / {get('target', 'vocab_size')}"],
            ["records: records / tokens", f"{get('records', 'records')} / {get('records', 'tokens')}"],
            ["records: generate tokens/s (HF generate)", get("records", "generate_tokens_per_s", ",.0f")],
            ["capture: tokens/s (forward phase)", get("capture", "tokens_per_s", ",.0f")],
            ["capture: tokens/s (launch to exit)", get("capture", "end_to_end_tokens_per_s", ",.0f")],
            ["capture: start-up s", get("capture", "startup_s", ".1f")],
            [
                "capture: stored GB / bytes per token",
                f"{get('capture', 'stored_gb')} / {get('capture', 'bytes_per_token')}",
            ],
            [
                "capture: GPU peak allocated / reserved GiB",
                f"{get('capture', 'gpu_peak_allocated_gib')} / {get('capture', 'gpu_peak_reserved_gib')}",
            ],
            ["train: steps/s", get("train", "steps_per_s", ".2f")],
            ["train: tokens/s", get("train", "tokens_per_s", ",.0f")],
            ["train: start-up s / tail s", f"{get('train', 'startup_s', '.1f')} / {get('train', 'tail_s', '.1f')}"],
            [
                "train: loss first -> final",
                f"{get('train', 'first_loss', '.4f')} -> {get('train', 'final_loss', '.4f')}",
            ],
            ["train: held-out TTT acceptance length", get("train", "held_out_acceptance_length", ".3f")],
            [
                "train: GPU peak allocated / reserved GiB",
                f"{get('train', 'gpu_peak_allocated_gib')} / {get('train', 'gpu_peak_reserved_gib')}",
            ],
            ["train: host peak RSS GiB", get("train", "host_peak_rss_gib")],
            ["export: MB / parameters (M)", f"{get('export', 'export_mb')} / {get('export', 'params_m')}"],
            [
                "eval: acceptance length trained / untrained",
                f"{get('eval', 'acceptance_length', '.3f')} / {get('eval', 'untrained_acceptance_length', '.3f')}"
                + (
                    ""
                    if ph.get("eval", {}).get("ok") or "prompts_done" not in ph.get("eval", {})
                    else f" (partial: {', '.join(f'{k} {n}' for k, n in ph['eval']['prompts_done'].items())} "
                    f"of {ph['eval']['prompts']} prompts)"
                ),
            ],
            ["eval: GPU peak allocated GiB", get("eval", "gpu_peak_allocated_gib")],
        ],
    )
    gpu = (
        f"{m.get('gpu')} ({m.get('gpu_memory_gib')} GiB, driver {m.get('driver')})"
        if m.get("cuda_available")
        else "no GPU"
    )
    print(
        f"\n{gpu}; torch {m['torch']} (CUDA {m['cuda']}, NCCL {m.get('nccl')}), deepspeed {m['deepspeed']}, "
        f"transformers {m['transformers']}, Python {m['python']}, {m['cpus']} CPUs"
    )
    print(f"total {out['total_s']:.0f} s; {'every phase passed' if out['ok'] else 'SOME PHASES FAILED'}")


# ---------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------


def default_json() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else harness.REPO / "runs" / "gpu-check" / "gpu_check.json"


# NCCL on one VM: no InfiniBand, the loopback interface, no cuMem (it fails inside some VMs and containers).
SINGLE_VM_NCCL = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_CUMEM_ENABLE": "0"}


def preflight(p: Params, json_path: Path) -> list[Any] | None:
    """The environment checks (models/ranks/environment.py), printed; None after writing the JSON when one FAILs.

    Seconds, before the first phase: a missing package or an unseen GPU stops the check here, not minutes in.
    """
    from models.common.findings import failed
    from models.ranks.environment import environment_checks

    findings = environment_checks(p.device)
    for f in findings:
        print(
            f"   {f.status:4}  {f.name}: {f.detail}" + (f"  -> {f.advice}" if f.advice and f.status != "PASS" else ""),
            flush=True,
        )
    bad = failed(findings)
    if not bad:
        return findings
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps(
            {"params": asdict(p), "preflight": [f.to_dict() for f in findings], "phases": {}, "ok": False}, indent=2
        )
        + "\n"
    )
    print(
        f"GPU check stopped before its first phase: {', '.join(f.name for f in bad)} failed (figures -> {json_path})",
        flush=True,
    )
    return None


def terminate_with_exit(signum, frame):  # noqa: ARG001 - signal handler signature
    """SIGTERM (the device runner's timeout, a user's kill) as SystemExit: the rank launch then kills its process group.

    The ranks run in a session of their own (tasks/launch_ranks.py `run_job`), so Python's default SIGTERM, which ends
    this process at once, left them running and holding the GPU; raised as an exception it passes through
    run_job's cleanup (killpg) and the figures are still written.
    """
    raise SystemExit(f"terminated (signal {signum})")


def main(argv: list[str] | None = None) -> int:
    args, p = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate_with_exit)
    if p.device == "cpu":
        # This process's own math (the target's training, the records' generation) on one thread, like a
        # CPU rank: on a small busy machine, threads that spin-wait for each other make it 10-20x slower.
        import torch

        torch.set_num_threads(1)
        # DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared
        # by every checkout: another checkout's build of the same op forces a rebuild, minutes on 2 busy cores).
        # A directory of this checkout's own: built once, then reused. The GPU path builds nothing.
        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(harness.REPO / "runs" / "gpu-check" / "torch_extensions"))
    json_path = args.json or default_json()
    if p.device == "cuda":
        for name, value in SINGLE_VM_NCCL.items():  # overridable: a value already in the environment wins
            os.environ.setdefault(name, value)
    findings = preflight(p, json_path)
    if findings is None:
        return 2
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.keep))
    print(
        f"GPU check ({p.launcher}, {'NCCL' if p.device == 'cuda' else 'gloo'}, {'bf16' if p.bf16 else 'fp32'}"
        f"{', --cpu-smoke' if p.quick else ''}), "
        f"budget {p.budget_s:.0f} s; figures -> {json_path}",
        flush=True,
    )
    check = Check(p, json_path, json_path.with_name("gpu_check.log"), work, bool(args.verbose))
    check.out["preflight"] = [f.to_dict() for f in findings]
    check.out["machine"]["nccl_env"] = {name: os.environ.get(name) for name in SINGLE_VM_NCCL}
    try:
        if p.device == "cuda" and not check.out["machine"]["cuda_available"]:
            check.out["phases"]["gpu"] = {
                "ok": False,
                "error": "torch sees no CUDA device (use --cpu-smoke on a CPU machine)",
            }
        else:
            target = work / "target"
            check.phase("target", p.target_s, lambda limit: build_target(p, work), in_process=True)
            check.phase(
                "records", p.records_s, lambda limit: make_records(p, work, target), needs=("target",), in_process=True
            )
            check.phase("capture", p.capture_s, lambda limit: capture(check, limit, target), needs=("records",))
            check.phase("train", p.train_s, lambda limit: train(check, limit, target), needs=("capture",))
            check.phase("export", p.export_s, lambda limit: check_export(p, work), needs=("train",), in_process=True)
            check.phase("eval", p.eval_s, lambda limit: evaluate(check, limit, target), needs=("export",))
    finally:
        check.out["ok"] = bool(check.out["phases"]) and all(r.get("ok") for r in check.out["phases"].values())
        check.out["machine"]["loadavg_end"] = harness.loadavg()
        check.save()
        check.log.close()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"target, records, hidden states and draft kept in {work}")
    report(check.out)
    print(f"figures written to {json_path}; the launched processes' output: {check.log_path}")
    return 0 if check.out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
