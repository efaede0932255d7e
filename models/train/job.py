"""Training rank entry point: the EAGLE-3 draft under DeepSpeed ZeRO-2, with the training-time test.

    torchrun --nproc_per_node N -m models.train --job JOB.json     (CPU: gloo, DS_ACCELERATOR=cpu)
    deepspeed --num_gpus N --module models.train --job JOB.json    (GPU: NCCL, bf16)

Every rank holds the whole (small) draft; ZeRO-2 partitions its gradients and optimizer state.
Data: the captured hidden states (`mode: offline`) or, for a target that fits every device,
the records with the target run inside the job (`mode: online`, nothing written to disk).
The held-out split (models/train/data.py) is never trained on; its TTT metrics are the eval.

Checkpoints, fingerprint and resume: models/train/checkpoint.py; metrics.jsonl and TensorBoard:
models/train/metrics.py; the DeepSpeed config, the learning-rate schedule and the engine:
models/train/optimizer.py. Files under `out_dir` (RUN_DIR/draft):
    checkpoints/step-NNNNNNNN/   DeepSpeed checkpoint (model, optimizer, scheduler) + client state
                                 (epoch, step, tokens) + rng-rank-R.pt per rank + fingerprint.json
                                 + COMPLETE marker
    checkpoints/latest           tag of the newest COMPLETE checkpoint (written atomically, last)
    metrics.jsonl                one line per log interval ("train") and per eval ("eval")
    tensorboard/                 the same scalars as TensorBoard events
    final/                       config.json + model.safetensors for SGLang (models/export/eagle3.py): the last step
    best/                        the same export of the best held-out eval's draft, + best.json (models/train/best.py)
    train_summary.json           the final eval, the best one, and where each draft is

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

Output protocol for the flow (models/common/rank_protocol.py): `TRAIN_PROGRESS step=S total=N ...`,
`TRAIN_EVAL step=S acceptance_length=A`, `TRAIN_CHECKPOINT step=S`, `TRAIN_BEST step=S acceptance_length=A dir=DIR`
(a new best held-out eval, exported), `TRAIN_DONE final=DIR`, and on
failure one line `TRAIN_ERROR {json}` before the exit with status 1 (the rank harness, models/ranks/harness.py).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.capture.job import capture_batch
from models.capture.records import load_records
from models.capture.shards import METADATA_NAME
from models.common.atomic import write_atomic
from models.common.job_files import TrainJobFile
from models.common.rank_protocol import TRAIN, TRAIN_BEST, TRAIN_CHECKPOINT, TRAIN_DONE, TRAIN_EVAL, TRAIN_PROGRESS
from models.draft.config import DRAFT_VARIANTS, Eagle3Config, default_aux_layers
from models.draft.eagle3 import Eagle3Draft
from models.draft.target_head import TargetHead
from models.draft.vocab import draft_to_target_ids, draft_vocab, draft_vocab_coverage, load_token_counts
from models.export.eagle3 import export_draft
from models.ranks.harness import Dist, check_shared_dir, init_process_group, log, say, serve
from models.target.loader import load_language_model
from models.target.weights import load_target_tensors
from models.train.best import BestDraft
from models.train.checkpoint import (
    CheckpointMismatch,
    check_fingerprint,
    resume_checkpoint,
    run_fingerprint,
    save_checkpoint,
    writing,
)
from models.train.data import (
    Batch,
    HiddenSource,
    TrainSample,
    data_fingerprint,
    epoch_batches,
    eval_share,
    pad_batch,
    rank_micro_batches,
    split_samples,
    steps_per_epoch,
)
from models.train.metrics import Metrics, MetricsWriter, read_last_eval
from models.train.optimizer import ds_train_config, wrap_in_deepspeed
from settings.layout import CHECKPOINTS, DS_CONFIG, FINAL, TRAIN_SUMMARY
from settings.train import STEP_DECAY

ERROR_MARK = TRAIN.error.mark
PROGRESS_EVERY_S = 2.0


def run(job: TrainJobFile, dist: Dist) -> dict[str, Any]:
    """Train (or resume) on this rank; rank 0 exports the draft at the end. Returns the final eval."""
    from transformers import AutoConfig

    out_dir = Path(job.out_dir)
    ckpt_dir = out_dir / CHECKPOINTS
    device = dist.device(job.device)
    if dist.rank == 0:  # the first line of a job whose ranks take a while to start (torch, then deepspeed, imported)
        log(f"train: rank 0 of {dist.world_size} started; importing deepspeed and joining the process group")
    init_process_group(dist, job.device, deepspeed=True)  # DeepSpeed even for one process
    check_shared_dir(dist, out_dir)  # ranks on several nodes: one checkpoint directory for all

    # --- the draft and its frozen target pieces
    target_config = AutoConfig.from_pretrained(job.target.path, trust_remote_code=job.target.trust_remote_code)
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    source, aux_layers = _data_source(job, text, device)
    embed, head = load_target_tensors(
        job.target.path, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False))
    )
    counts = load_token_counts(job.token_counts, int(text.vocab_size))
    d2t, t2d = draft_vocab(counts, int(text.vocab_size), job.draft_vocab_size)
    torch.manual_seed(job.seed)  # identical initial weights on every rank
    config = Eagle3Config.from_target_config(
        text,
        draft_vocab_size=int(d2t.shape[0]),
        aux_layers=aux_layers,
        **DRAFT_VARIANTS[job.draft_variant],
        norm_before_fc=job.norm_before_fc,
        norm_before_residual=job.norm_before_residual,
        draft_arch=job.draft_arch,
        target_rope=job.draft_rope == "target",
        **job.draft_overrides,
    )
    draft = Eagle3Draft(config)
    draft.load_target_embedding(embed.to(draft.embed_tokens.weight.dtype))
    draft.set_draft_vocab(d2t, t2d)
    if job.lm_head_init == "target":  # the target's rows of the draft tokens: [D, H] from [V, H]
        with torch.no_grad():
            draft.lm_head.weight.copy_(head[draft_to_target_ids(d2t)].to(draft.lm_head.weight.dtype))
    target_head = TargetHead(head.to(device), d2t.to(device))
    del embed, head

    # --- data, schedule, engine
    train_samples, eval_samples = split_samples(source.samples, job.eval_fraction)
    if not train_samples:
        raise ValueError("no training samples (all held out or none captured)")
    per_epoch = steps_per_epoch(
        len(epoch_batches(train_samples, job.max_batch_tokens, job.seed, 0)), dist.world_size, job.grad_accum
    )
    total_steps = per_epoch * job.epochs if job.max_steps is None else job.max_steps
    warmup = max(1, round(job.warmup_ratio * total_steps))
    fingerprint = run_fingerprint(job, source.fingerprint, d2t, config, dist.world_size, total_steps)
    check_fingerprint(ckpt_dir, fingerprint, warn=dist.rank == 0)  # before anything is trained or removed
    ds_config = ds_train_config(job, world_size=dist.world_size, bf16=job.bf16, hidden_size=config.hidden_size)
    if dist.rank == 0:  # the DeepSpeed config as run, next to the checkpoints
        with writing(out_dir / DS_CONFIG, ckpt_dir):
            out_dir.mkdir(parents=True, exist_ok=True)
            write_atomic(out_dir / DS_CONFIG, json.dumps(ds_config, indent=2))
    ds_model = wrap_in_deepspeed(ds_config, draft, job.min_lr_ratio, total_steps, warmup)
    if dist.rank == 0:
        log(
            f"train: {len(train_samples)} training samples ({sum(s.length for s in train_samples):,} tokens), "
            f"{len(eval_samples)} held out, {per_epoch} steps/epoch over {dist.world_size} rank(s) x {job.grad_accum} "
            f"micro batches, {total_steps} steps; draft vocab {config.draft_vocab_size} of {config.vocab_size} "
            f"(covers {draft_vocab_coverage(counts, t2d):.1%} of loss tokens); mode {job.mode}, "
            f"{'bf16' if job.bf16 else 'fp32'}, ZeRO-2"
            + (f"; {source.cut} samples cut to {job.max_batch_tokens} tokens" if source.cut else "")
        )

    position = resume_checkpoint(ds_model, ckpt_dir, dist)
    writer = MetricsWriter(out_dir, position.step, enabled=dist.rank == 0)
    dtype = torch.bfloat16 if job.bf16 else torch.float32

    def export(directory: Path) -> None:  # final/ and best/ alike: validated, renamed into place once complete
        export_draft(ds_model.module, directory, target_config=target_config, dtype=dtype)

    best = BestDraft(out_dir, position.step, dist, export)  # the best eval up to the resumed step, and best/

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
            ds_model.train()
            step_tokens = 0
            for micro in rank_micro_batches(
                batches, position.step_in_epoch, dist.rank, dist.world_size, job.grad_accum
            ):
                batch = source.batch(micro, device)
                out = train_forward(ds_model, batch, target_head, job.ttt_steps, job.ttt_step_weight)
                ds_model.backward(out.loss)
                ds_model.step()
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
                line = {
                    "kind": "train",
                    "step": position.step,
                    "epoch": position.epoch,
                    "time": time.time(),
                    **running.summary(job.ttt_step_weight),
                    "lr": ds_model.get_lr()[0],
                    "grad_norm": grad_norm(ds_model),
                    "tokens": position.tokens,
                    "tokens_per_s": round(tokens_per_s, 2),
                }
                writer.write(line)
                running = Metrics(job.ttt_steps, device)
                window_start, window_tokens = time.monotonic(), 0
            if time.monotonic() - last_report >= PROGRESS_EVERY_S or position.step == total_steps:
                last_report = time.monotonic()
                tell(
                    TRAIN_PROGRESS.format(
                        step=position.step,
                        total=total_steps,
                        tokens=position.tokens,
                        loss=out.loss.item(),
                        lr=ds_model.get_lr()[0],
                    )
                )
            if eval_batches and (position.step % job.eval_every == 0 or position.step == total_steps):
                last_eval = _evaluate(ds_model, source, eval_batches, target_head, job, dist, device)
                writer.write(
                    {"kind": "eval", "step": position.step, "epoch": position.epoch, "time": time.time(), **last_eval}
                )
                tell(
                    TRAIN_EVAL.format(
                        step=position.step, acceptance_length=last_eval["acceptance_length"], loss=last_eval["loss"]
                    )
                )
                new = best.offer(position.step, position.epoch, last_eval)  # rank 0 exports, the others wait
                if new is not None:
                    tell(TRAIN_BEST.format(step=new.step, acceptance_length=new.acceptance_length, dir=best.dir))
            if position.step % job.checkpoint_every == 0 or position.step == total_steps:
                save_checkpoint(ds_model, ckpt_dir, position, job.keep_checkpoints, dist, fingerprint)
                tell(TRAIN_CHECKPOINT.format(step=position.step))
        if position.step_in_epoch >= per_epoch:
            position.epoch += 1
            position.step_in_epoch = 0
    writer.close()

    # --- export (every rank holds the whole model under ZeRO-2; rank 0 writes)
    final = out_dir / FINAL
    if last_eval is None:  # a relaunch of a finished run: its last eval is in the metrics
        last_eval = read_last_eval(writer.path)
    summary = {
        "final": str(final),  # the last step's draft
        "best": best.summary(position.step),  # the best held-out eval's, in best/; None without held-out evals
        "steps": position.step,
        "tokens": position.tokens,
        "eval": last_eval,
        "draft_vocab_size": config.draft_vocab_size,
        "aux_layers": aux_layers,
    }
    if dist.rank == 0:
        # export_draft replaces final/ only once the new export is complete; a relaunch exports again
        with writing(final, ckpt_dir, also="the previous export in final/, if any, is unchanged"):
            export(final)
        with writing(out_dir / TRAIN_SUMMARY, ckpt_dir):
            write_atomic(out_dir / TRAIN_SUMMARY, json.dumps(summary, indent=2))
        log(f"train: the last step's draft (step {position.step}) is in {final}; " + best.described(position.step))
        say(TRAIN_DONE.format(final=final))
    dist.barrier()
    return summary


def train_forward(model, batch: Batch, target_head: TargetHead, ttt_steps: int, step_weight: float = STEP_DECAY):
    return model(*_ttt_args(batch, target_head), ttt_steps=ttt_steps, step_decay=step_weight)


@torch.no_grad()
def _evaluate(
    ds_model,
    source,
    eval_batches: list[list[TrainSample]],
    target_head: TargetHead,
    job: TrainJobFile,
    dist: Dist,
    device: torch.device,
) -> dict[str, Any]:
    """TTT metrics over the held-out samples, summed over ranks (every rank evaluates a share)."""
    ds_model.eval()
    metrics = Metrics(job.ttt_steps, device)
    for samples in eval_share(eval_batches, dist.rank, dist.world_size):
        batch = source.batch(samples, device)
        metrics.add(
            ds_model.module.forward_ttt(
                *_ttt_args(batch, target_head), ttt_steps=job.ttt_steps, step_decay=job.ttt_step_weight
            )
        )
    metrics.all_reduce(dist)
    ds_model.train()
    return metrics.summary(job.ttt_step_weight)


def _ttt_args(batch: Batch, target_head: TargetHead) -> tuple:
    return (batch.input_ids, batch.aux_hidden, target_head(batch.last_hidden), batch.loss_mask, batch.attention_mask)


def grad_norm(ds_model) -> float | None:
    norm = ds_model.get_global_grad_norm()
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


def _data_source(job: TrainJobFile, text_config, device: torch.device):
    """(source, aux_layers): captured shards (offline) or the target itself over the records (online)."""
    if job.mode == "offline":
        if job.hidden_dir is None:  # TrainJobFile refuses an offline job without one: not reached
            raise ValueError("train.mode offline needs the job's hidden_dir (the capture shards)")
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

    def __init__(self, job: TrainJobFile, aux_layers: list[int], vocab_size: int, device: torch.device):
        from models.capture.job import resolve_dtype

        records, self.parts, _ = load_records(job.datasets, vocab_size)
        self.max_len = job.max_batch_tokens
        self.cut = sum(1 for s in records if s.length > self.max_len)
        self.samples = [TrainSample(s.dataset, s.id, min(s.length, self.max_len), (s.part, s.start)) for s in records]
        if not self.samples:
            raise ValueError("no records with loss tokens to train on")
        self.fingerprint = data_fingerprint(
            ((s.dataset, s.id, s.length) for s in records), {"mode": "online", "target": job.target.path}
        )
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(job.target.path, trust_remote_code=job.target.trust_remote_code)
        dtype = torch.bfloat16 if job.bf16 else resolve_dtype("auto", cfg)
        self.model = load_language_model(
            job.target.path, dtype=dtype, trust_remote_code=job.target.trust_remote_code, config=cfg
        )
        self.model = self.model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]  # PreTrainedModel.to is @wraps(Module.to): typeshed's _Wrapped leaves self unbound
        self.num_layers = (
            len(self.model.model.layers)
            if hasattr(self.model, "model") and hasattr(self.model.model, "layers")
            else int(cfg.get_text_config().num_hidden_layers)
        )
        self.aux_layers = aux_layers
        self.pad_id = cfg.pad_token_id if isinstance(getattr(cfg, "pad_token_id", None), int) else 0

    @torch.no_grad()
    def batch(self, samples: list[TrainSample], device: torch.device) -> Batch:
        from models.capture.records import Sample

        as_capture = [Sample(s.dataset, s.id, s.ref[0], s.ref[1], s.length) for s in samples]
        rows = []
        for s, aux, last in capture_batch(
            self.model,
            as_capture,
            self.parts,
            self.aux_layers,
            self.num_layers,
            self.pad_id,
            device,
            {"output_hidden_states": True, "use_cache": False},
        ):
            part = self.parts[s.part]
            ids = torch.from_numpy(part.input_ids[s.start : s.start + s.length].astype(np.int64))
            mask = torch.from_numpy(part.loss_mask[s.start : s.start + s.length].copy())
            rows.append((ids, mask, aux, last))
        return pad_batch(rows, max(s.length for s in samples), device)


# --- checkpoints ------------------------------------------------------------------------------------


# --- process ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The training rank's entry point (models/ranks/harness.py): run the job, report a failure; the exit status."""

    # Every rank reads the same checkpoint and data: one refusal is enough, from rank 0.
    def run_job(job_path: str, dist: Dist) -> None:
        run(TrainJobFile.load(job_path), dist)

    return serve(argv, "models.train", __doc__, TRAIN, run_job, told=(CheckpointMismatch,), once=(CheckpointMismatch,))


if __name__ == "__main__":
    sys.exit(main())
