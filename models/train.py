"""Training rank entry point: the EAGLE-3 draft under DeepSpeed ZeRO-2, with the training-time test.

    torchrun --nproc_per_node N -m models.train --job JOB.json     (CPU: gloo, DS_ACCELERATOR=cpu)
    deepspeed --num_gpus N --module models.train --job JOB.json    (GPU: NCCL, bf16)

Every rank holds the whole (small) draft; ZeRO-2 partitions its gradients and optimizer state.
Data: the captured hidden states (`mode: offline`) or, for a target that fits every device,
the records with the target run inside the job (`mode: online`, nothing written to disk).
The held-out split (models/train_data.py) is never trained on; its TTT metrics are the eval.

Files under `out_dir` (RUN_DIR/draft):
    checkpoints/step-NNNNNNNN/   DeepSpeed checkpoint (model, optimizer, scheduler) + client state
                                 (epoch, step, tokens) + rng-rank-R.pt per rank + fingerprint.json
                                 + COMPLETE marker
    checkpoints/latest           tag of the newest COMPLETE checkpoint (written atomically, last)
    metrics.jsonl                one line per log interval ("train") and per eval ("eval")
    tensorboard/                 the same scalars as TensorBoard events
    final/                       config.json + model.safetensors for SGLang (models/eagle3_export.py)
    train_summary.json           the final eval and where the draft is

A relaunch resumes from the newest complete checkpoint (model, optimizer and scheduler states, the
data position and every rank's RNG) and drops metrics lines past that step; a kill loses at most the
steps since the last checkpoint.

It resumes only a checkpoint of the same run: fingerprint.json holds digests of the training data
(offline: the captured samples' (dataset, id, length) and the capture's target and layers; online:
the records' ids and lengths), of the draft vocabulary, and the settings that shape the optimisation
(draft shape, TTT steps, learning rate and schedule, batch tokens, grad accumulation, world size,
precision, seed, held-out fraction). A launch whose fingerprint differs stops before it trains or
touches a file (`CheckpointMismatch`, naming what differs). The total number of steps (from epochs
or max_steps) is part of it: the cosine schedule is laid out over that total, so a longer run is a
new run. log_every, checkpoint_every, keep_checkpoints and eval_every may change between launches.
Checkpoints from before fingerprints resume with a warning.

A failed write (disk full, read-only, quota) stops the job at once with `WriteFailed`: a checkpoint
counts only once its COMPLETE marker is renamed into place, so the last complete one is never
replaced by a partial one.

Output protocol for the flow (models/rank_protocol.py): `TRAIN_PROGRESS step=S total=N ...`,
`TRAIN_EVAL step=S acceptance_length=A`, `TRAIN_CHECKPOINT step=S`, `TRAIN_DONE final=DIR`, and on
failure one line `TRAIN_ERROR {json}` before the exit with status 1 (the rank harness, models/rank.py).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import random
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.atomic import fsync_tree, write_atomic
from models.capture import capture_batch, load_records
from models.draft_vocab import draft_vocab, draft_vocab_coverage, load_token_counts
from models.eagle3 import STEP_DECAY, Eagle3Config, Eagle3Draft, TargetHead, acceptance_length, default_aux_layers
from models.eagle3_export import export_draft
from models.jobs import TrainJob
from models.rank import Dist, check_shared_dir, init_process_group, log, say, serve
from models.hidden_shards import METADATA_NAME
from models.rank_protocol import TRAIN, TRAIN_CHECKPOINT, TRAIN_DONE, TRAIN_EVAL, TRAIN_PROGRESS
from models.run_layout import CHECKPOINTS, DS_CONFIG, FINAL, METRICS, TENSORBOARD, TRAIN_SUMMARY
from models.target_weights import load_target_tensors
from models.train_data import (Batch, HiddenSource, TrainSample, data_fingerprint, epoch_batches, eval_share,
                               pad_batch, rank_micro_batches, split_samples, steps_per_epoch)
from models.file_errors import WriteFailed, existing_parent, is_write_error

COMPLETE = "COMPLETE"
LATEST = "latest"
FINGERPRINT = "fingerprint.json"
ERROR_MARK = TRAIN.error.mark
PROGRESS_EVERY_S = 2.0
RESUME = ("make room there (or set train.out_dir to a disk with room), then run the train stage again: "
          "it resumes from the kept checkpoint")


class CheckpointMismatch(ValueError):
    """The checkpoint to resume was trained on other data or with other settings than this launch."""


def ds_train_config(*, world_size: int, grad_accum: int, lr: float, weight_decay: float, betas: tuple[float, float],
                    grad_clip: float, bf16: bool, torch_adam: bool, eps: float = 1e-8) -> dict[str, Any]:
    """The DeepSpeed config of a draft training job: ZeRO-2, AdamW, clipping, bf16 on GPUs."""
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # one token-budget batch (models/train_data.py)
        "gradient_accumulation_steps": grad_accum,
        "train_batch_size": world_size * grad_accum,
        "gradient_clipping": grad_clip,
        "zero_optimization": {"stage": 2, "overlap_comm": False, "contiguous_gradients": True},
        "optimizer": {"type": "AdamW", "params": {"lr": lr, "betas": list(betas), "eps": eps,
                                                  "weight_decay": weight_decay, "torch_adam": torch_adam}},
        "steps_per_print": 10**9,  # our own logging
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


def check_world_size(job: TrainJob, dist: Dist) -> None:
    """Refuse a job built for another world size: DeepSpeed needs train_batch_size = world size x grad_accum x micro."""
    per_rank = job.grad_accum * int(job.ds_config.get("train_micro_batch_size_per_gpu", 1))
    if job.ds_config.get("train_batch_size") != dist.world_size * per_rank:
        raise ValueError(f"the job's train_batch_size {job.ds_config.get('train_batch_size')} is for "
                         f"{job.ds_config.get('train_batch_size', 0) // per_rank} rank(s), but this launch has "
                         f"{dist.world_size} (train_batch_size must be world size x grad_accum = {dist.world_size * per_rank}): "
                         "the job was built for another distributed.nnodes x train.num_gpus; run the train stage, which "
                         "writes the job for its launch, or launch as many ranks as the job was built for")


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    """Linear warmup to 1 over `warmup_steps`, then cosine down to `min_ratio` at `total_steps`."""
    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))
    return f


class Metrics:
    """Sums of TTT counts over batches (and ranks), turned into losses, accuracies and acceptance."""

    def __init__(self, steps: int, device: torch.device):
        self.v = torch.zeros(6, steps, dtype=torch.float64, device=device)  # loss*valid, tokens, valid, correct, reached, accepted

    def add(self, out) -> None:
        self.v += torch.stack([out.per_step_loss.double() * out.valid, out.tokens, out.valid, out.correct,
                               out.chain_reached, out.chain_accepted]).double().to(self.v.device)

    def all_reduce(self, dist: Dist) -> None:
        if dist.group:
            torch.distributed.all_reduce(self.v)

    def summary(self, decay: float) -> dict[str, Any]:
        loss_sum, tokens, valid, correct, reached, accepted = self.v.cpu()
        per_step_loss = (loss_sum / valid.clamp(min=1)).tolist()
        weights = decay ** torch.arange(len(per_step_loss), dtype=torch.float64)
        return {
            "loss": float((weights * torch.tensor(per_step_loss)).sum()),
            "per_step_loss": [round(x, 6) for x in per_step_loss],
            "per_step_acc": [round(x, 6) for x in (correct / tokens.clamp(min=1)).tolist()],
            "per_step_cond_acc": [round(x, 6) for x in (accepted / reached.clamp(min=1)).tolist()],
            "acceptance_length": round(float(acceptance_length(accepted, reached)), 6),
            "tokens": int(tokens[0]),
        }


@dataclass
class Position:
    """Where training stands: saved in every checkpoint's client state."""

    step: int = 0            # optimizer steps done in total
    epoch: int = 0
    step_in_epoch: int = 0   # optimizer steps done in `epoch`
    tokens: int = 0          # real (unpadded) tokens trained on, all ranks


