"""`eagle3 plan`: what every stage of a config still has to do, in tokens, bytes and time, and the capture's memory."""

from __future__ import annotations

import shutil
from dataclasses import dataclass

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.config.schema import RunConfig
from tasks.capture.memory import (
    GIB,
    VLLM_MEMORY_UTILIZATION,
    MemoryPlan,
    MemoryTooSmall,
    check_memory,
    checkpoint_bytes,
    count_params,
    deepspeed_memory,
    gib,
    quantized_bytes_per_param,
    vllm_memory,
)
from tasks.capture.plan import (
    DTYPE_BYTES,
    CapturePlan,
    DiskTooSmall,
    ExtractionWindow,
    TargetConfigMissing,
    capture_dtype,
    check_fits,
    existing_parent,
    human_bytes,
    plan_capture,
    read_target_config,
    shape_of,
    text_config,
)
from tasks.capture.tasks import captured_tokens, last_throughput
from tasks.checkpoints import summarize
from tasks.records.build import summarize_records


def print_plan(config: RunConfig, console: Console) -> bool:
    """Print the plan; False when a stage cannot run as configured (e.g. the disk is too small)."""
    table = Table(title="generate", title_justify="left")
    for column in ("dataset", "kind", "budget", "spent", "left", "responses"):
        table.add_column(column, justify="left" if column in ("dataset", "kind") else "right")
    layout = config.layout
    for d in config.datasets:
        done = summarize(layout.responses(d.name))
        left = f"{max(0, d.token_budget - done.completion_tokens):,}" if d.token_budget else "all prompts"
        table.add_row(
            escape(d.name),
            d.kind,
            f"{d.token_budget:,}" if d.token_budget else "-",
            f"{done.completion_tokens:,}",
            left,
            f"{done.rows:,}",
        )
    console.print(table)

    records = {d.name: summarize_records(layout.records(d.name)) for d in config.datasets}
    console.print(
        f"records: {sum(r.records for r in records.values()):,} records, "
        f"{sum(r.tokens for r in records.values()):,} tokens, "
        f"{sum(r.loss_tokens for r in records.values()):,} loss tokens so far"
    )
    try:
        data = read_target_config(config.target.path, download=False)
    except TargetConfigMissing as exc:  # e.g. a Hub id on an offline machine: said at once, no network retries
        console.print(f"[yellow]capture: no disk or memory plan: {escape(str(exc))}[/yellow]", highlight=False)
        return True
    plan = capture_plan(config, data)
    eta = (
        f"about {plan.est_seconds / 3600:.2f} h at the last measured speed"
        if plan.est_seconds
        else "time unknown until a capture has run"
    )
    console.print(
        f"capture: {plan.tokens_todo:,} tokens to go ({plan.tokens_done:,} done) x {plan.bytes_per_token:,} B "
        f"(hidden {plan.hidden_size}, {'fp8 e4m3 with scales' if plan.storage == 'fp8' else plan.dtype}) = "
        f"{human_bytes(plan.bytes_needed)}; "
        f"{human_bytes(plan.free_bytes)} free in {escape(plan.out_dir)}; {eta}",
        highlight=False,
    )
    if plan.temp_dir is not None:
        where = (
            "counted above: the shards' filesystem"
            if plan.temp_usable_bytes is None
            else f"{human_bytes(plan.temp_usable_bytes)} usable there"
        )
        console.print(
            f"capture (vllm): the connector's files take up to {human_bytes(plan.temp_bytes)} at once in "
            f"{escape(plan.temp_dir)} ({where})",
            highlight=False,
        )
    ok = True
    try:
        check_fits(plan)
    except DiskTooSmall as exc:
        console.print(f"[red]capture would not fit:[/red] {escape(str(exc))}", highlight=False)
        ok = False
    return print_memory(config, data, console) and ok


def print_memory(config: RunConfig, data: dict, console: Console) -> bool:
    """The capture's memory per GPU and per node for each backend (the configured one checked); False when the
    configured one does not fit."""
    try:
        setups = memory_plans(config, data)
    except ValueError as exc:  # a config.json whose parameters are not counted here
        console.print(f"[yellow]capture: no memory plan: {escape(str(exc))}[/yellow]", highlight=False)
        return True
    table = Table(title="capture memory (arithmetic from config.json, not measured)", title_justify="left")
    for column in ("setup", "per GPU", "GPU has", "per node (host)", "node has", "fits"):
        table.add_column(column, justify="left" if column == "setup" else "right")
    for s in setups:
        p = s.plan
        table.add_row(
            escape(p.setup) + (" (configured)" if s.configured else ""),
            gib(p.gpu_bytes),
            gib(p.gpu_limit),
            gib(p.host_bytes),
            gib(p.host_limit),
            ("yes" if p.fits else "[red]no[/red]") + ("" if s.enforced or not s.configured else " (not checked)"),
        )
    console.print(table)
    for s in setups:
        console.print(f"  {escape(s.plan.summary())}", highlight=False)
    chosen = next(s for s in setups if s.configured)
    if not chosen.enforced:
        return True
    try:
        check_memory(chosen.plan)
    except MemoryTooSmall as exc:
        console.print(f"[red]capture would not fit in memory:[/red] {escape(str(exc))}", highlight=False)
        return False
    return True


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
