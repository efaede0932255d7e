"""The train-stage bench's baselines: the job's training loop in plain PyTorch, and the two steps interleaved.

What runs in the baseline's processes (bench/train.py starts them: `--baseline-worker`, or
harness.spawn): `plain_loop` (the same draft, data, loss, AdamW and schedule as models.train, no
DeepSpeed, no process group, no launcher) and `interleaved` (the plain step and the job's
DeepSpeed step alternately in one process). Each takes the bench's settings as a plain dict.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from bench import harness
from models.capture.shards import METADATA_NAME
from models.common.job_files import TrainJobFile
from models.draft.config import Eagle3Config, default_aux_layers
from models.draft.eagle3 import Eagle3Draft
from models.draft.target_head import TargetHead
from models.draft.vocab import draft_vocab, load_token_counts
from models.ranks.harness import Dist
from models.target.weights import load_target_tensors
from models.train.data import HiddenSource, epoch_batches, rank_micro_batches, split_samples, steps_per_epoch
from models.train.metrics import Metrics
from models.train.optimizer import lr_lambda
from settings.train import STEP_DECAY, TrainConfig

RUN_CONFIG = TrainConfig()  # the run config's train section as declared: the AdamW betas and eps the job gets
BETAS, EPS = RUN_CONFIG.adam_betas, RUN_CONFIG.adam_eps


def setup(cfg: dict[str, Any], world: int) -> dict[str, Any]:
    """What models.train.job.run builds before its loop: data source and split, the draft (seeded), TargetHead."""
    from transformers import AutoConfig

    device = torch.device("cpu")
    target = cfg["target_path"]
    text = AutoConfig.from_pretrained(target)
    text = text.get_text_config() if hasattr(text, "get_text_config") else text
    source = HiddenSource(cfg["hidden_dir"], cfg["max_batch_tokens"])
    meta = Path(cfg["hidden_dir"]) / METADATA_NAME  # as models.train.job._data_source: the capture's, else the default
    aux_layers = (json.loads(meta.read_text()).get("aux_layers") if meta.is_file() else None) or default_aux_layers(
        int(text.num_hidden_layers)
    )
    embed, head = load_target_tensors(target, tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)))
    counts = load_token_counts(cfg["token_counts"], int(text.vocab_size))
    d2t, t2d = draft_vocab(counts, int(text.vocab_size), cfg["draft_vocab_size"])
    torch.manual_seed(cfg["seed"])  # as models.train.job.run: the same initial weights
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


def interleaved(cfg: dict[str, Any], job: dict[str, Any]) -> dict[str, Any]:
    """One process (1 rank): the plain step and the job's DeepSpeed step in alternation, on the same batch tensors.

    Both drafts start from the same seed and see the same batches; each step runs the plain loop's
    step and the job's (models.train.optimizer.wrap_in_deepspeed / models.train.job.train_forward,
    engine.backward / step, the per-step token all-reduce), alternating which goes first. Whatever else runs on
    the machine hits both alike, so the difference is the engine's per-step cost. Phases: forward (TargetHead +
    forward_ttt, through the engine for ours), backward (engine.backward: autograd + ZeRO-2 gradient hooks), the rest
    (plain: clip + AdamW + LambdaLR + zero_grad; ours: engine.step: ZeRO-2 reduction, norm, clip,
    AdamW on the flat partition, copy back, scheduler; + train(), the token all-reduce and, every
    `log_every` steps, the job's metrics line: Metrics all-reduce, grad norm, metrics.jsonl and
    TensorBoard, as rank 0 writes it).
    """
    from tasks.runtime.ports import free_port

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

    from models.train.job import grad_norm, sum_over_ranks, train_forward
    from models.train.metrics import MetricsWriter
    from models.train.optimizer import ds_train_config, wrap_in_deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    dist = Dist(group=True)
    a, b = setup(cfg, 1), setup(cfg, 1)  # the same seed: the same initial weights
    device, source, train_samples, per_epoch = a["device"], a["source"], a["train_samples"], a["per_epoch"]
    params, optimizer, scheduler = plain_optimizer(cfg, a["draft"], a["warmup"])
    train_job = TrainJobFile.model_validate(job)
    ds_config = ds_train_config(
        train_job, world_size=dist.world_size, bf16=train_job.bf16
    )  # as models/train/job.py does
    ds_model = wrap_in_deepspeed(ds_config, b["draft"], train_job.min_lr_ratio, cfg["steps"], b["warmup"])
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
        ds_model.train()
        step_tokens = 0
        for batch in batches:
            t0 = time.perf_counter()
            out = train_forward(ds_model, batch, b["target_head"], ttt)
            t1 = time.perf_counter()
            ds_model.backward(out.loss)
            fwd, bwd = fwd + t1 - t0, bwd + time.perf_counter() - t1
            ds_model.step()
            running["ours"].add(out)
            step_tokens += batch.tokens
        sum_over_ranks(step_tokens, dist, device)
        window["tokens"] += step_tokens
        if log_step(n):  # the job's metrics line (models.train.job.run)
            running["ours"].all_reduce(dist)
            elapsed = max(1e-9, time.monotonic() - window["start"])
            line = {
                "kind": "train",
                "step": n,
                "epoch": 0,
                "time": time.time(),
                **running["ours"].summary(STEP_DECAY),
                "lr": ds_model.get_lr()[0],
                "grad_norm": grad_norm(ds_model),
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
