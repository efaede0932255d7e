"""Train-stage benchmark: our DeepSpeed ZeRO-2 training step against a plain PyTorch loop, in one run.

On the tiny Llama target (models/tiny_target.py, its default shape) and records made of its own
greedy continuations of the sample conversations (data/samples/*.jsonl; loss on the continuation),
whose hidden states are captured in-process with `models.capture.run`, one run measures the draft's
training throughput (real tokens per second) of:

- ours: `models.train` launched as the train flow launches it (tasks.launch_ranks.rank_command + run_job:
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
  job's DeepSpeed engine (models.train.build_engine) alternates their steps on the same batch tensors,
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
run generates the continuations: several minutes on 2 cores). The scaffolding (flags, launches,
spawned baselines, passes, tables, JSON) is bench/harness.py. Results and their reading:
docs/bench-train.md.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, models, tasks
from bench import harness  # noqa: E402  (first: the offline environment the ranks and baselines inherit)

# DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared by
# every virtualenv: another checkout's build of the same op name forces a ~45 s rebuild at the next launch).
# A directory of the bench's own keeps such rebuilds out of its start-up figures; inherited by every launch.
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(harness.REPO / "runs" / "bench-train" / "torch_extensions"))

import torch  # noqa: E402

import models  # noqa: E402,F401  (flushes CPU denormals in this process, as in every rank)
from flows.config.schema import TrainConfig  # noqa: E402
from models.capture import run as run_capture  # noqa: E402
from models.draft_vocab import draft_vocab, load_token_counts  # noqa: E402
from models.eagle3 import (  # noqa: E402
    STEP_DECAY,
    Eagle3Config,
    Eagle3Draft,
    default_aux_layers,  # noqa: E402
)
from models.hidden_shards import METADATA_NAME  # noqa: E402
from models.jobs import CaptureJob, TrainJob  # noqa: E402
from models.rank import Dist  # noqa: E402
from models.rank_protocol import TRAIN_PROGRESS  # noqa: E402
from models.run_layout import RunLayout  # noqa: E402
from models.target_head import TargetHead
from models.target_weights import load_target_tensors  # noqa: E402
from models.tiny_target import SAMPLES_DIR  # noqa: E402
from models.train import lr_lambda  # noqa: E402
from models.train_data import HiddenSource, epoch_batches, rank_micro_batches, split_samples, steps_per_epoch  # noqa: E402
from models.train_metrics import Metrics
from tasks.records.build import count_tokens  # noqa: E402

DATASET = "bench"
RUN_CONFIG = TrainConfig()  # the run config's train section as declared: its defaults (AdamW betas, eps, ...)
BETAS, EPS = RUN_CONFIG.adam_betas, RUN_CONFIG.adam_eps


# ---------------------------------------------------------------------------------------------
# Parameters
# ---------------------------------------------------------------------------------------------


@dataclass
class Params(harness.TargetParams):
    """Every knob of one bench run (printed and saved with the figures); the target: harness.TargetParams."""

    quick: bool = False
    # records: every sample conversation, cut to max_prompt_tokens, + its greedy continuation
    max_prompt_tokens: int = 768
    max_new_tokens: int = 96
    # the training job (the demo config's draft vocab and lr; the run config's defaults elsewhere)
    draft_vocab_size: int = 1024
    ttt_steps: int = RUN_CONFIG.ttt_steps
    max_batch_tokens: int = 1024  # padded tokens per micro batch per rank (the demo config's)
    grad_accum: int = RUN_CONFIG.grad_accum
    lr: float = 2e-3
    weight_decay: float = RUN_CONFIG.weight_decay
    grad_clip: float = RUN_CONFIG.grad_clip
    warmup_ratio: float = 0.05  # lr warmup (schedule), not the measurement's skip
    zero_stage: int = RUN_CONFIG.zero_stage  # train.zero_stage: 2 as the flow runs it; 0 or 1 to take ZeRO-2 apart
    eval_fraction: float = RUN_CONFIG.eval_fraction
    steps: int = 30  # optimizer steps per run (max_steps)
    skip: int = 5  # steps left out of the measurement at the start (a multiple of log_every)
    log_every: int = 1  # the job's metrics line interval: per-step times for the paired ratio (run config default: 10)
    threads: int = 1  # OMP_NUM_THREADS per rank (what rank_command gives CPU ranks) and per baseline process
    ranks: str = "1,2"  # comma-separated rank counts, each a row
    repeats: int = 3  # passes over the whole sequence (odd passes in reverse order); ratios: median over passes
    baseline_here: bool = False  # the 1-process baseline in this process instead of a fresh spawned one
    in_process_steps: int = 30  # the interleaved in-process comparison (1 rank; once per run); 0: skip it
    timeout_s: float = 900.0  # per launch or baseline

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, max_new_tokens=32, steps=8, skip=2, repeats=1, in_process_steps=8)

    def rank_list(self) -> list[int]:
        return [int(x) for x in self.ranks.split(",") if x.strip()]

    def validate(self) -> None:
        if not 0 < self.skip < self.steps:
            raise SystemExit(f"--skip must be in [1, --steps), got {self.skip} with --steps {self.steps}")
        if self.skip % self.log_every:
            raise SystemExit(f"--skip ({self.skip}) must be a multiple of --log-every ({self.log_every})")
        if not self.rank_list() or min(self.rank_list()) < 1:
            raise SystemExit(f"--ranks: comma-separated positive rank counts, got {self.ranks!r}")


def data_dir_for(p: Params, target: Path) -> Path:
    key = json.dumps(
        {
            "target": target.name,
            "prompt": p.max_prompt_tokens,
            "new": p.max_new_tokens,
            "samples": sorted(f.name for f in SAMPLES_DIR.glob("*.jsonl")),
        },
        sort_keys=True,
    )
    return harness.REPO / "runs" / "bench-train" / f"data-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# ---------------------------------------------------------------------------------------------
# Data: records of the target's greedy continuations, captured hidden states, token counts
# ---------------------------------------------------------------------------------------------


def conversations() -> list[list[dict[str, str]]]:
    """Every sample conversation (a bare prompt as one user turn; a trailing assistant turn dropped)."""
    out = []
    for f in sorted(SAMPLES_DIR.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if len(messages) > 1 and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            out.append(messages)
    return out


def prepare_data(p: Params, target: Path) -> dict[str, Any]:
    """Records, token_counts.parquet and the captured hidden states, built once into runs/bench-train/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    root = data_dir_for(p, target)
    done = root / "DONE.json"
    if done.is_file():
        return {**json.loads(done.read_text()), "root": str(root), "reused": True}
    shutil.rmtree(root, ignore_errors=True)
    layout = RunLayout(root)  # laid out as a run directory: records/, hidden/
    records = layout.records(DATASET)
    records.mkdir(parents=True)
    hf_logging.set_verbosity_error()
    saved = torch.get_num_threads()
    # One thread: this tiny model's single-token decode steps are too small to share; with two threads on a
    # busy 2-core machine every step waits for a descheduled thread (10-20x slower here).
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    rows = []
    for i, messages in enumerate(conversations()):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text)["input_ids"][: p.max_prompt_tokens]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=p.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0].tolist()
        rows.append(harness.record_row(f"c{i:04d}", out, len(prompt)))
    generate_s = time.perf_counter() - t0
    del model
    harness.write_records(rows, records, len(rows))
    count_tokens([records], layout.token_counts, len(tok))  # the records stage's counts
    t0 = time.perf_counter()
    run_capture(
        CaptureJob(
            target_path=str(target),
            datasets=[{"name": DATASET, "records_dir": str(records)}],
            out_dir=str(layout.hidden_dir),
            device="cpu",
            dtype="float32",
            shard_tokens=16384,
            launch_tokens=None,
        ),
        Dist(),
    )
    torch.set_num_threads(saved)
    lengths = [r["num_tokens"] for r in rows]
    info = {
        "records": len(rows),
        "tokens": sum(lengths),
        "loss_tokens": sum(r["num_loss_tokens"] for r in rows),
        **harness.length_summary(lengths),
        "generate_s": generate_s,
        "capture_s": time.perf_counter() - t0,
    }
    done.write_text(json.dumps(info, indent=2))
    return {**info, "root": str(root), "reused": False}


