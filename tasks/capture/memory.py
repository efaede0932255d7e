"""GPU and host memory per rank for the capture, by backend: refuse a config that cannot fit before it starts.

Every figure comes from the target's config.json, counted here once; `eagle3 plan` prints them and
`eagle3 doctor` checks the configured backend's (flows/plan.py `memory_plans`). They are arithmetic,
not measurements: what a forward allocates besides (attention scores, allocator slack, the CUDA context)
is not counted, so a plan that fits by a few GiB may still not fit.

capture.backend: deepspeed (ZeRO-3): the checkpoint is read as it is (an INT4 one dequantized to the capture
dtype as it loads), so per rank:
- the partition: params x dtype bytes / ranks, on the GPU, or pinned in host RAM (capture.offload: cpu) or on
  NVMe (offload: nvme; DeepSpeed then keeps `NVME_BUFFER_COUNT` pinned swap buffers of the largest
  parameter per rank in host RAM);
- the largest module gathered whole on the GPU: an MoE block is a ZeRO-3 leaf module (models/capture/job.py),
  so all its experts at once;
- the activations: max_batch_tokens x hidden x (layers + 1 kept by output_hidden_states, + 3 for the aux
  concatenation) x dtype bytes.
mode: replicate holds the whole model on every GPU (and, while it loads, in host RAM, once per rank).

capture.backend: vllm: the server holds the checkpoint's bytes (INT4 experts packed, the rest bf16) split
over its tensor- and pipeline-parallel GPUs, plus room for one --max-model-len sequence in its KV cache
(MLA's latent is not split by TP) with the hidden-state cache of the extraction, plus the activations of one
--max-num-batched-tokens step, against --gpu-memory-utilization of the GPU.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field

GIB = 1 << 30
NVME_BUFFER_COUNT = 5  # DeepSpeed's offload_param.buffer_count default (ds_inference_config keeps it)
HIDDEN_COPIES = 4  # vLLM: residual, hidden, normed input and a layer's output of a step live at once, roughly
VLLM_MEMORY_UTILIZATION = 0.9  # vLLM's --gpu-memory-utilization default
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# a Linear of each kind, as the checkpoint names it: matched against a quantization config's `ignore`
QUANT_NAMES = {
    "attention": "model.layers.1.self_attn.o_proj",
    "dense_mlp": "model.layers.0.mlp.down_proj",
    "shared_experts": "model.layers.1.mlp.shared_experts.down_proj",
    "routed_experts": "model.layers.1.mlp.experts.0.down_proj",
    "lm_head": "lm_head",
}


class MemoryTooSmall(RuntimeError):
    """The capture would not fit in the GPUs' or the node's memory."""


@dataclass(frozen=True)
class TargetParams:
    """The text model's parameters by kind, counted from its config (weights and norms; biases left out)."""

    kinds: dict[str, int]  # embed, lm_head, attention, norms, dense_mlp, shared_experts, routed_experts, router
    largest_module: int  # what one ZeRO-3 gather brings to a rank at once: an MoE block (a leaf), else a layer
    largest_param: int  # the largest single tensor (the embedding): sizes DeepSpeed's NVMe swap buffers
    hidden_size: int
    num_layers: int

    @property
    def total(self) -> int:
        return sum(self.kinds.values())


