"""The capture's memory per GPU and per node: Kimi-K2.5's figures against a hand count, and the refusal."""

from __future__ import annotations

import math

import pytest

from tasks.capture.memory import (
    GIB,
    MemoryTooSmall,
    check_memory,
    checkpoint_bytes,
    count_params,
    deepspeed_memory,
    quantized_bytes_per_param,
    vllm_memory,
)
from tests.kimi_k25 import kimi_k25_config

TEXT = kimi_k25_config()["text_config"]

# Kimi-K2.5 by hand (tests/kimi_k25_config.json): H 7168, 61 layers, the first dense, 60 MoE layers of 384 routed
# experts + 1 shared of width 2048, MLA (q rank 1536, kv rank 512, 64 heads of nope 128 + rope 64, v 128), vocab 163840.
H, V = 7168, 163840
ATTENTION = (
    H * 1536  # q_a_proj
    + 1536 * 64 * (128 + 64)  # q_b_proj
    + H * (512 + 64)  # kv_a_proj_with_mqa
    + 512 * 64 * (128 + 128)  # kv_b_proj
    + 64 * 128 * H  # o_proj
)  # 101,122,048 a layer
EXPERT = 3 * H * 2048  # gate, up, down: 44,040,192
ROUTED = 60 * 384 * EXPERT  # 1,014,686,023,680: the INT4 part
SHARED = 60 * 1 * EXPERT
ROUTER = 60 * (384 * H + 384)  # the gate and its correction bias (noaux_tc)
DENSE = 1 * 3 * H * 18432
EMBED = LM_HEAD = V * H
NORMS = 61 * (2 * H + 1536 + 512) + H
TOTAL = 61 * ATTENTION + ROUTED + SHARED + ROUTER + DENSE + EMBED + LM_HEAD + NORMS
INT4 = ROUTED * (4 / 8 + 2 / 32) + (TOTAL - ROUTED) * 2  # packed int4 + a bf16 scale per 32; the rest bf16
MOE_BLOCK = 384 * EXPERT + EXPERT + 384 * H + 384  # a ZeRO-3 leaf: every expert at once


def test_kimi_k25_parameters_by_kind_match_the_hand_count():
    params = count_params(TEXT)
    assert params.kinds == {
        "embed": EMBED,
        "lm_head": LM_HEAD,
        "attention": 61 * ATTENTION,
        "norms": NORMS,
        "dense_mlp": DENSE,
        "shared_experts": SHARED,
        "routed_experts": ROUTED,
        "router": ROUTER,
    }
    assert params.total == TOTAL == 1_026_408_232_448  # ~1.03 T, as published (text model; the vision tower aside)
    assert params.largest_module == MOE_BLOCK == 16_958_226_816
    assert params.largest_param == EMBED


def test_the_int4_checkpoint_is_the_published_size():
    per_param, how = quantized_bytes_per_param(TEXT)
    assert per_param == {"routed_experts": 0.5625} and how == "int4, group 32"  # the ignore list keeps the rest bf16
    size = checkpoint_bytes(count_params(TEXT), 2, per_param)
    assert size == int(INT4) == 594_205_305_856  # ~594 GB: the published ~595 GB less the vision tower
    assert quantized_bytes_per_param({}) == ({}, "")  # no quantization config: the checkpoint's dtype throughout


def _deepspeed(offload: str, **kw):
    args = dict(
        dtype_bytes=2,
        mode="zero3",
        offload=offload,
        world_size=8,
        ranks_per_node=8,
        max_batch_tokens=16384,
        gpu_limit=140 * GIB,
        host_limit=2048 * GIB,
    )
    return deepspeed_memory(count_params(TEXT), **(args | kw))


