"""Capture rank entry point: run the target over the training records, keep EAGLE-3 hidden states.

    torchrun --nproc_per_node N -m models.capture --job JOB.json     (or the `deepspeed` launcher)
    python -m models.capture --job JOB.json                          (WORLD_SIZE unset: one process)

For every record (trimmed after its last loss token: later tokens train nothing) a rank stores
the outputs of the three aux decoder layers (`hidden_states[k+1]` for 0-based layer k, concatenated
to [n, 3H]) and the final hidden state (`hidden_states[-1]`, [n, H]) in the target dtype, as
safetensors shards (models/capture/shards.py) in `out_dir`; rank 0 writes `index.parquet` at the end.

Work split (the plan: models/capture/records.py). Every rank reads the same records and the same
finished shards, so every rank computes the same pending set and the same deal without talking to the
others: pending samples sorted by length (longest first, ties by (dataset, id)), each given to the rank
with the fewest tokens so far. A resumed run skips every sample in a complete shard; shards are atomic,
so a kill loses at most what the ranks held in memory (< shard_tokens per rank).

Modes.
- replicate: every rank holds a whole copy of the target (fits one device).
- zero3: the target's parameters are partitioned over the ranks with DeepSpeed ZeRO-3 (optionally
  offloaded to CPU or NVMe); every forward gathers each layer's parameters collectively, so all ranks
  must call forward the same number of times: ranks with fewer batches run 1-token dummy forwards.
  MoE blocks are made ZeRO-3 leaf modules (all experts gathered at once) because a rank whose tokens
  route to other experts than its peers' would otherwise wait for a gather its peers never start.
  Quantized (e.g. INT4) checkpoints are not partitioned by ZeRO-3: use a BF16 copy with offload.

The final hidden state: with transformers 5, `@capture_outputs` replaces `hidden_states[-1]` by the
base model's `last_hidden_state` (after the final norm) unless `config.tie_last_hidden_states` is
False, which this module refuses; transformers 4.x Llama and DeepSeek-V3 remote code append the
normed state last as well. tests/models/capture/test_job.py checks it against the final norm's output.

Progress goes to stdout as `CAPTURE_PROGRESS rank=R done=a total=b tokens=t` (samples done / this
rank's samples this run, tokens captured this run; models/common/rank_protocol.py), at most every 2 s and at
the end. A failure exits through the rank harness (models/ranks/harness.py) with one `CAPTURE_ERROR {json}`
line that the pipeline turns back into the exception: a failed write (`WriteFailed`: the rank stops
at once, every complete shard is kept) or a damaged file (`DamagedFile`) is told in that one line.
"""

from __future__ import annotations

import inspect
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.capture.records import RecordPart, Sample, deal, held, load_records, make_batches, within_token_cap
from models.capture.shards import ShardWriter, captured_with, clean_temps, list_shards, shard_metadata, write_index
from models.common.job_files import CaptureJobFile
from models.common.rank_protocol import CAPTURE, CAPTURE_PROGRESS
from models.draft.config import default_aux_layers
from models.ranks.harness import Dist, check_shared_dir, init_process_group, log, say, serve
from models.target.loader import load_language_model