def count_params(text: dict) -> TargetParams:
    """Count a decoder-only target's parameters from its text config (DeepSeek-V3 MLA + MoE, or Llama-style).

    ValueError when the config lacks what the count needs or has experts of a kind not counted here.
    """
    try:
        h, layers, vocab = int(text["hidden_size"]), int(text["num_hidden_layers"]), int(text["vocab_size"])
        heads = int(text["num_attention_heads"])
        if text.get("kv_lora_rank"):  # MLA (DeepSeek-V3, Kimi)
            q_lora, kv_lora = text.get("q_lora_rank"), int(text["kv_lora_rank"])
            rope, nope, v = int(text["qk_rope_head_dim"]), int(text["qk_nope_head_dim"]), int(text["v_head_dim"])
            q = h * int(q_lora) + int(q_lora) * heads * (nope + rope) if q_lora else h * heads * (nope + rope)
            attention = q + h * (kv_lora + rope) + kv_lora * heads * (nope + v) + heads * v * h
            attn_norms = (int(q_lora) if q_lora else 0) + kv_lora
        else:  # Llama-style: q, k, v, o
            head_dim = int(text.get("head_dim") or h // heads)
            kv_heads = int(text.get("num_key_value_heads") or heads)
            attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim
            attn_norms = 0
        experts = int(text.get("n_routed_experts") or 0)
        if not experts and text.get("num_experts"):
            raise ValueError("experts given as num_experts (Qwen-MoE style) are not counted here")
        if experts:
            first_dense, freq = int(text.get("first_k_dense_replace") or 0), int(text.get("moe_layer_freq") or 1)
            moe_layers = sum(1 for i in range(layers) if i >= first_dense and i % freq == 0)
            expert = 3 * h * int(text["moe_intermediate_size"])  # gate, up, down
            shared = int(text.get("n_shared_experts") or 0) * expert
            router = experts * h + (experts if text.get("topk_method") == "noaux_tc" else 0)  # + correction bias
        else:
            moe_layers, expert, shared, router = 0, 0, 0, 0
        dense_mlp = 3 * h * int(text["intermediate_size"])
    except (KeyError, TypeError) as exc:
        raise ValueError(f"cannot count the target's parameters: its config has no {exc}") from None
    tied = bool(text.get("tie_word_embeddings", False))
    dense_layers = layers - moe_layers
    kinds = {
        "embed": vocab * h,
        "lm_head": 0 if tied else vocab * h,
        "attention": layers * attention,
        "norms": layers * (2 * h + attn_norms) + h,
        "dense_mlp": dense_layers * dense_mlp,
        "shared_experts": moe_layers * shared,
        "routed_experts": moe_layers * experts * expert,
        "router": moe_layers * router,
    }
    moe_block = experts * expert + shared + router
    layer = attention + (moe_block if moe_layers else dense_mlp) + 2 * h + attn_norms
    largest = moe_block if moe_layers else layer
    return TargetParams(kinds, max(largest, vocab * h), vocab * h, h, layers)


def quantized_bytes_per_param(text: dict, top: dict | None = None) -> tuple[dict[str, float], str]:
    """({kind: bytes per parameter} for the kinds the checkpoint quantizes, a phrase saying how); ({}, '') when
    it has no quantization config. ValueError for a quantization not sized here.

    compressed-tensors (Kimi-K2.5: pack-quantized int4, a scale per group of 32 in the checkpoint's dtype): the
    Linear kinds its `ignore` does not name (matched as compressed-tensors does: `re:` a regex from the start,
    else the exact name; with and without the multimodal wrapper's `language_model.` prefix). fp8 (DeepSeek-V3):
    1 byte, block scales negligible.
    """
    q = text.get("quantization_config") or (top or {}).get("quantization_config")
    if not q:
        return {}, ""
    method = q.get("quant_method")
    ignore = q.get("ignore") or q.get("modules_to_not_convert") or []
    kinds = [k for k, name in QUANT_NAMES.items() if not _ignored(name, ignore)]
    if method == "fp8":
        return dict.fromkeys(kinds, 1.0), "fp8"
    if method != "compressed-tensors":
        raise ValueError(f"cannot size a checkpoint quantized with {method!r}")
    groups = list((q.get("config_groups") or {}).values())
    weights = groups[0].get("weights") if len(groups) == 1 else None
    if not weights or not weights.get("num_bits"):
        raise ValueError("cannot size a compressed-tensors checkpoint without exactly one group of weight settings")
    bits = int(weights["num_bits"])
    scale = DTYPE_BYTES.get(str(weights.get("scale_dtype") or "").removeprefix("torch."), 2)
    group = int(weights.get("group_size") or 0)
    per = bits / 8 + ((scale * (1 if weights.get("symmetric", True) else 2)) / group if group else 0)
    return dict.fromkeys(kinds, per), f"{weights.get('type', 'int')}{bits}, group {group or '-'}"


def _ignored(name: str, ignore: list[str]) -> bool:
    for candidate in (name, f"language_model.{name}"):
        for rule in ignore:
            if rule.startswith("re:") and re.match(rule[3:], candidate) or rule == candidate:
                return True
    return False


def checkpoint_bytes(params: TargetParams, dtype_bytes: int, per_param: dict[str, float]) -> int:
    """The weights' bytes as the checkpoint stores them: quantized kinds packed, the rest in `dtype_bytes`."""
    return int(sum(n * per_param.get(kind, dtype_bytes) for kind, n in params.kinds.items()))


@dataclass(frozen=True)
class MemoryPlan:
    """What one GPU and one node need for a capture setup, against what they have."""

    setup: str  # e.g. "deepspeed zero3, offload cpu, 8 ranks" or "vllm, TP 8"
    gpu_parts: dict[str, int]  # bytes on each GPU, by what holds them
    gpu_limit: int  # bytes usable on one GPU (vllm: x --gpu-memory-utilization)
    host_parts: dict[str, int] = field(default_factory=dict)  # bytes of host RAM per node, by what holds them
    host_limit: int = 0
    nvme_bytes: int = 0  # per node, on capture.nvme_path
    nvme_free: int | None = None  # free there, when it exists
    ways_out: str = ""  # what to change when it does not fit
    note: str = ""  # assumptions (e.g. where TP was read)

    @property
    def gpu_bytes(self) -> int:
        return sum(self.gpu_parts.values())

    @property
    def host_bytes(self) -> int:
        return sum(self.host_parts.values())

    @property
    def fits(self) -> bool:
        return (
            self.gpu_bytes <= self.gpu_limit
            and self.host_bytes <= self.host_limit
            and (self.nvme_free is None or self.nvme_bytes <= self.nvme_free)
        )

    def summary(self) -> str:
        """One line: the GPU and host figures, with their parts."""
        gpu = " + ".join(f"{k} {gib(v)}" for k, v in self.gpu_parts.items() if v)
        host = " + ".join(f"{k} {gib(v)}" for k, v in self.host_parts.items() if v)
        line = f"{self.setup}: GPU {gib(self.gpu_bytes)} of {gib(self.gpu_limit)} per rank ({gpu})"
        line += f"; host {gib(self.host_bytes)} of {gib(self.host_limit)} per node" + (f" ({host})" if host else "")
        if self.nvme_bytes:
            free = f" of {gib(self.nvme_free)} free" if self.nvme_free is not None else ""
            line += f"; NVMe {gib(self.nvme_bytes)}{free} per node"
        return line + (f" [{self.note}]" if self.note else "")


def gib(n: float) -> str:
    """Bytes as GiB, in a smaller unit below one (a tiny target's figures)."""
    from tasks.capture.plan import human_bytes

    return f"{n / GIB:,.1f} GiB" if n >= GIB else human_bytes(n)


def deepspeed_memory(
    params: TargetParams,
    *,
    dtype_bytes: int,
    mode: str,
    offload: str,
    world_size: int,
    ranks_per_node: int,
    max_batch_tokens: int,
    gpu_limit: int,
    host_limit: int,
    nvme_free: int | None = None,
) -> MemoryPlan:
    """The DeepSpeed capture's memory per rank (module docstring), for mode replicate or zero3."""
    weights = params.total * dtype_bytes
    # output_hidden_states keeps layers + 1 [tokens, H] tensors; the aux concatenation adds 3 more
    activations = max_batch_tokens * params.hidden_size * (params.num_layers + 1 + 3) * dtype_bytes
    if mode == "replicate":
        return MemoryPlan(
            f"deepspeed replicate, {world_size} ranks",
            {"whole model": weights, "activations": activations},
            gpu_limit,
            {"model while it loads, per rank": weights * ranks_per_node},
            host_limit,
            ways_out="capture.mode: zero3 (parameters partitioned over the ranks, offload for the largest); "
            "capture.backend: vllm",
        )
    partition = math.ceil(params.total / world_size) * dtype_bytes
    gathered = params.largest_module * dtype_bytes
    gpu = {"partition": partition if offload == "none" else 0, "largest module": gathered, "activations": activations}
    host: dict[str, int] = {}
    nvme = 0
    if offload == "cpu":
        host["pinned partitions"] = partition * ranks_per_node
    elif offload == "nvme":
        buffer = max(int(1e8), params.largest_param)  # ds_inference_config's buffer_size
        host["NVMe swap buffers"] = NVME_BUFFER_COUNT * buffer * dtype_bytes * ranks_per_node
        nvme = partition * ranks_per_node
    ways = [
        f"more ranks (capture.num_gpus, distributed.nnodes): the partition is {gib(weights)} / ranks",
        "capture.offload: cpu or nvme (capture.nvme_path) moves it off the GPU" if offload == "none" else "",
        "capture.offload: nvme (capture.nvme_path) moves the partitions from host RAM to NVMe"
        if offload == "cpu"
        else "",
        f"a lower capture.max_batch_tokens (activations {gib(activations)})",
        "capture.backend: vllm (the checkpoint as it is, split over the GPUs)",
    ]
    if gathered > gpu_limit:
        ways.insert(0, f"the largest module alone ({gib(gathered)}) is more than a GPU has: capture.backend: vllm")
    return MemoryPlan(
        f"deepspeed zero3, offload {offload}, {world_size} ranks",
        gpu,
        gpu_limit,
        host,
        host_limit,
        nvme_bytes=nvme,
        nvme_free=nvme_free if offload == "nvme" else None,
        ways_out="; ".join(w for w in ways if w),
    )


def vllm_memory(
    params: TargetParams,
    text: dict,
    *,
    weights_bytes: int,
    dtype_bytes: int,
    tp: int,
    pp: int,
    max_model_len: int,
    max_num_batched_tokens: int,
    kv_dtype_bytes: int,
    extracted_layers: int,
    gpu_memory: int,
    utilization: float,
    host_limit: int,
    note: str = "",
) -> MemoryPlan:
    """vLLM's memory per GPU (module docstring): the weights split over TP x PP, one longest sequence's KV and
    extracted hidden states, one step's activations, against utilization x the GPU."""
    h, layers = params.hidden_size, math.ceil(params.num_layers / pp)
    if text.get("kv_lora_rank"):  # MLA: the latent and the rope key, the same on every TP rank
        kv_per_token = (int(text["kv_lora_rank"]) + int(text["qk_rope_head_dim"])) * layers * kv_dtype_bytes
    else:
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or h // heads)
        kv_heads = math.ceil(int(text.get("num_key_value_heads") or heads) / tp)
        kv_per_token = 2 * kv_heads * head_dim * layers * kv_dtype_bytes
    hidden_per_token = extracted_layers * h * dtype_bytes  # the extraction's cache: [n, ids, H]
    top_k = int(text.get("num_experts_per_tok") or 0)
    activations = max_num_batched_tokens * h * dtype_bytes * (HIDDEN_COPIES + top_k)  # + the MoE's top-k rows
    return MemoryPlan(
        f"vllm, TP {tp}" + (f" x PP {pp}" if pp > 1 else ""),
        {
            "weights": math.ceil(weights_bytes / (tp * pp)),
            "KV + hidden-state cache": max_model_len * (kv_per_token + hidden_per_token),
            "activations": activations,
        },
        int(gpu_memory * utilization),
        {},
        host_limit,
        ways_out=(
            "a higher --tensor-parallel-size in capture.engine.command (up to the node's GPUs); a lower "
            "--max-model-len or --max-num-batched-tokens (the longest record must still fit); --kv-cache-dtype fp8; "
            "a higher --gpu-memory-utilization; or capture.backend: deepspeed with capture.offload: cpu"
        ),
        note=note,
    )


def check_memory(plan: MemoryPlan) -> None:
    """Raise MemoryTooSmall with the figures and the ways out when `plan` does not fit."""
    if plan.fits:
        return
    what = []
    if plan.gpu_bytes > plan.gpu_limit:
        what.append(f"each GPU needs {gib(plan.gpu_bytes)} but has {gib(plan.gpu_limit)} (distributed.gpu_memory_gib)")
    if plan.host_bytes > plan.host_limit:
        what.append(
            f"each node needs {gib(plan.host_bytes)} of RAM but has {gib(plan.host_limit)} "
            "(distributed.host_memory_gib)"
        )
    if plan.nvme_free is not None and plan.nvme_bytes > plan.nvme_free:
        what.append(f"capture.nvme_path needs {gib(plan.nvme_bytes)} but has {gib(plan.nvme_free)} free")
    raise MemoryTooSmall(f"{plan.summary()}. Too much: {'; '.join(what)}. Ways out: {plan.ways_out}.")