def run(job: TrainJob, dist: Dist) -> dict[str, Any]:
    """Train (or resume) on this rank; rank 0 exports the draft at the end. Returns the final eval."""
    from transformers import AutoConfig

    out_dir = Path(job.out_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    device = dist.device(job.device)
    init_process_group(dist, job.device, deepspeed=True)  # DeepSpeed even for one process
    check_world_size(job, dist)
    check_shared_dir(dist, out_dir)  # ranks on several nodes: one checkpoint directory for all

    # --- the draft and its frozen target pieces
    target_config = AutoConfig.from_pretrained(job.target_path, trust_remote_code=job.trust_remote_code)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    source, aux_layers = _data_source(job, text, device)
    embed, head = load_target_tensors(job.target_path, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)))
    counts = load_token_counts(job.token_counts, int(text.vocab_size))
    d2t, t2d = draft_vocab(counts, int(text.vocab_size), job.draft_vocab_size)
    torch.manual_seed(job.seed)  # identical initial weights on every rank
    config = Eagle3Config.from_target_config(text, draft_vocab_size=int(d2t.shape[0]), aux_layers=aux_layers, **job.draft_overrides)
    draft = Eagle3Draft(config)
    draft.load_target_embedding(embed.to(draft.embed_tokens.weight.dtype))
    draft.set_draft_vocab(d2t, t2d)
    target_head = TargetHead(head.to(device), d2t.to(device))
    del embed, head

    # --- data, schedule, engine
    train_samples, eval_samples = split_samples(source.samples, job.eval_fraction)
    if not train_samples:
        raise ValueError("no training samples (all held out or none captured)")
    per_epoch = steps_per_epoch(len(epoch_batches(train_samples, job.max_batch_tokens, job.seed, 0)), dist.world_size, job.grad_accum)
    total_steps = per_epoch * job.epochs if job.max_steps is None else job.max_steps
    warmup = max(1, round(job.warmup_ratio * total_steps))
    fingerprint = run_fingerprint(job, source.fingerprint, d2t, config, dist.world_size, total_steps)
    check_fingerprint(ckpt_dir, fingerprint, warn=dist.rank == 0)  # before anything is trained or removed
    if dist.rank == 0:  # the DeepSpeed config as run, next to the checkpoints
        with writing(out_dir / DS_CONFIG, ckpt_dir):
            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(out_dir / DS_CONFIG, json.dumps(job.ds_config, indent=2))
    engine = build_engine(job, draft, total_steps, warmup)
    if dist.rank == 0:
        log(f"train: {len(train_samples)} training samples ({sum(s.length for s in train_samples):,} tokens), "
            f"{len(eval_samples)} held out, {per_epoch} steps/epoch over {dist.world_size} rank(s) x {job.grad_accum} "
            f"micro batches, {total_steps} steps; draft vocab {config.draft_vocab_size} of {config.vocab_size} "
            f"(covers {draft_vocab_coverage(counts, t2d):.1%} of loss tokens); mode {job.mode}, "
            f"{'bf16' if job.bf16 else 'fp32'}, ZeRO-2" + (f"; {source.cut} samples cut to {job.max_batch_tokens} tokens" if source.cut else ""))

    position = _resume(engine, ckpt_dir, dist)
    writer = MetricsWriter(out_dir, position.step, enabled=dist.rank == 0)

    # --- the loop
    eval_batches = epoch_batches(eval_samples, job.max_batch_tokens, job.seed, 0) if eval_samples else []
    running = Metrics(job.ttt_steps, device)
    last_report, window_start, window_tokens = 0.0, time.monotonic(), 0
    last_eval: dict[str, Any] | None = None
    tell = say if dist.rank == 0 else (lambda line: None)  # the protocol lines come from rank 0 only
    tell(TRAIN_PROGRESS.format(step=position.step, total=total_steps, tokens=position.tokens))
    while position.step < total_steps:
        batches = epoch_batches(train_samples, job.max_batch_tokens, job.seed, position.epoch)
        while position.step_in_epoch < per_epoch and position.step < total_steps:
            engine.train()
            step_tokens = 0
            for micro in rank_micro_batches(batches, position.step_in_epoch, dist.rank, dist.world_size, job.grad_accum):
                batch = source.batch(micro, device)
                out = train_forward(engine, batch, target_head, job.ttt_steps)
                engine.backward(out.loss)
                engine.step()
                running.add(out)
                step_tokens += batch.tokens
            position.step += 1
            position.step_in_epoch += 1
            position.tokens += sum_over_ranks(step_tokens, dist, device)
            window_tokens += step_tokens

            if position.step % job.log_every == 0 or position.step == total_steps:
                running.all_reduce(dist)
                elapsed = max(1e-9, time.monotonic() - window_start)
                tokens_per_s = sum_over_ranks(window_tokens, dist, device) / elapsed
                line = {"kind": "train", "step": position.step, "epoch": position.epoch, "time": time.time(),
                        **running.summary(STEP_DECAY), "lr": engine.get_lr()[0],
                        "grad_norm": grad_norm(engine), "tokens": position.tokens, "tokens_per_s": round(tokens_per_s, 2)}
                writer.write(line)
                running = Metrics(job.ttt_steps, device)
                window_start, window_tokens = time.monotonic(), 0
            if time.monotonic() - last_report >= PROGRESS_EVERY_S or position.step == total_steps:
                last_report = time.monotonic()
                tell(TRAIN_PROGRESS.format(step=position.step, total=total_steps, tokens=position.tokens,
                                           loss=out.loss.item(), lr=engine.get_lr()[0]))
            if eval_batches and (position.step % job.eval_every == 0 or position.step == total_steps):
                last_eval = _evaluate(engine, source, eval_batches, target_head, job, dist, device)
                writer.write({"kind": "eval", "step": position.step, "epoch": position.epoch, "time": time.time(), **last_eval})
                tell(TRAIN_EVAL.format(step=position.step, acceptance_length=last_eval["acceptance_length"],
                                       loss=last_eval["loss"]))
            if position.step % job.checkpoint_every == 0 or position.step == total_steps:
                _save(engine, ckpt_dir, position, job.keep_checkpoints, dist, fingerprint)
                tell(TRAIN_CHECKPOINT.format(step=position.step))
        if position.step_in_epoch >= per_epoch:
            position.epoch += 1
            position.step_in_epoch = 0
    writer.close()

    # --- export (every rank holds the whole model under ZeRO-2; rank 0 writes)
    final = out_dir / FINAL
    if last_eval is None:  # a relaunch of a finished run: its last eval is in the metrics
        last_eval = _last_eval(writer.path)
    summary = {"final": str(final), "steps": position.step, "tokens": position.tokens, "eval": last_eval,
               "draft_vocab_size": config.draft_vocab_size, "aux_layers": aux_layers}
    if dist.rank == 0:
        # export_draft replaces final/ only once the new export is complete; a relaunch exports again
        with writing(final, ckpt_dir, also="the previous export in final/, if any, is unchanged"):
            export_draft(engine.module, final, target_config=target_config,
                         dtype=torch.bfloat16 if job.bf16 else torch.float32)
        with writing(out_dir / TRAIN_SUMMARY, ckpt_dir):
            write_atomic(out_dir / TRAIN_SUMMARY, json.dumps(summary, indent=2))
        say(TRAIN_DONE.format(final=final))
    dist.barrier()
    return summary


