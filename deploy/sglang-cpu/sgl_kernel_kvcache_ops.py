"""STAND-IN (eagle3-pipeline, not SGLang): SGLang's two CPU KV-cache ops, written in plain torch.

``store_cache_cpu`` (sglang/srt/mem_cache/memory_pool.py, on a CPU with AMX) and ``copy_all_layer_kv_cache_cpu``
(sglang/kernels/ops/kvcache/cache_move.py via sgl_kernel/kvcache.py: the KV pool's slot moves, which EAGLE's
accepted-token compaction and the pool's warm-up at start call). Their C++ (sgl-kernel/csrc/cpu/kvcache.cpp in
the sgl-project/sglang repository, read at commit 0e71686f) ships in no registry package; these follow its
semantics and are registered under the same ``torch.ops.sgl_kernel`` names with the schemas of that repository's
csrc/cpu/torch_extension_cpu.cpp. tests/deploy/test_sglang_cpu_ops.py checks each against a plain loop of that C++.

Installed and registered as sgl_kernel_speculative_ops.py is (beside common_ops, which registers its
``SCHEMAS`` with their ``IMPLS``).
"""

from __future__ import annotations

import ctypes

import torch

SCHEMAS = {
    "store_cache_cpu": (
        "store_cache_cpu(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(a!) v_cache, Tensor indices, "
        "int? row_dim) -> ()"
    ),
    # the copy writes the buffers behind raw addresses, which no schema alias annotation can name (as upstream)
    "copy_all_layer_kv_cache_cpu": (
        "copy_all_layer_kv_cache_cpu(Tensor data_ptrs, Tensor strides, Tensor tgt_loc, Tensor src_loc) -> ()"
    ),
}
# the C++ dispatches on bf16, fp16 and uint8 (fp8 KV stored as bytes) only
CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.uint8)


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise RuntimeError(message)


def _rows_contiguous(name: str, t: torch.Tensor) -> None:
    _check(t.dim() == 3, f"{name} must have 3 dimensions")
    _check(t.stride(2) == 1 and t.stride(1) == t.shape[2], f"{name} must be contiguous at the last two dimensions")


def store_cache_cpu(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    indices: torch.Tensor,
    row_dim: int | None,
) -> None:
    """Write each token's K and V rows into the cache slots ``indices``: k_cache[indices[i]] = k[i], likewise v.

    Follows ``store_cache_cpu`` in csrc/cpu/kvcache.cpp. k, v [tokens, heads, head_dim]; k_cache, v_cache [slots,
    heads, head_dim], each contiguous in its last two dimensions (dim 0 may be strided); one dtype of bf16, fp16,
    uint8; indices int32 or int64 [tokens]; row_dim, when given, equal to heads * head_dim.
    """
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        _rows_contiguous(name, t)
    _check(indices.is_contiguous() and indices.dtype in (torch.int32, torch.int64), "indices must be int64 or int32")
    _check(row_dim is None or row_dim == k.shape[1] * k.shape[2], f"row_dim {row_dim} != heads * head_dim")
    _check(indices.shape[0] == k.shape[0], "indices must have one entry per token")
    _check(len({k.dtype, v.dtype, k_cache.dtype, v_cache.dtype}) == 1, "store_cache_cpu: one dtype for all tensors")
    _check(k.dtype in CACHE_DTYPES, f"store_cache_cpu not implemented for {k.dtype}")
    slots = indices.long()
    k_cache.index_copy_(0, slots, k.reshape(-1, *k_cache.shape[1:]))
    v_cache.index_copy_(0, slots, v.reshape(-1, *v_cache.shape[1:]))


def copy_all_layer_kv_cache_cpu(
    data_ptrs: torch.Tensor, strides: torch.Tensor, tgt_loc: torch.Tensor, src_loc: torch.Tensor
) -> None:
    """In every KV buffer, copy the slot rows ``src_loc`` to ``tgt_loc``: buf[tgt_loc[i]] = buf[src_loc[i]].

    Follows ``copy_all_layer_kv_cache_cpu`` in csrc/cpu/kvcache.cpp. The buffers are named by raw base addresses
    (data_ptrs, uint64 [buffers]) and row widths in bytes (strides, int64 [buffers]), as SGLang's KV pool passes them
    (memory_pool.py ``_init_data_ptrs_and_strides``). Per buffer, all source rows are read before any target row is
    written, so overlapping locations copy as if at once. Each buffer is viewed as bytes in place (ctypes), to the
    highest row the locations name.
    """
    for name, t in (("data_ptrs", data_ptrs), ("strides", strides), ("tgt_loc", tgt_loc), ("src_loc", src_loc)):
        _check(t.is_contiguous(), f"{name} must be contiguous")
    _check(data_ptrs.dtype == torch.uint64 and strides.dtype == torch.int64, "data_ptrs uint64, strides int64")
    _check(tgt_loc.dtype == src_loc.dtype and tgt_loc.dtype in (torch.int32, torch.int64), "locs: one index dtype")
    _check(strides.numel() == data_ptrs.numel() and src_loc.numel() == tgt_loc.numel(), "sizes must match")
    if data_ptrs.numel() == 0 or tgt_loc.numel() == 0:
        return
    tgt, src = tgt_loc.long(), src_loc.long()
    rows = int(torch.maximum(tgt.max(), src.max())) + 1
    for address, stride in zip(data_ptrs.tolist(), strides.tolist()):
        buffer = torch.frombuffer((ctypes.c_uint8 * (rows * stride)).from_address(address), dtype=torch.uint8)
        buffer = buffer.view(rows, stride)
        buffer[tgt] = buffer[src]  # the right side is gathered into a new tensor first


IMPLS = {"store_cache_cpu": store_cache_cpu, "copy_all_layer_kv_cache_cpu": copy_all_layer_kv_cache_cpu}