PROGRESS_EVERY_S = 2.0
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Name fragments of MoE block classes (DeepseekV3MoE, Qwen3MoeSparseMoeBlock, MixtralSparseMoeBlock,
# *Experts in transformers 5). Only the outermost match becomes a ZeRO-3 leaf: a leaf gathers
# everything below it in one go.
MOE_NAME_HINTS = ("moe", "sparsemoe", "experts")
ERROR_MARK = CAPTURE.error.mark


# --- the target --------------------------------------------------------------------------------------


def resolve_dtype(name: str, config: Any) -> torch.dtype:
    """The capture dtype: the named one, or for "auto" the checkpoint's (float32 when it says none)."""
    if name != "auto":
        return DTYPES[name]
    found = getattr(config, "dtype", None) or config.to_dict().get("torch_dtype")
    if isinstance(found, str):
        found = getattr(torch, found.removeprefix("torch."), None)
    return found if isinstance(found, torch.dtype) else torch.float32


def ds_inference_config(
    dtype: torch.dtype, offload: str, nvme_path: str | None, device: str, largest_param_numel: int = 0
) -> dict[str, Any]:
    """A ZeRO-3 inference config (no optimizer): parameters partitioned, optionally offloaded."""
    zero: dict[str, Any] = {"stage": 3}
    if offload == "cpu":
        zero["offload_param"] = {"device": "cpu", "pin_memory": device == "cuda"}
    elif offload == "nvme":
        zero["offload_param"] = {
            "device": "nvme",
            "nvme_path": nvme_path,
            "pin_memory": device == "cuda",
            # every swap buffer must hold the largest parameter (the embedding, for big vocabs)
            "buffer_size": int(max(1e8, largest_param_numel)),
        }
    return {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "zero_optimization": zero,
        "bf16": {"enabled": dtype == torch.bfloat16},
        "fp16": {"enabled": dtype == torch.float16},
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }


def moe_leaf_classes(model: torch.nn.Module) -> list[type]:
    """Classes of the outermost modules whose class name looks like an MoE block (see MOE_NAME_HINTS)."""
    classes: list[type] = []
    matched: list[str] = []
    for name, module in model.named_modules():
        if any(name.startswith(m + ".") for m in matched):
            continue
        cls_name = type(module).__name__.lower()
        if any(h in cls_name for h in MOE_NAME_HINTS):
            matched.append(name)
            if type(module) not in classes:
                classes.append(type(module))
    return classes


def num_decoder_layers(config: Any) -> int:
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return int(text.num_hidden_layers)


# --- the rank ------------------------------------------------------------------------------------------


def run(job: CaptureJobFile, dist: Dist) -> dict[str, int]:
    """Capture this rank's share of the pending samples; return {"samples", "tokens"} captured here."""
    from transformers import AutoConfig

    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    device = dist.device(job.device)

    config = AutoConfig.from_pretrained(job.target.path, trust_remote_code=job.target.trust_remote_code)
    if getattr(config, "tie_last_hidden_states", True) is False:
        raise ValueError(
            f"{job.target.path}: config.tie_last_hidden_states=False: hidden_states[-1] "
            "would be the pre-norm state; the capture needs the post-norm one"
        )
    dtype = resolve_dtype(job.dtype, config)
    num_layers = num_decoder_layers(config)
    aux_layers = default_aux_layers(num_layers) if job.aux_layers is None else list(job.aux_layers)
    if max(aux_layers) >= num_layers:
        raise ValueError(f"aux_layers {aux_layers} out of range for a {num_layers}-layer target")
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden_size = int(text_config.hidden_size)
    vocab_size = getattr(text_config, "vocab_size", None)

    init_process_group(dist, job.device, deepspeed=job.mode == "zero3")
    check_shared_dir(dist, out_dir)  # ranks on several nodes: one out_dir for all, or the plan below differs

    # The plan: identical on every rank, because every rank reads the same files before any rank
    # writes (the barrier below) and the deal is deterministic.
    existing = [shard_metadata(p) for p in list_shards(out_dir)]
    check_compatible(existing, out_dir, hidden_size, aux_layers, dtype, job.storage)
    done = {(s["dataset"], s["id"]) for m in existing for s in m["samples"]}
    samples, parts, no_loss = load_records(job.datasets, vocab_size, keep_tokens=False)
    pending = within_token_cap([s for s in samples if (s.dataset, s.id) not in done], job.launch_tokens)
    mine, parts = held(deal(pending, dist.world_size)[dist.rank], parts)  # this rank's tokens only
    batches = make_batches(mine, job.max_batch_tokens)
    if dist.rank == 0:
        clean_temps(out_dir)  # leftovers of killed writers; nobody writes before the barrier
        log(
            f"capture: {len(samples)} records with loss tokens ({no_loss} without, skipped), "
            f"{len(done)} already captured, {len(pending)} pending over {dist.world_size} rank(s); "
            f"aux_layers={aux_layers} dtype={str(dtype).removeprefix('torch.')} mode={job.mode}"
        )
    dist.barrier()
    if not pending:  # every rank knows: nothing to load the target for
        if dist.rank == 0:
            write_index(out_dir)
        say(CAPTURE_PROGRESS.format(rank=dist.rank, done=0, total=0, tokens=0))
        return {"samples": 0, "tokens": 0}
    del samples, pending  # only this rank's share stays referenced

    forward, model = _load_target(job, dist, dtype, device)
    call_kwargs = forward_kwargs(model)
    pad_id = config.pad_token_id if isinstance(getattr(config, "pad_token_id", None), int) else 0

    # ZeRO-3 gathers parameters collectively inside forward: every rank runs the same number.
    steps = dist.max(len(batches), device) if job.mode == "zero3" else len(batches)
    total = len(mine)
    done_here = tokens_here = 0
    last_report = time.monotonic()
    say(CAPTURE_PROGRESS.format(rank=dist.rank, done=0, total=total, tokens=0))
    writer = ShardWriter(out_dir, dist.rank, job.shard_tokens, aux_layers=aux_layers, storage=job.storage)
    with writer, torch.no_grad():
        for step in range(steps):
            if step >= len(batches):
                forward(
                    input_ids=torch.full((1, 1), pad_id, dtype=torch.long, device=device),
                    attention_mask=torch.ones((1, 1), dtype=torch.long, device=device),
                    **call_kwargs,
                )
                continue
            batch = batches[step]
            for s, aux, last in capture_batch(
                forward, batch, parts, aux_layers, num_layers, pad_id, device, call_kwargs
            ):
                write_sample(writer, parts, s, aux, last)
                done_here += 1
                tokens_here += s.length
            if time.monotonic() - last_report >= PROGRESS_EVERY_S:
                say(CAPTURE_PROGRESS.format(rank=dist.rank, done=done_here, total=total, tokens=tokens_here))
                last_report = time.monotonic()
    say(CAPTURE_PROGRESS.format(rank=dist.rank, done=done_here, total=total, tokens=tokens_here))
    log(
        f"capture: rank {dist.rank} ran {len(batches)} batches and {steps - len(batches)} padding forwards, "
        f"wrote {len(writer.written)} shards"
    )

    dist.barrier()  # every rank's shards are complete
    if dist.rank == 0:
        write_index(out_dir)
    dist.barrier()
    return {"samples": done_here, "tokens": tokens_here}


def forward_kwargs(model: torch.nn.Module) -> dict[str, Any]:
    """The keyword arguments the capture passes to the target's forward (all hidden states, no cache)."""
    kwargs: dict[str, Any] = {"output_hidden_states": True, "use_cache": False}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1  # the capture never reads logits: skip the [n, vocab] matmul
    return kwargs


def padded_batch(batch: list[Sample], parts: list[RecordPart], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The right-padded int64 input_ids [B, S] and attention_mask [B, S] of `batch`, on the CPU."""
    width = max(s.length for s in batch)
    input_ids = torch.full((len(batch), width), pad_id, dtype=torch.long)  # [B, S]
    attention_mask = torch.zeros((len(batch), width), dtype=torch.long)  # [B, S]
    for i, s in enumerate(batch):
        input_ids[i, : s.length] = torch.from_numpy(
            parts[s.part].input_ids[s.start : s.start + s.length].astype(np.int64)
        )
        attention_mask[i, : s.length] = 1
    return input_ids, attention_mask


def write_sample(
    writer: ShardWriter, parts: list[RecordPart], s: Sample, aux: torch.Tensor, last: torch.Tensor
) -> None:
    """Queue one sample as `capture_batch` yields it in `writer`, with its ids and loss mask from `parts`."""
    part = parts[s.part]
    writer.add(
        s.id,
        s.dataset,
        torch.from_numpy(part.input_ids[s.start : s.start + s.length].copy()),
        torch.from_numpy(part.loss_mask[s.start : s.start + s.length].copy()),
        aux,
        last,
    )


def capture_batch(
    forward: Callable[..., Any],
    batch: list[Sample],
    parts: list[RecordPart],
    aux_layers: list[int],
    num_layers: int,
    pad_id: int,
    device: torch.device,
    call_kwargs: dict[str, Any],
):
    """One right-padded forward (`padded_batch`); yield (sample, aux [n, 3H], last [n, H]) on the CPU, unpadded."""
    input_ids, attention_mask = padded_batch(batch, parts, pad_id)
    out = forward(input_ids=input_ids.to(device), attention_mask=attention_mask.to(device), **call_kwargs)
    hidden = out.hidden_states  # L+1 tensors [B, S, H]; [0] is the embeddings
    if len(hidden) != num_layers + 1:
        raise RuntimeError(f"the target returned {len(hidden)} hidden states, expected {num_layers + 1}")
    aux = torch.cat([hidden[k + 1] for k in aux_layers], dim=-1).cpu()  # [B, S, 3H]
    last = hidden[-1].cpu()  # [B, S, H], after the final norm
    for i, s in enumerate(batch):
        yield s, aux[i, : s.length], last[i, : s.length]


def _load_target(
    job: CaptureJobFile, dist: Dist, dtype: torch.dtype, device: torch.device
) -> tuple[Callable[..., Any], torch.nn.Module]:
    """(forward, model): the model itself (replicate) or its DeepSpeed engine (zero3), and the HF model."""
    if job.mode == "replicate":
        model = load_language_model(job.target.path, dtype=dtype, trust_remote_code=job.target.trust_remote_code)
        model = model.to(device).eval().requires_grad_(False)  # type: ignore[arg-type]  # PreTrainedModel.to is @wraps(Module.to): typeshed's _Wrapped leaves self unbound
        return model, model

    import deepspeed
    from deepspeed.utils import set_z3_leaf_modules
    from transformers import AutoConfig
    from transformers.integrations import HfDeepSpeedConfig

    config = AutoConfig.from_pretrained(job.target.path, trust_remote_code=job.target.trust_remote_code)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    largest = int(getattr(text, "vocab_size", 0) or 0) * int(getattr(text, "hidden_size", 0) or 0)
    nvme = str(job.nvme_path) if job.nvme_path is not None else None
    ds_config = ds_inference_config(dtype, job.offload, nvme, job.device, largest)
    # Must exist (and stay referenced: transformers keeps only a weak reference) BEFORE
    # from_pretrained, so the weights are created partitioned (zero.Init) instead of whole on every rank.
    hf_ds_config = HfDeepSpeedConfig(ds_config)
    model = load_language_model(
        job.target.path, dtype=dtype, trust_remote_code=job.target.trust_remote_code, config=config
    )
    leaves = moe_leaf_classes(model)
    if leaves:
        set_z3_leaf_modules(model, leaves)
        if dist.rank == 0:
            log(f"capture: ZeRO-3 leaf modules: {[c.__name__ for c in leaves]}")
    engine, *_ = deepspeed.initialize(model=model, config=ds_config)
    engine.module.eval().requires_grad_(False)
    params = list(engine.module.parameters())
    held = sum(p.ds_tensor.numel() for p in params if hasattr(p, "ds_tensor"))
    log(
        f"capture: rank {dist.rank} holds {held:,} of {sum(getattr(p, 'ds_numel', p.numel()) for p in params):,} "
        f"parameters (ZeRO-3, offload {job.offload})"
    )
    engine._capture_hf_ds_config = hf_ds_config  # keep it alive as long as the engine
    return engine, engine.module


def check_compatible(
    existing: list[dict], out_dir: Path, hidden_size: int, aux_layers: list[int], dtype: torch.dtype, storage: str
) -> None:
    """ValueError unless the shards in `out_dir` were captured with these settings (either backend writes into them)."""
    want = {
        "hidden_size": hidden_size,
        "aux_layers": aux_layers,
        "dtype": str(dtype).removeprefix("torch."),
        "storage": storage,
    }
    for meta in existing[:1]:  # all shards come from runs that passed this same check
        have = captured_with(meta)
        if have != want:
            raise ValueError(
                f"{out_dir} holds shards captured with {have}, this job captures {want}: "
                "use another out_dir or remove the old shards"
            )


def main(argv: list[str] | None = None) -> int:
    """The capture rank's entry point (models/ranks/harness.py): run the job, report a failure; the exit status."""
    return serve(
        argv, "models.capture", __doc__, CAPTURE, lambda job_path, dist: run(CaptureJobFile.load(job_path), dist)
    )


if __name__ == "__main__":
    sys.exit(main())