def train_forward(model, batch: Batch, target_head: TargetHead, ttt_steps: int):
    return model(*_ttt_args(batch, target_head), ttt_steps=ttt_steps)


class _TTT(torch.nn.Module):
    """The draft with `forward` = `forward_ttt`, the method DeepSpeed's engine calls."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, *args, **kwargs):
        return self.draft.forward_ttt(*args, **kwargs)


def build_engine(job: TrainJob, draft: Eagle3Draft, total_steps: int, warmup: int):
    import deepspeed

    wrapped = _TTT(draft)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    schedule = lr_lambda(total_steps, warmup, job.min_lr_ratio)
    engine, *_ = deepspeed.initialize(
        model=wrapped, model_parameters=params, config=job.ds_config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
    )
    return _EngineView(engine)


class _EngineView:
    """The DeepSpeed engine, with `module` meaning the draft itself (for export) and the TTT call as `__call__`."""

    def __init__(self, engine):
        self.engine = engine

    def __getattr__(self, name):
        return getattr(self.engine, name)

    @property
    def module(self) -> Eagle3Draft:
        return self.engine.module.draft

    def __call__(self, *args, **kwargs):
        return self.engine(*args, **kwargs)


@torch.no_grad()
def _evaluate(engine, source, eval_batches: list[list[TrainSample]], target_head: TargetHead, job: TrainJob,
              dist: Dist, device: torch.device) -> dict[str, Any]:
    """TTT metrics over the held-out samples, summed over ranks (every rank evaluates a share)."""
    engine.eval()
    metrics = Metrics(job.ttt_steps, device)
    for samples in eval_share(eval_batches, dist.rank, dist.world_size):
        batch = source.batch(samples, device)
        metrics.add(engine.module.forward_ttt(*_ttt_args(batch, target_head), ttt_steps=job.ttt_steps))
    metrics.all_reduce(dist)
    engine.train()
    return metrics.summary(STEP_DECAY)


def _ttt_args(batch: Batch, target_head: TargetHead) -> tuple:
    return (batch.input_ids, batch.aux_hidden, target_head(batch.last_hidden), batch.loss_mask, batch.attention_mask)


def _last_eval(metrics_path: Path) -> dict[str, Any] | None:
    """The last eval line of metrics.jsonl (without kind/step/epoch/time), or None."""
    last = None
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("kind") == "eval":
                last = {k: v for k, v in row.items() if k not in ("kind", "step", "epoch", "time")}
    return last


def grad_norm(engine) -> float | None:
    norm = engine.get_global_grad_norm()
    if norm is None:
        return None
    norm = float(norm)
    return round(norm, 6) if math.isfinite(norm) else None


def sum_over_ranks(value: int, dist: Dist, device: torch.device) -> int:
    if not dist.group:
        return int(value)
    t = torch.tensor([value], dtype=torch.int64, device=device)
    torch.distributed.all_reduce(t)
    return int(t.item())


# --- data sources -----------------------------------------------------------------------------------


def _data_source(job: TrainJob, text_config, device: torch.device):
    """(source, aux_layers): captured shards (offline) or the target itself over the records (online)."""
    if job.mode == "offline":
        meta_path = Path(job.hidden_dir) / METADATA_NAME
        captured = json.loads(meta_path.read_text()).get("aux_layers") if meta_path.is_file() else None
        aux_layers = list(job.aux_layers or captured or default_aux_layers(int(text_config.num_hidden_layers)))
        if captured and list(captured) != aux_layers:
            raise ValueError(f"{job.hidden_dir} holds aux layers {captured}, the job asks for {aux_layers}")
        return HiddenSource(job.hidden_dir, job.max_batch_tokens), aux_layers
    aux_layers = list(job.aux_layers or default_aux_layers(int(text_config.num_hidden_layers)))
    return OnlineSource(job, aux_layers, int(text_config.vocab_size), device), aux_layers


class OnlineSource:
    """Samples from the records; hidden states computed by the target on this rank, per batch."""

    def __init__(self, job: TrainJob, aux_layers: list[int], vocab_size: int, device: torch.device):
        from transformers import AutoModelForCausalLM

        from models.capture import resolve_dtype

        records, self.parts, _ = load_records(job.datasets, vocab_size)
        self.max_len = job.max_batch_tokens
        self.cut = sum(1 for s in records if s.length > self.max_len)
        self.samples = [TrainSample(s.dataset, s.id, min(s.length, self.max_len), (s.part, s.start)) for s in records]
        if not self.samples:
            raise ValueError("no records with loss tokens to train on")
        self.fingerprint = data_fingerprint(((s.dataset, s.id, s.length) for s in records),
                                            {"mode": "online", "target": job.target_path})
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(job.target_path, trust_remote_code=job.trust_remote_code)
        dtype = torch.bfloat16 if job.bf16 else resolve_dtype("auto", cfg)
        self.model = AutoModelForCausalLM.from_pretrained(job.target_path, dtype=dtype, trust_remote_code=job.trust_remote_code)
        self.model = self.model.to(device).eval().requires_grad_(False)
        self.num_layers = len(self.model.model.layers) if hasattr(self.model, "model") and hasattr(self.model.model, "layers") \
            else int(cfg.get_text_config().num_hidden_layers)
        self.aux_layers = aux_layers
        self.pad_id = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0

    @torch.no_grad()
    def batch(self, samples: list[TrainSample], device: torch.device) -> Batch:
        from models.capture import Sample

        as_capture = [Sample(s.dataset, s.id, s.ref[0], s.ref[1], s.length) for s in samples]
        rows = []
        for s, aux, last in capture_batch(self.model, as_capture, self.parts, self.aux_layers, self.num_layers,
                                          self.pad_id, device, {"output_hidden_states": True, "use_cache": False}):
            part = self.parts[s.part]
            ids = torch.from_numpy(part.input_ids[s.start : s.start + s.length].astype(np.int64))
            mask = torch.from_numpy(part.loss_mask[s.start : s.start + s.length].copy())
            rows.append((ids, mask, aux, last))
        return pad_batch(rows, max(s.length for s in samples), device)


# --- checkpoints ------------------------------------------------------------------------------------


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint with its COMPLETE marker, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.startswith("step-") and (p / COMPLETE).is_file():
            found.append((int(p.name.removeprefix("step-")), p.name))
    return sorted(found)


def _save(engine, ckpt_dir: Path, position: Position, keep: int, dist: Dist, fingerprint: dict[str, Any]) -> None:
    """Save a checkpoint; it counts only once COMPLETE is renamed into place (rank 0, after every rank).

    A failed write raises WriteFailed before COMPLETE exists: the partial tag is ignored (and removed
    by the next launch), the older complete ones are untouched (pruning runs only after success).
    """
    tag = f"step-{position.step:08d}"
    with writing(ckpt_dir / tag, ckpt_dir):
        engine.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"position": asdict(position)}, save_latest=False)
        rng = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
               "cuda": torch.cuda.get_rng_state() if torch.cuda.is_available() and engine.device.type == "cuda" else None}
        torch.save(rng, ckpt_dir / tag / f"rng-rank-{dist.rank}.pt")
    dist.barrier()  # every rank's files are on disk
    if dist.rank == 0:
        with writing(ckpt_dir / tag, ckpt_dir):
            (ckpt_dir / tag / FINGERPRINT).write_text(json.dumps(fingerprint, indent=1))
            fsync_tree(ckpt_dir / tag)
            # Renamed, not written in place: a marker cut short by a full disk must not exist at all.
            write_atomic(ckpt_dir / tag / COMPLETE, json.dumps(asdict(position)))
        with writing(ckpt_dir / LATEST, ckpt_dir):
            write_atomic(ckpt_dir / LATEST, tag)
        for _, old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    dist.barrier()


def kept_checkpoint(ckpt_dir: Path) -> str:
    """What a stopped run keeps, in words: its newest complete checkpoint, or that it has none."""
    done = complete_checkpoints(ckpt_dir)
    if not done:
        return f"no complete checkpoint in {ckpt_dir} yet (the next launch starts from step 0)"
    step, tag = done[-1]
    return f"checkpoint {tag} (complete, step {step:,}) in {ckpt_dir}"


@contextmanager
def writing(path: Path, ckpt_dir: Path, also: str = "") -> Iterator[None]:
    """Turn a failed write under `path` into WriteFailed, naming the kept checkpoint and how to resume.

    torch.save and safetensors report a full disk as RuntimeError/SafetensorError text without an
    errno: for those, a small probe write where the failed one went tells whether the storage refused.
    """
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:  # noqa: BLE001 - only storage errors are translated, the rest re-raised
        cause = e if is_write_error(e) else None if isinstance(e, OSError) else _probe_write(path)
        if cause is None:
            raise
        # The file inside a checkpoint that failed tells more than its directory; a temp name beside `path` less.
        named = Path(e.filename) if isinstance(e, OSError) and e.filename else None
        where = named if named is not None and named.is_relative_to(path) else path
        kept = kept_checkpoint(ckpt_dir) + (f"; {also}" if also else "")
        raise WriteFailed(where, cause, kept=kept, resume=RESUME) from None


def _probe_write(path: Path, size: int = 1 << 20) -> OSError | None:
    """The OSError that writing (and syncing) `size` bytes beside `path` raises now, or None if it works."""
    probe = existing_parent(path.parent if not path.is_dir() else path) / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(size))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e if is_write_error(e) else None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def run_fingerprint(job: TrainJob, data: dict[str, Any], d2t: torch.Tensor, config: Eagle3Config, world_size: int,
                    total_steps: int) -> dict[str, Any]:
    """What makes a checkpoint this run's: data, draft vocabulary and the settings that shape the optimisation.

    Not in it, on purpose: log_every, checkpoint_every, keep_checkpoints, eval_every (how the run is
    watched and saved) and where files live. `total_steps` stands for epochs/max_steps: the cosine
    schedule is laid out over it, so extending a run would change the learning rate of every step left.
    """
    settings = {**optimisation_settings(job, world_size), "total_steps": total_steps,
                **{f"draft.{k}": v for k, v in asdict(config).items()}}
    ids = d2t.to(torch.int64).cpu().numpy().tobytes()
    vocab = {"digest": hashlib.sha256(ids).hexdigest(), "size": int(d2t.shape[0]), "token_counts": job.token_counts}
    return {"version": 1, "data": data, "vocab": vocab, "settings": settings}


def optimisation_settings(job: TrainJob, world_size: int) -> dict[str, Any]:
    """The fingerprint's settings that the job alone decides (no data, target or schedule length): what
    `eagle3 doctor` compares with a checkpoint before anything is launched."""
    optimizer = job.ds_config.get("optimizer", {}).get("params", {})
    return {
        "mode": job.mode, "ttt_steps": job.ttt_steps, "max_batch_tokens": job.max_batch_tokens,
        "lr": job.lr, "warmup_ratio": job.warmup_ratio, "min_lr_ratio": job.min_lr_ratio,
        "weight_decay": optimizer.get("weight_decay"), "betas": optimizer.get("betas"),
        "grad_clip": job.ds_config.get("gradient_clipping"), "grad_accum": job.grad_accum, "world_size": world_size,
        "bf16": job.bf16, "seed": job.seed, "eval_fraction": job.eval_fraction,
    }


def fingerprint_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's fingerprint and this launch's, as `name old -> new` phrases."""
    out = []
    old_data, new_data = old.get("data", {}), new["data"]
    if old_data.get("digest") != new_data["digest"]:
        changed = [f"{k} {_show(old_data.get(k))} -> {_show(new_data.get(k))}"
                   for k in sorted(set(old_data) | set(new_data)) if k != "digest" and old_data.get(k) != new_data.get(k)]
        out.append("data: " + (", ".join(changed) if changed else "same number of samples and tokens, other ids or lengths"))
    if old.get("vocab", {}).get("digest") != new["vocab"]["digest"]:
        out.append(f"draft vocabulary: other tokens (from {new['vocab']['token_counts']})")
    changed = settings_differences(old.get("settings", {}), new["settings"])
    if changed:
        out.append("settings: " + ", ".join(changed))
    return out