def test_deepspeed_zero3_per_rank_on_8_gpus():
    partition = math.ceil(TOTAL / 8) * 2  # 256.6 GB = 239.0 GiB of bf16 a rank
    gathered = MOE_BLOCK * 2  # 31.6 GiB
    activations = 16384 * H * (61 + 1 + 3) * 2  # output_hidden_states' 62 + the aux concatenation's 3: 14.2 GiB
    none = _deepspeed("none")
    assert none.gpu_parts == {"partition": partition, "largest module": gathered, "activations": activations}
    assert round(none.gpu_bytes / GIB, 1) == 284.8 and not none.fits  # more than a 140 GiB H200
    cpu = _deepspeed("cpu")
    assert cpu.gpu_bytes == gathered + activations and round(cpu.gpu_bytes / GIB, 1) == 45.8
    assert cpu.host_parts == {"pinned partitions": 8 * partition} and round(cpu.host_bytes / GIB, 1) == 1911.8
    assert cpu.fits  # 1.9 TiB of 2 TiB
    nvme = _deepspeed("nvme", nvme_free=10 * 2**40)
    assert nvme.gpu_bytes == cpu.gpu_bytes and nvme.nvme_bytes == 8 * partition
    assert nvme.host_parts == {"NVMe swap buffers": 8 * 5 * EMBED * 2}  # 5 buffers of the embedding a rank: 87.5 GiB
    assert nvme.fits


def test_vllm_per_gpu_at_tp_8():
    plan = vllm_memory(**_vllm_args())
    kv = 65536 * ((512 + 64) * 61 * 2 + 4 * H * 2)  # MLA latent + rope key (not split by TP) + the extracted states
    assert plan.gpu_parts == {
        "weights": math.ceil(INT4 / 8),  # 69.2 GiB
        "KV + hidden-state cache": kv,  # 7.8 GiB
        "activations": 65536 * H * 2 * (4 + 8),  # 10.5 GiB: the residual stream's copies + the top-8 rows
    }
    assert round(plan.gpu_bytes / GIB, 1) == 87.5 and plan.gpu_limit == int(140 * GIB * 0.9) and plan.fits
    h100 = vllm_memory(**{**_vllm_args(), "gpu_memory": 80 * GIB})
    assert not h100.fits  # 87.5 GiB against 72 GiB: TP 8 on H100s needs a shorter --max-model-len
    with pytest.raises(MemoryTooSmall, match=r"each GPU needs 87.5 GiB but has 72.0 GiB.*--max-model-len"):
        check_memory(h100)


def _vllm_args() -> dict:
    return dict(
        params=count_params(TEXT),
        text=TEXT,
        weights_bytes=int(INT4),
        dtype_bytes=2,
        tp=8,
        pp=1,
        max_model_len=65536,
        max_num_batched_tokens=65536,
        kv_dtype_bytes=2,
        extracted_layers=4,
        gpu_memory=140 * GIB,
        utilization=0.9,
        host_limit=2048 * GIB,
    )


def test_the_refusal_names_the_figures_and_the_ways_out():
    with pytest.raises(MemoryTooSmall) as err:
        check_memory(_deepspeed("none"))
    message = str(err.value)
    assert "each GPU needs 284.8 GiB but has 140.0 GiB (distributed.gpu_memory_gib)" in message
    assert "partition 239.0 GiB" in message and "capture.offload: cpu or nvme" in message and "more ranks" in message
    with pytest.raises(MemoryTooSmall, match=r"each node needs 1,911.8 GiB of RAM but has 1,024.0 GiB.*offload: nvme"):
        check_memory(_deepspeed("cpu", host_limit=1024 * GIB))
    with pytest.raises(MemoryTooSmall, match=r"capture.nvme_path needs 1,911.8 GiB but has 1,024.0 GiB free"):
        check_memory(_deepspeed("nvme", nvme_free=1024 * GIB))
    check_memory(_deepspeed("cpu"))  # fits: nothing raised


def test_a_llama_is_counted_too():
    llama = {
        "hidden_size": 4096,
        "num_hidden_layers": 32,
        "vocab_size": 128256,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 14336,
    }
    layer = 2 * 4096 * 4096 + 2 * 4096 * 8 * 128 + 3 * 4096 * 14336 + 2 * 4096
    assert count_params(llama).total == 32 * layer + 2 * 128256 * 4096 + 4096 == 8_030_261_248  # Llama-3.1-8B
    with pytest.raises(ValueError, match="num_experts"):
        count_params(llama | {"num_experts": 64})
