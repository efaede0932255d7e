"""What the capture will take, from the target's config.json: its disk against the free space (`capture_plan`) and its
memory per GPU and node for each backend (`memory_plans`), for `eagle3 plan` (cli/plan.py) and the preflight."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from settings.run import RunConfig
from tasks.capture.memory import (
    GIB,
    VLLM_MEMORY_UTILIZATION,
    MemoryPlan,
    checkpoint_bytes,
    count_params,
    deepspeed_memory,
    quantized_bytes_per_param,
    vllm_memory,
)
from tasks.capture.plan import (
    DTYPE_BYTES,
    CapturePlan,
    ExtractionWindow,
    capture_dtype,
    existing_parent,
    plan_capture,
    read_target_config,
    shape_of,
    text_config,
)
from tasks.capture.tasks import captured_tokens, last_throughput


def capture_plan(config: RunConfig, data: dict | None = None) -> CapturePlan:
    """The capture's bytes still to write against the free space (reads the target's config.json, `data` when
    given, from its directory or the Hugging Face cache; TargetConfigMissing if neither has it)."""
    shape = shape_of(data if data is not None else read_target_config(config.target.path, download=False))
    c, layout = config.capture, config.layout
    engine = (
        ExtractionWindow(layout.engine_dir, c.engine.max_concurrency, c.shard_tokens) if c.backend == "vllm" else None
    )
    return plan_capture(
        [layout.records(d.name) for d in config.datasets],
        layout.hidden_dir,
        shape,
        c.dtype,
        margin=c.disk_margin,
        storage=c.storage,
        max_tokens=c.max_tokens,
        tokens_done=captured_tokens(layout.hidden_dir),
        tokens_per_s=last_throughput(layout.hidden_dir),
        engine=engine,
    )


@dataclass(frozen=True)
class MemorySetup:
    """One capture setup's memory plan; `configured`: the config's own; `enforced`: refused when it does not fit
    (not for a vLLM server the capture does not start)."""

    plan: MemoryPlan
    configured: bool
    enforced: bool


def memory_plans(config: RunConfig, data: dict) -> list[MemorySetup]:
    """The capture's memory per GPU and node for the configured setup and the others on the same GPUs: DeepSpeed
    ZeRO-3 with each offload (and replicate when configured), and vLLM (TP from capture.engine.command, else
    capture.num_gpus). ValueError when the target's parameters cannot be counted from `data` (its config.json)."""
    c, d = config.capture, config.distributed
    text, shape = text_config(data), shape_of(data)
    params = count_params(text)
    gpu, host = int(d.gpu_memory_gib * GIB), int(d.host_memory_gib * GIB)
    dtype_bytes = DTYPE_BYTES.get(capture_dtype(shape, c.dtype), 4)
    nvme_free = shutil.disk_usage(existing_parent(c.nvme_path)).free if c.nvme_path is not None else None
    world = config.world_size(c)
    out: list[MemorySetup] = []
    modes = [(c.mode, c.offload)] if c.backend == "deepspeed" and c.mode == "replicate" else []
    for mode, offload in modes + [("zero3", o) for o in ("none", "cpu", "nvme")]:
        plan = deepspeed_memory(
            params,
            dtype_bytes=dtype_bytes,
            mode=mode,
            offload=offload,
            world_size=world,
            ranks_per_node=c.num_gpus,
            max_batch_tokens=c.max_batch_tokens,
            gpu_limit=gpu,
            host_limit=host,
            nvme_free=nvme_free,
        )
        mine = c.backend == "deepspeed" and (mode, offload) == (c.mode, c.offload)
        out.append(MemorySetup(plan, mine, mine))
    out.append(_vllm_setup(config, text, shape, params, gpu, host))
    return out


def _vllm_setup(config: RunConfig, text: dict, shape, params, gpu: int, host: int) -> MemorySetup:
    """capture.backend: vllm's plan, with the server's sizes read from capture.engine.command where it has them."""
    c, e = config.capture, config.capture.engine
    words = e.command if e.launch == "command" and e.command else None
    per_param, how = quantized_bytes_per_param(text)
    checkpoint = DTYPE_BYTES.get(shape.dtype, 4)
    tp = int(_flag(words, "--tensor-parallel-size", "-tp") or 1) if words else c.num_gpus
    pp = int(_flag(words, "--pipeline-parallel-size", "-pp") or 1) if words else 1
    max_len = int(_flag(words, "--max-model-len") or text.get("max_position_embeddings") or 0)
    batched = int(_flag(words, "--max-num-batched-tokens") or max_len)
    kv = _flag(words, "--kv-cache-dtype")
    notes = [f"weights {how}" if how else "weights unquantized"]
    if not words:
        notes.append(f"no capture.engine.command: TP {tp} = capture.num_gpus, lengths from config.json")
    plan = vllm_memory(
        params,
        text,
        weights_bytes=checkpoint_bytes(params, checkpoint, per_param),
        dtype_bytes=checkpoint,
        tp=tp,
        pp=pp,
        max_model_len=max_len,
        max_num_batched_tokens=batched,
        kv_dtype_bytes=1 if kv and kv.startswith("fp8") else checkpoint,
        extracted_layers=4,  # the 3 aux layers and the last (models/capture/vllm_hidden.py engine_layer_ids)
        gpu_memory=gpu,
        utilization=float(_flag(words, "--gpu-memory-utilization") or VLLM_MEMORY_UTILIZATION),
        host_limit=host,
        note="; ".join(notes),
    )
    mine = c.backend == "vllm"
    return MemorySetup(plan, mine, mine and e.launch == "command")


def _flag(words: list[str] | None, *names: str) -> str | None:
    """The value of the first of `names` in a command (`--flag value` or `--flag=value`), None when absent."""
    for i, word in enumerate(words or []):
        for name in names:
            if word == name and i + 1 < len(words or []):
                return (words or [])[i + 1]
            if word.startswith(name + "="):
                return word.split("=", 1)[1]
    return None