def settings_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`name old -> new` for each setting that differs between two fingerprints' settings."""
    return [f"{_SETTING_NAMES.get(k, k)} {_show(old.get(k))} -> {_show(new.get(k))}"
            for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)]


_SETTING_NAMES = {"total_steps": "total steps (epochs/max_steps; the cosine schedule spans them)",
                  "world_size": "world size (train.num_gpus)"}


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def check_fingerprint(ckpt_dir: Path, fingerprint: dict[str, Any], *, warn: bool) -> None:
    """Refuse (CheckpointMismatch) to resume a checkpoint of other data or settings; reads only.

    A checkpoint written before fingerprints existed is resumed, with a warning.
    """
    done = complete_checkpoints(ckpt_dir)
    if not done:
        return
    _, tag = done[-1]
    path = ckpt_dir / tag / FINGERPRINT
    if not path.is_file():
        if warn:
            log(f"train: warning: checkpoint {tag} has no {FINGERPRINT} (written before fingerprints): resuming "
                "without checking that its data and settings are this launch's")
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointMismatch(f"{path}: cannot read the checkpoint's fingerprint ({e}); move {ckpt_dir} aside "
                                 "to start fresh") from None
    differences = fingerprint_differences(old, fingerprint)
    if differences:
        raise CheckpointMismatch(
            f"cannot resume {ckpt_dir / tag}: it was trained on other data or settings than this launch's "
            f"({'; '.join(differences)}). Nothing was trained or removed. To start fresh, set train.out_dir to a "
            f"new directory or move {ckpt_dir} aside; to continue that checkpoint, restore its data and settings")