# ---------------------------------------------------------------------------------------------
# Ours: the real job under torchrun
# ---------------------------------------------------------------------------------------------


def job_dict(p: Params, target: Path, data: Path, out_dir: Path, ranks: int) -> dict[str, Any]:
    """The JOB.json, as flows/train.py writes it, with intervals that keep checkpoints and evals at the end."""
    far, layout = p.steps + 10**6, RunLayout(data)
    job = {
        "target_path": str(target),
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
        "zero_stage": p.zero_stage,  # each rank derives its DeepSpeed config from these (models/train.py)
    }
    TrainJob.model_validate(job)  # the job's own spec accepts every key and value
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
# The baseline: a plain PyTorch loop over the same draft and data
# ---------------------------------------------------------------------------------------------


def setup(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    """What models.train.run builds before its loop: data source and split, the draft (seeded), TargetHead."""
    from transformers import AutoConfig

    device = torch.device("cpu")
    target = cfg["target_path"]
    text = AutoConfig.from_pretrained(target)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    source = HiddenSource(cfg["hidden_dir"], cfg["max_batch_tokens"])
    meta = Path(cfg["hidden_dir"]) / METADATA_NAME  # as models.train._data_source: the capture's, else the default
    aux_layers = (json.loads(meta.read_text()).get("aux_layers") if meta.is_file() else None) or default_aux_layers(
        int(text.num_hidden_layers)
    )
    embed, head = load_target_tensors(target, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)))
    counts = load_token_counts(cfg["token_counts"], int(text.vocab_size))
    d2t, t2d = draft_vocab(counts, int(text.vocab_size), cfg["draft_vocab_size"])
    torch.manual_seed(cfg["seed"])  # as models.train.run: the same initial weights
    config = Eagle3Config.from_target_config(text, draft_vocab_size=int(d2t.shape[0]), aux_layers=aux_layers)
    draft = Eagle3Draft(config)
    draft.load_target_embedding(embed.to(draft.embed_tokens.weight.dtype))
    draft.set_draft_vocab(d2t, t2d)
    target_head = TargetHead(head.to(device), d2t.to(device))
    train_samples, _ = split_samples(source.samples, cfg["eval_fraction"])
    per_epoch = steps_per_epoch(
        len(epoch_batches(train_samples, cfg["max_batch_tokens"], cfg["seed"], 0)), world, cfg["grad_accum"]
    )
    return {
        "device": device,
        "source": source,
        "draft": draft,
        "target_head": target_head,
        "train_samples": train_samples,
        "per_epoch": per_epoch,
        "warmup": max(1, round(cfg["warmup_ratio"] * cfg["steps"])),
    }