def _resume(engine, ckpt_dir: Path, dist: Dist) -> Position:
    """Load the newest complete checkpoint, if any; drop incomplete ones (a kill during a save)."""
    done = complete_checkpoints(ckpt_dir)
    dist.barrier()  # everyone listed before rank 0 cleans up
    if dist.rank == 0 and ckpt_dir.is_dir():
        keep = {tag for _, tag in done}
        for p in ckpt_dir.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name not in keep:
                log(f"train: removing incomplete checkpoint {p.name}")
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    if not done:
        return Position()
    step, tag = done[-1]
    _, client = engine.load_checkpoint(str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True)
    position = Position(**client["position"])
    rng_path = ckpt_dir / tag / f"rng-rank-{dist.rank}.pt"
    if rng_path.is_file():  # a different world size than the saved run: fresh RNG for the new ranks
        rng = torch.load(rng_path, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if dist.rank == 0:
        log(f"train: resuming from checkpoint {tag} (step {position.step}, epoch {position.epoch}, "
            f"{position.tokens:,} tokens trained)")
    return position


class MetricsWriter:
    """metrics.jsonl and TensorBoard scalars (rank 0); lines past the resumed step are dropped first."""

    def __init__(self, out_dir: Path, resumed_step: int, enabled: bool):
        self.enabled = enabled
        self.path = out_dir / METRICS
        self.ckpt_dir = out_dir / CHECKPOINTS
        self.tb = None
        if not enabled:
            return
        with writing(self.path, self.ckpt_dir):
            out_dir.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                kept = []
                for line in self.path.read_text().splitlines():
                    try:
                        if json.loads(line)["step"] <= resumed_step:
                            kept.append(line)
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut by a kill (or a full disk)
                write_atomic(self.path, "".join(k + "\n" for k in kept))
            self.file = open(self.path, "a")
        with writing(out_dir / TENSORBOARD, self.ckpt_dir):
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / TENSORBOARD), purge_step=resumed_step + 1 if resumed_step else None)
            except ImportError:
                log("train: tensorboard is not installed; metrics go to metrics.jsonl only")

    def write(self, line: dict[str, Any]) -> None:
        """Append one line (and its scalars); a line cut by a failed write is dropped on resume."""
        if not self.enabled:
            return
        with writing(self.path, self.ckpt_dir):
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        if self.tb is not None:
            with writing(self.path.parent / TENSORBOARD, self.ckpt_dir):
                kind, step = line["kind"], line["step"]
                for key in ("loss", "acceptance_length", "lr", "grad_norm", "tokens_per_s"):
                    if isinstance(line.get(key), (int, float)):
                        self.tb.add_scalar(f"{kind}/{key}", line[key], step)
                for k, acc in enumerate(line.get("per_step_acc", [])):
                    self.tb.add_scalar(f"{kind}/acc_{k}", acc, step)
                self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()


# --- process ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The training rank's entry point (models/rank.py): run the job, report a failure; the exit status."""
    # Every rank reads the same checkpoint and data: one refusal is enough, from rank 0.
    return serve(argv, prog="python -m models.train", description=__doc__.splitlines()[0], protocol=TRAIN,
                 run=lambda job_path, dist: run(TrainJob.load(job_path), dist),
                 told=(CheckpointMismatch,), once=(CheckpointMismatch,))


if __name__ == "__main__":
    sys.exit(main())