def plain_optimizer(cfg: dict[str, Any], draft: Eagle3Draft, warmup: int):
    """AdamW + LambdaLR as the job's DeepSpeed config and scheduler set them up."""
    params = [q for q in draft.parameters() if q.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg["lr"], betas=BETAS, eps=EPS, weight_decay=cfg["weight_decay"])
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(cfg["steps"], warmup, 0.0))
    return params, optimizer, scheduler


def plain_loop(cfg: dict[str, Any], rank: int, world: int, barrier: Any = None) -> dict[str, Any]:
    """The job's training loop without DeepSpeed, the process group or the launcher (rank's share only)."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(cfg["threads"])
    try:
        x = setup(cfg, world)
        device, source, draft, target_head = x["device"], x["source"], x["draft"], x["target_head"]
        train_samples, per_epoch = x["train_samples"], x["per_epoch"]
        params, optimizer, scheduler = plain_optimizer(cfg, draft, x["warmup"])
        grad_accum, total, ttt = cfg["grad_accum"], cfg["steps"], cfg["ttt_steps"]
        if barrier is not None:
            barrier.wait()  # side by side: every process starts its loop together

        step = epoch = step_in_epoch = 0
        times = [time.monotonic()]  # end of step s at times[s]
        cpu = [time.process_time()]
        tokens = [0]  # cumulative real tokens after step s
        losses: dict[int, float] = {}
        running = Metrics(ttt, device)
        draft.train()
        while step < total:
            batches = epoch_batches(train_samples, cfg["max_batch_tokens"], cfg["seed"], epoch)
            while step_in_epoch < per_epoch and step < total:
                step_tokens = 0
                for micro in rank_micro_batches(batches, step_in_epoch, rank, world, grad_accum):
                    batch = source.batch(micro, device)
                    out = draft.forward_ttt(
                        batch.input_ids,
                        batch.aux_hidden,
                        target_head(batch.last_hidden),
                        batch.loss_mask,
                        batch.attention_mask,
                        ttt_steps=ttt,
                    )
                    (out.loss / grad_accum).backward()
                    running.add(out)
                    step_tokens += batch.tokens
                torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad(set_to_none=True)
                step += 1
                step_in_epoch += 1
                tokens.append(tokens[-1] + step_tokens)
                if step % cfg["log_every"] == 0 or step == total:
                    losses[step] = running.summary(STEP_DECAY)["loss"]
                    running = Metrics(ttt, device)
                times.append(time.monotonic())
                cpu.append(time.process_time())
            if step_in_epoch >= per_epoch:
                epoch += 1
                step_in_epoch = 0
        return {
            "rank": rank,
            "times": times,
            "cpu": cpu,
            "tokens": tokens,
            "losses": losses,
            "trainable_parameters": sum(q.numel() for q in params),
            "per_epoch": per_epoch,
            "train_samples": len(train_samples),
        }
    finally:
        torch.set_num_threads(saved_threads)


def baseline_worker(cfg_path: str, processes: int, out_path: str) -> None:
    """`bench/train.py --baseline-worker CFG N OUT`: the baseline's own launch (a session of its own, like a job's)."""
    cfg = json.loads(Path(cfg_path).read_text())
    if processes == 1:
        results = [plain_loop(cfg, 0, 1)]
    else:  # side by side, each over its rank's share, started together
        results, _ = harness.spawn(
            plain_loop,
            [(cfg, k, processes) for k in range(processes)],
            threads=cfg["threads"],
            timeout_s=cfg["timeout_s"],
            what="baseline",
        )
    Path(out_path).write_text(json.dumps(results))


def baseline(p: Params, processes: int, target: Path, data: Path, tmp: Path, here: bool = False) -> dict[str, Any]:
    """The plain loop: a fresh process (N: side by side, each over its rank's share), or this process (`here`).

    The fresh processes are started like a job's ranks: a child in a new session (with
    `start_new_session`, as tasks.launch_ranks.run_job starts torchrun; with N > 1 it spawns the N loops and
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
        results = [plain_loop(cfg, 0, 1)]
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


def interleaved(cfg: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """One process (1 rank): the plain step and the job's DeepSpeed step in alternation, on the same batch tensors.

    Both drafts start from the same seed and see the same batches; each step runs the plain loop's
    step and the job's (models.train.build_engine / train_forward, engine.backward / step, the per-step token
    all-reduce), alternating which goes first. Whatever else runs on the machine hits both alike, so
    the difference is the engine's per-step cost. Phases: forward (TargetHead + forward_ttt, through
    the engine for ours), backward (engine.backward: autograd + ZeRO-2 gradient hooks), the rest
    (plain: clip + AdamW + LambdaLR + zero_grad; ours: engine.step: ZeRO-2 reduction, norm, clip,
    AdamW on the flat partition, copy back, scheduler; + train(), the token all-reduce and, every
    `log_every` steps, the job's metrics line: Metrics all-reduce, grad norm, metrics.jsonl and
    TensorBoard, as rank 0 writes it).
    """
    from tasks.ports import free_port

    os.environ.update(
        DS_ACCELERATOR="cpu",
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="1",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
    )
    torch.set_num_threads(cfg["threads"])
    import deepspeed

    from models.train import build_engine, grad_norm, sum_over_ranks, train_forward
    from models.train_metrics import MetricsWriter

    deepspeed.init_distributed(dist_backend="gloo")
    dist = Dist(group=True)
    a, b = setup(cfg, 1), setup(cfg, 1)  # the same seed: the same initial weights
    device, source, train_samples, per_epoch = a["device"], a["source"], a["train_samples"], a["per_epoch"]
    params, optimizer, scheduler = plain_optimizer(cfg, a["draft"], a["warmup"])
    engine = build_engine(TrainJob.model_validate(job), b["draft"], cfg["steps"], b["warmup"])
    grad_accum, total, ttt = cfg["grad_accum"], cfg["steps"], cfg["ttt_steps"]
    running = {"plain": Metrics(ttt, device), "ours": Metrics(ttt, device)}
    losses: dict[str, dict[int, float]] = {"plain": {}, "ours": {}}
    writer = MetricsWriter(Path(job["out_dir"]), 0, enabled=True)  # metrics.jsonl + TensorBoard, as rank 0's
    window = {"tokens": 0, "start": time.monotonic()}
    a["draft"].train()

    def log_step(n: int) -> bool:
        return n % cfg["log_every"] == 0 or n == total

    def plain_step(batches, n: int) -> tuple[float, float, float]:
        fwd = bwd = 0.0
        start = time.perf_counter()
        for batch in batches:
            t0 = time.perf_counter()
            out = a["draft"].forward_ttt(
                batch.input_ids,
                batch.aux_hidden,
                a["target_head"](batch.last_hidden),
                batch.loss_mask,
                batch.attention_mask,
                ttt_steps=ttt,
            )
            t1 = time.perf_counter()
            (out.loss / grad_accum).backward()
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
            running["plain"].add(out)
        torch.nn.utils.clip_grad_norm_(params, cfg["grad_clip"])
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if log_step(n):  # a plain loop keeps its loss too
            losses["plain"][n] = running["plain"].summary(STEP_DECAY)["loss"]
            running["plain"] = Metrics(ttt, device)
        return fwd, bwd, time.perf_counter() - start - fwd - bwd

    def ours_step(batches, n: int) -> tuple[float, float, float]:
        fwd = bwd = 0.0
        start = time.perf_counter()
        engine.train()
        step_tokens = 0
        for batch in batches:
            t0 = time.perf_counter()
            out = train_forward(engine, batch, b["target_head"], ttt)
            t1 = time.perf_counter()
            engine.backward(out.loss)
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
            engine.step()
            running["ours"].add(out)
            step_tokens += batch.tokens
        sum_over_ranks(step_tokens, dist, device)
        window["tokens"] += step_tokens
        if log_step(n):  # the job's metrics line (models.train.run)
            running["ours"].all_reduce(dist)
            elapsed = max(1e-9, time.monotonic() - window["start"])
            line = {
                "kind": "train",
                "step": n,
                "epoch": 0,
                "time": time.time(),
                **running["ours"].summary(STEP_DECAY),
                "lr": engine.get_lr()[0],
                "grad_norm": grad_norm(engine),
                "tokens": 0,
                "tokens_per_s": round(sum_over_ranks(window["tokens"], dist, device) / elapsed, 2),
            }
            writer.write(line)
            losses["ours"][n] = line["loss"]
            running["ours"] = Metrics(ttt, device)
            window.update(tokens=0, start=time.monotonic())
        return fwd, bwd, time.perf_counter() - start - fwd - bwd

    phases: dict[str, list[tuple[float, float, float]]] = {"plain": [], "ours": []}
    tokens: list[int] = []
    load_s: list[float] = []
    step = epoch = step_in_epoch = 0
    while step < total:
        batches = epoch_batches(train_samples, cfg["max_batch_tokens"], cfg["seed"], epoch)
        while step_in_epoch < per_epoch and step < total:
            t0 = time.perf_counter()
            micro = [source.batch(m, device) for m in rank_micro_batches(batches, step_in_epoch, 0, 1, grad_accum)]
            load_s.append(time.perf_counter() - t0)
            order = (("plain", plain_step), ("ours", ours_step))
            for name, fn in order if step % 2 == 0 else reversed(order):
                phases[name].append(fn(micro, step + 1))
            tokens.append(sum(m.tokens for m in micro))
            step += 1
            step_in_epoch += 1
        if step_in_epoch >= per_epoch:
            epoch += 1
            step_in_epoch = 0
    writer.close()
    torch.distributed.destroy_process_group()
    return {"phases": phases, "tokens": tokens, "losses": losses, "load_s": load_s}


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
        interleaved, [(cfg, job)], threads=p.threads, timeout_s=p.timeout_s, what="interleaved run", together=False
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


# ---------------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------------


def print_report(p: Params, out: dict[str, Any]) -> None:
    s = out["setup"]
    runs = out["runs"]
    b1 = next((r for r in runs if r["kind"] == "baseline" and r.get("trainable_parameters")), None)
    print()
    print(
        f"target: tiny Llama hidden {p.hidden_size}, {p.num_layers} layers, {p.num_heads} heads / {p.num_kv_heads} kv, "
        f"intermediate {p.intermediate_size}, vocab {p.vocab_size} ({s['target']})"
    )
    print(
        f"draft: 1 layer, hidden {p.hidden_size}, draft vocab {p.draft_vocab_size}, TTT {p.ttt_steps} steps"
        + (f", {b1['trainable_parameters']:,} trainable parameters" if b1 else "")
        + "; fp32"
    )
    print(
        f"data: {s['records']} records (sample conversations cut to {p.max_prompt_tokens} tokens + greedy continuation "
        f"<= {p.max_new_tokens}): {s['tokens']:,} tokens, mean {s['mean_len']:.0f}, p50 {s['p50_len']}, "
        f"p95 {s['p95_len']}, max {s['max_len']}; {s['train_samples']} train / {s['held_out']} held out; "
        f"{s['batches_per_epoch']} micro "
        f"batches per epoch at max_batch_tokens {p.max_batch_tokens} ({s['tokens_per_batch']:,.0f} real tokens each, "
        f"{s['padding_pct']:.1f}% padding)"
    )
    print(
        f"job: ZeRO stage {p.zero_stage}, {p.steps} optimizer steps, grad_accum {p.grad_accum}, lr {p.lr:g} "
        f"(warmup {p.warmup_ratio:g}), AdamW betas {BETAS} wd {p.weight_decay:g}, clip {p.grad_clip:g}, "
        f"log every {p.log_every}; measured: steps "
        f"{p.skip + 1}-{p.steps}; {p.threads} thread(s) per rank / baseline process"
    )
    print()
    print("runs (tok/s over the measured steps, all ranks)")
    rows = []
    for r in runs:
        label = f"#{r['pass_no'] + 1} " + (
            f"ours, {r['n']} rank(s)" if r["kind"] == "ours" else f"baseline, {r['n']} process(es)"
        )
        if not r.get("tokens_per_s"):
            rows.append((label, "FAILED", "-", "-", "-", "-", "-", "-"))
            continue
        cpu = f"{r['cpu_ms_per_1k_tokens']:.0f}" if r.get("cpu_ms_per_1k_tokens") else "-"
        share = f"{r['cpu_s'] / (r['window_s'] * r['n']):.2f}" if r.get("cpu_s") else "-"
        head = (label, f"{r['tokens_per_s']:,.0f}", f"{r['window_s']:.1f}", cpu, share)
        if r["kind"] == "ours":
            rows.append(
                (
                    *head,
                    f"{r['startup_s']:.1f}",
                    f"{r['steps_s']:.1f}",
                    f"{r['tail_s']:.1f}",
                    f"{r['wall_s']:.1f}",
                    f"agent CPU {r.get('launcher_cpu_s', 0):.2f} s"
                    + (f"; built {', '.join(r['ops_built'])}" if r["ops_built"] else ""),
                )
            )
        else:
            rows.append((*head, "-", "-", "-", "-", f"median step {1e3 * r['median_step_s']:.0f} ms"))
    harness.markdown_table(
        (
            "run",
            "tok/s",
            "measured s",
            "CPU ms/1k tok",
            "CPU/wall",
            "start-up s",
            "all steps s",
            "tail s",
            "launch s",
            "notes",
        ),
        rows,
    )
    print(
        "   measured: steps after the skip; CPU: the ranks' (ours) or the processes' (baseline) over those steps;\n"
        "   CPU/wall: CPU s / (measured s x processes): 1.00 = each process had a core to itself all along.\n"
        "   start-up: launch -> TRAIN_PROGRESS step=0 (interpreter, imports, process group, data index, draft, engine);"
        "\n   all steps: -> the last step's metrics line; tail: final eval + checkpoint + export + teardown;"
        "\n   agent: the torchrun agent's CPU over the measured steps; built: torch extensions (re)built meanwhile"
    )
    print()
    multi = p.repeats > 1
    print(
        "ratios: ours tok/s / baseline tok/s of the same pass (1.00 = no overhead; < 1 = ours slower)"
        + (f"; median of {p.repeats} passes [range]" if multi else "")
    )
    rows = []
    for n, x in out["ratios"].items():
        lo, hi = x["ratio_range"]
        base = "1 process" if n == "1" else f"{n} processes side by side"
        cpu = (
            "-"
            if x["cpu_ratio"] is None
            else f"{x['cpu_ratio']:.3f}"
            + (f" [{x['cpu_ratio_range'][0]:.2f}-{x['cpu_ratio_range'][1]:.2f}]" if multi else "")
        )
        per = (
            "-"
            if x["per_rank_vs_1_process"] is None
            else (
                f"{x['per_rank_vs_1_process']:.2f}" + ("" if n == "1" else f" ({x['baseline_per_process_vs_1']:.2f})")
            )
        )
        paired = (
            "-"
            if x["paired_ratio"] is None
            else f"{x['paired_ratio']:.3f}"
            + (f" [{x['paired_ratio_range'][0]:.2f}-{x['paired_ratio_range'][1]:.2f}]" if multi else "")
        )
        rows.append(
            (
                f"{n} rank(s)",
                f"{x['ours']:,.0f}",
                base,
                f"{x['baseline']:,.0f}",
                f"{x['ratio']:.3f}" + (f" [{lo:.2f}-{hi:.2f}]" if multi else ""),
                paired,
                cpu,
                f"{s['lockstep'][n]['bound']:.3f}",
                per,
                f"{x['startup_s']:.1f} + {x['tail_s']:.1f}",
                f"{x['end_to_end_ratio']:.3f}",
            )
        )
    harness.markdown_table(
        (
            "ours",
            "tok/s",
            "baseline",
            "tok/s",
            "ours/baseline",
            "paired per step",
            "tok per CPU-s, ours/baseline",
            "lockstep bound",
            "per rank / 1-process baseline (baseline's)",
            "start-up + tail s",
            "whole launch / baseline",
        ),
        rows,
    )
    print(
        "   paired per step: median over the measured steps of baseline step time / ours (same micro batches; "
        "N ranks: the"
        "\n   slowest baseline process's step, so lockstep waiting is not counted): robust to bursts of other load"
        "\n   lockstep bound: the ratio that waiting for the slowest rank at every step alone gives "
        "(padded tokens as the cost);"
        "\n   per rank / 1-process baseline: ours' tok/s per rank over the 1-process baseline's "
        "(in brackets: the same for"
        "\n   one of the side-by-side baseline processes: what the cores give N processes); "
        "whole launch: all tokens / launch"
        "\n   wall time (start-up, warmup steps, final eval, checkpoint, export included) over the baseline's tok/s"
    )
    x = out.get("interleaved")
    if x:
        print()
        print(
            "in-process, interleaved (1 rank, one process, the same batch tensors; "
            f"steps {p.skip + 1}-{p.in_process_steps}; ms per step, mean):"
        )
        rows = [
            (
                name,
                f"{x[key]['forward_ms']:.1f}",
                f"{x[key]['backward_ms']:.1f}",
                f"{x[key]['rest_ms']:.1f}",
                f"{x[key]['step_ms']:.1f}",
                f"{x[key]['tokens_per_s']:,.0f}",
            )
            for name, key in (("plain PyTorch step", "plain"), ("our step: DeepSpeed engine + job loop body", "ours"))
        ]
        harness.markdown_table(("step", "forward ms", "backward ms", "rest ms", "step ms", "tok/s"), rows)
        print(
            f"   ours/plain tok/s {x['ratio']:.3f}; per step, ours - plain: median {x['extra_ms_per_step']:+.1f} ms, "
            f"mean {x['extra_ms_per_step_mean']:+.1f} ms; ours/plain step time, median {x['step_ratio_median']:.3f};"
            f"\n   losses differ by at most {x['loss_max_rel_diff']:.1e} (relative); "
            "loading a step's batch (HiddenSource.batch,"
            f" in both loops, not timed above): {x['load_ms']:.1f} ms\n"
            "   rest: plain = clip + AdamW + LambdaLR + zero_grad; ours = engine.step (ZeRO-2 reduce, norm, clip, "
            "AdamW on"
            f" the\n   flat partition, copy back, scheduler) + engine.train() + the per-step token all-reduce + every "
            f"{p.log_every} step(s)\n   the job's metrics line (all-reduces, grad norm, metrics.jsonl, TensorBoard)"
        )
    one = out["ratios"].get("1")
    if one and one.get("loss_max_rel_diff") is not None:
        a, b = one["loss_first_last"]
        print(
            f"   1 rank, same arithmetic: the logged losses of ours and the baseline differ by at most "
            f"{one['loss_max_rel_diff']:.1e} (relative; loss {a:.3f} at step {p.log_every} -> {b:.3f} "
            f"at step {p.steps})"
        )


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
        baseline_worker(cfg_path, int(n), out_path)
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
        lambda out: print_report(p, out),
        kept=kept,
    )


if __name__ == "__main__":
    sys.exit(main())
