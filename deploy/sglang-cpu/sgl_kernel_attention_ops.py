"""STAND-IN (eagle3-pipeline, not SGLang): the two attention ops of SGLang's ``intel_amx`` backend, in plain torch.

SGLang 0.5.23's IntelAMXAttnBackend (sglang/srt/layers/attention/intel_amx_backend.py) calls
``torch.ops.sgl_kernel.decode_attention_cpu`` in forward_decode (the draft's multi-step decode included) and
``extend_attention_cpu`` in forward_extend (prefill, EAGLE's target verify and draft extend). Their C++ is
csrc/cpu/decode.cpp and csrc/cpu/extend.cpp in the sgl-project/sglang repository (python/sglang/kernels/aot/csrc/cpu/,
formerly sgl-kernel/csrc/cpu/): decode.cpp read at commit 17b67163, whose ``decode_attention_cpu`` takes the two
KV-cache scales 0.5.23 passes; extend.cpp read at commit a22eb695 (tree mask, KV-shared layers). The schemas are
those of csrc/cpu/torch_extension_cpu.cpp (commit 66b8732c) with what 0.5.23's call sites pass added where that file
lacks it: ``float k_buf_scale, float v_buf_scale`` after the caches in both ops, and ``bool is_causal=True`` last in
extend. Where the two differ the call site wins (no C++ with extend's scales and is_causal was in reach; their
meaning here is decode.cpp's for the scales and "no causal mask among the new tokens" for is_causal=False).

Semantics kept from the C++: paged KV read through ``req_to_token[req_pool_indices[b], :]``; GQA (query head h reads
KV head h // (heads / kv_heads)); logits ``sm_scale * q.k``, then (decode only: extend.cpp takes logit_cap but never
uses it) ``logit_cap * tanh(logits / logit_cap)`` when logit_cap > 0; a sliding window of ``sliding_window_size``
keys when > 0 (SGLang passes the layer's window + 1; 0 turns it off); attention sinks (one logit per head in the
softmax's denominator, no value); float8_e4m3fn caches dequantized by the scales (a bf16 / fp16 cache ignores them);
float32 accumulation, the output in the query's dtype. Queries in bf16 or fp16, as the C++ dispatches
(AT_DISPATCH_REDUCED_FLOATING_TYPES), and (OUR EXTENSION, which the C++ refuses) float32: the CPU tests serve the
target in float32 so that SGLang's greedy tokens and verify rounds can be compared with float32 references token by
token; any other dtype fails loudly. Scratch the C++ uses is not written:
``attn_logits`` is checked for its shape and dtype only (SGLang never reads it back).

Installed and registered as sgl_kernel_speculative_ops.py is (beside common_ops, which registers its
``SCHEMAS`` with their ``IMPLS``). tests/deploy/test_sglang_cpu_attention.py checks each against plain loops of the
C++ semantics.
"""

from __future__ import annotations

import torch

# decode writes key / value into k_cache / v_cache at loc without an alias annotation, as upstream declares it
SCHEMAS = {
    "decode_attention_cpu": (
        "decode_attention_cpu(Tensor query, Tensor k_cache, Tensor v_cache, float k_buf_scale, float v_buf_scale, "
        "Tensor(a!) output, Tensor? key, Tensor? value, Tensor loc, Tensor attn_logits, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, float sm_scale, float logit_cap, bool is_cross_attn, "
        "int sliding_window_size, Tensor? encoder_lens, Tensor? sinks) -> ()"
    ),
    "extend_attention_cpu": (
        "extend_attention_cpu(Tensor q_extend, Tensor? k_extend, Tensor? v_extend, Tensor(a!) o_extend, "
        "Tensor k_buffer, Tensor v_buffer, float k_buf_scale, float v_buf_scale, Tensor req_to_token, "
        "Tensor req_pool_indices, Tensor seq_lens, Tensor extend_seq_lens, Tensor extend_start_loc, "
        "int max_len_extend, float sm_scale, float logit_cap, bool is_cross_attn, int sliding_window_size, "
        "Tensor? encoder_lens, Tensor? sinks, Tensor? tree_mask=None, bool is_causal=True) -> ()"
    ),
}
QUERY_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # float32: ours only (docstring)
FP8 = torch.float8_e4m3fn


def _check(ok: bool, message: str) -> None:
    """TORCH_CHECK: a caller's wrong tensor fails here, as it would in the C++."""
    if not ok:
        raise RuntimeError(message)


def _last_dim_contiguous(name: str, t: torch.Tensor) -> None:
    _check(t.dim() == 3, f"{name} must have 3 dimensions")
    _check(t.stride(-1) == 1, f"{name} must be contiguous at the last dimension")


def _check_common(
    op: str,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_buf_scale: float,
    v_buf_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sinks: torch.Tensor | None,
) -> None:
    for name, t in (("query", query), ("k_cache", k_cache), ("v_cache", v_cache)):
        _last_dim_contiguous(name, t)
    _check(
        query.dtype in QUERY_DTYPES, f"{op} not implemented for {query.dtype} (bf16, fp16, or float32 in this stand-in)"
    )
    _check(k_cache.dtype == v_cache.dtype, "k_buffer and v_buffer should have the same dtype")
    _check(k_cache.dtype in (query.dtype, FP8), f"{op}: a {k_cache.dtype} cache for a {query.dtype} query")
    if k_cache.dtype == FP8:
        _check(k_buf_scale > 0.0 and v_buf_scale > 0.0, "Float8 kv_buffer requires positive static scales")
    _check(req_to_token.dim() == 2, "req_to_token must be [max_num_reqs, max_context_len]")
    _check(req_to_token.dtype in (torch.int32, torch.int64), f"{op}: expect req_to_token to be int32 or int64")
    _check(seq_lens.dtype == torch.int64, f"{op}: expect req_lens to be int64, got {seq_lens.dtype}")
    _check(req_pool_indices.dtype == torch.int64, f"{op}: expect req_pool_indices to be int64")
    _check(req_pool_indices.numel() == seq_lens.numel(), "req_pool_indices: one entry per sequence")
    if sinks is not None:
        _check(sinks.dim() == 1 and sinks.shape[0] == query.shape[1], "sinks must be [num_heads]")


def _dequant(cache: torch.Tensor, scale: float) -> torch.Tensor:
    """A cache's rows as float32: fp8 times its static scale, bf16 / fp16 as they are (the C++ ignores the scale)."""
    return cache.float() * scale if cache.dtype == FP8 else cache.float()


def _write_rows(cache: torch.Tensor, slots: torch.Tensor, rows: torch.Tensor, scale: float) -> None:
    """cache[slots] = rows, divided by the scale into fp8 for an fp8 cache (decode.cpp ``decode_set_kv_buffer``)."""
    if cache.dtype == FP8:
        cache[slots] = (rows.float() / scale).to(FP8)
    else:
        cache[slots] = rows.to(cache.dtype)


def _attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    allowed: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Softmax attention of one request in float32: q [T, H, D], k [S, Hkv, D], v [S, Hkv, Dv], allowed [T, S]
    (False: masked out); returns [T, H, Dv]. Head h reads KV head h // (H // Hkv)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)  # [S, H, D]
    v = v.repeat_interleave(group, dim=1)  # [S, H, Dv]
    scores = torch.einsum("thd,shd->hts", q, k) * sm_scale  # [H, T, S]
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:  # the sink joins the denominator only: a column of logits whose value row is zero
        sink_column = sinks.float().view(-1, 1, 1).expand(-1, scores.shape[1], 1)
        weights = torch.softmax(torch.cat([scores, sink_column], dim=-1), dim=-1)[..., :-1]
    else:
        weights = torch.softmax(scores, dim=-1)  # [H, T, S]
    return torch.einsum("hts,shd->thd", weights, v)


def _window(allowed: torch.Tensor, query_pos: torch.Tensor, key_pos: torch.Tensor, size: int) -> torch.Tensor:
    """Keep only keys less than `size` positions behind their query (size <= 0: no window)."""
    if size <= 0:
        return allowed
    return allowed & (query_pos.view(-1, 1) - key_pos.view(1, -1) < size)


def decode_attention_cpu(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_buf_scale: float,
    v_buf_scale: float,
    output: torch.Tensor,
    key: torch.Tensor | None,
    value: torch.Tensor | None,
    loc: torch.Tensor,
    attn_logits: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> None:
    """One new token per sequence attends to its whole cached sequence; the new K and V are stored first.

    Follows ``decode_attention_cpu`` in csrc/cpu/decode.cpp (MHA, GQA/MQA and MLA kernels: one semantics). query
    [num_seqs, H, D]; output [num_seqs, H, Dv], written; k_cache [slots, Hkv, D], v_cache [slots, Hkv, Dv]. With key
    and value ([num_seqs, Hkv, D / Dv]), row b goes to cache slot loc[b] (int64) first (MLA, where the caches share
    storage: the key only). Sequence b reads slots ``req_to_token[req_pool_indices[b], off : off + len]``: len =
    seq_lens[b] (encoder_lens[b] for cross attention), off = encoder_lens[b] when given (self attention) else 0; a
    sliding window W > 0 shorter than len reads the last W instead. A sequence of length 0 has no defined output
    (the C++ divides by a zero sum).
    """
    _check_common(
        "decode", query, k_cache, v_cache, k_buf_scale, v_buf_scale, req_to_token, req_pool_indices, seq_lens, sinks
    )
    _check(loc.dim() == 1, "loc must be 1-D")
    num_seqs, num_heads = seq_lens.shape[0], query.shape[1]
    head_size_v = v_cache.shape[2]
    _check(
        attn_logits.dtype == torch.float32
        and attn_logits.dim() == 4
        and tuple(attn_logits.shape[:2]) == (num_seqs, num_heads)
        and attn_logits.shape[3] == head_size_v + 1,
        "attn_logits must be float32 [num_seqs, num_heads, num_kv_splits, head_size_v + 1]",
    )
    _check(num_heads % k_cache.shape[1] == 0, "num_heads must be a multiple of the KV heads")
    is_mla = k_cache.data_ptr() == v_cache.data_ptr() and k_cache.shape[1] == 1 and query.shape[2] == head_size_v + 64
    if is_mla:
        _check(logit_cap == 0.0, "decode MLA: expect no logit_cap.")
        _check(key is not None and value is not None, "MLA requires key and value tensors")
    if is_cross_attn or encoder_lens is not None:
        _check(encoder_lens is not None and encoder_lens.numel() == num_seqs, "encoder_lens: one per sequence")
    if key is not None or value is not None:
        _check(key is not None and value is not None, "key and value should have values at the same time")
        assert key is not None and value is not None
        _check(loc.numel() == num_seqs and loc.dtype == torch.int64, "loc must be int64, one slot per sequence")
        _last_dim_contiguous("key", key)
        _last_dim_contiguous("value", value)
        _write_rows(k_cache, loc, key, k_buf_scale)
        if not is_mla:
            _write_rows(v_cache, loc, value, v_buf_scale)

    max_context_len = req_to_token.shape[1]
    rows = req_pool_indices.tolist()
    lens = (encoder_lens if is_cross_attn and encoder_lens is not None else seq_lens).tolist()
    offsets = encoder_lens.tolist() if encoder_lens is not None and not is_cross_attn else [0] * num_seqs
    for b in range(num_seqs):
        length, offset = lens[b], offsets[b]
        if 0 < sliding_window_size < length:
            offset, length = length - sliding_window_size, sliding_window_size
        _check(length <= max_context_len, "seq_len_kv out of scope!")
        _check(rows[b] < req_to_token.shape[0], "req_pool_id out of scope!")
        slots = req_to_token[rows[b], offset : offset + length].long()
        _check(bool((slots < k_cache.shape[0]).all()), "token index out of scope!")
        k = _dequant(k_cache[slots], k_buf_scale)
        v = _dequant(v_cache[slots], v_buf_scale)
        allowed = torch.ones(1, length, dtype=torch.bool)
        out = _attend(query[b : b + 1].float(), k, v, allowed, sm_scale, logit_cap, sinks)
        output[b] = out[0].to(output.dtype)


def extend_attention_cpu(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor | None,
    v_extend: torch.Tensor | None,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    k_buf_scale: float,
    v_buf_scale: float,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    extend_start_loc: torch.Tensor,
    max_len_extend: int,
    sm_scale: float,
    logit_cap: float,
    is_cross_attn: bool,
    sliding_window_size: int,
    encoder_lens: torch.Tensor | None,
    sinks: torch.Tensor | None,
    tree_mask: torch.Tensor | None = None,
    is_causal: bool = True,
) -> None:
    """Each sequence's new tokens attend to its cached prefix and, causally, to the new tokens themselves.

    Follows ``extend_attention_cpu`` in csrc/cpu/extend.cpp. Sequence b owns rows [s, s + n) of q_extend [tokens, H,
    D], k_extend / v_extend [tokens, Hkv, D / Dv] and o_extend [tokens, H, Dv] (written), s = extend_start_loc[b], n =
    extend_seq_lens[b]; its prefix of p = seq_lens[b] - n tokens is read from the caches through
    ``req_to_token[req_pool_indices[b], off : off + p]`` (off: encoder_lens[b] when given, else 0). New token i (at
    position p + i) sees every prefix key and new key j when j <= i; with ``tree_mask`` (bool, [bs * n * n],
    TreeMaskMode.QLEN_ONLY, n == max_len_extend for every sequence) when tree_mask[b, i, j] instead; with
    is_causal=False every new key. Without k_extend / v_extend (a KV-shared layer) all p + n keys come from the cache,
    causally. Cross attention reads encoder_lens[b] cached keys, no new ones. logit_cap is accepted and unused, as in
    the C++. head_size and head_size_v must be multiples of 32 (the C++ packs 512-bit rows).
    """
    _check_common(
        "extend",
        q_extend,
        k_buffer,
        v_buffer,
        k_buf_scale,
        v_buf_scale,
        req_to_token,
        req_pool_indices,
        seq_lens,
        sinks,
    )
    _check((k_extend is None) == (v_extend is None), "k_extend and v_extend must be given together")
    kv_from_cache = not is_cross_attn and k_extend is None
    k_ext = k_extend if k_extend is not None else k_buffer
    v_ext = v_extend if v_extend is not None else v_buffer
    _check(o_extend.is_contiguous(), "o_extend must be contiguous")
    _last_dim_contiguous("k_extend", k_ext)
    _last_dim_contiguous("v_extend", v_ext)
    num_seqs, num_heads, head_size = seq_lens.shape[0], q_extend.shape[1], q_extend.shape[2]
    num_heads_kv, head_size_v = k_ext.shape[1], v_ext.shape[2]
    _check(extend_seq_lens.numel() == num_seqs and extend_start_loc.numel() == num_seqs, "extend_* size")
    _check(v_ext.shape[1] == num_heads_kv and k_buffer.shape[1] == v_buffer.shape[1], "KV head counts")
    _check(num_heads % num_heads_kv == 0, "num_heads must be a multiple of the KV heads")
    _check(
        extend_seq_lens.dtype == req_to_token.dtype and extend_start_loc.dtype == req_to_token.dtype,
        "extend: expect extend_seq_lens and extend_start_loc to have same dtype as req_to_token.",
    )
    _check(head_size % 32 == 0, f"invalid head_size {head_size}")
    _check(head_size_v % 32 == 0, f"invalid head_size_v {head_size_v}")
    is_prefix_skipped = k_buffer.shape[1] != num_heads_kv  # MLA: the prefix is not read here
    if is_cross_attn or encoder_lens is not None:
        _check(encoder_lens is not None and encoder_lens.numel() == num_seqs, "encoder_lens: one per sequence")
    if tree_mask is not None:
        _check(tree_mask.dtype == torch.bool, f"extend: expect tree_mask to be bool, got {tree_mask.dtype}")
        _check(tree_mask.numel() == num_seqs * max_len_extend * max_len_extend, "extend: tree_mask numel")
        _check(not is_cross_attn, "extend: tree_mask is not supported for cross attention")
        _check(not kv_from_cache, "extend: tree_mask is not supported for KV-shared layers")
        _check(sliding_window_size <= 0, "extend: tree_mask is not supported with sliding window attention")

    max_context_len = req_to_token.shape[1]
    rows, lens = req_pool_indices.tolist(), seq_lens.tolist()
    ext_lens, starts = extend_seq_lens.tolist(), extend_start_loc.tolist()
    offsets = encoder_lens.tolist() if encoder_lens is not None and not is_cross_attn else [0] * num_seqs
    for b in range(num_seqs):
        n, start, row = ext_lens[b], starts[b], rows[b]
        prefix = lens[b] - n
        _check(prefix >= 0, "prefix len < 0!")
        _check(lens[b] <= max_context_len, "seq_len out of scope!")
        _check(row < req_to_token.shape[0], "req_pool_id out of scope!")
        _check(not is_prefix_skipped or prefix == 0, f"extend attention: expect seq_len_prefix to be 0, got {prefix}")
        _check(tree_mask is None or n == max_len_extend, "extend attention: tree_mask requires uniform extend_seq_lens")
        if n <= 0:
            continue
        query_pos = prefix + torch.arange(n)
        if is_cross_attn:
            assert encoder_lens is not None
            cached = int(encoder_lens[b])
        else:
            cached = prefix + n if kv_from_cache else prefix
        slots = req_to_token[row, offsets[b] : offsets[b] + cached].long()
        _check(bool((slots < k_buffer.shape[0]).all()), "token index out of scope!")
        if is_prefix_skipped:  # prefix 0 (checked above): the cache's rows are MLA's latent, never these heads'
            k, v = k_ext[:0].float(), v_ext[:0].float()
        else:
            k = _dequant(k_buffer[slots], k_buf_scale)  # [cached, Hkv, D]
            v = _dequant(v_buffer[slots], v_buf_scale)
        allowed = torch.ones(n, cached, dtype=torch.bool)
        if kv_from_cache:
            allowed = torch.arange(cached).view(1, -1) <= query_pos.view(-1, 1)
        key_pos = torch.arange(cached)
        if not is_cross_attn and not kv_from_cache:  # stage 2: the new tokens' own keys
            k = torch.cat([k, k_ext[start : start + n].float()])
            v = torch.cat([v, v_ext[start : start + n].float()])
            if tree_mask is not None:
                own = tree_mask.view(num_seqs, n, n)[b]
            elif is_causal:
                own = torch.ones(n, n, dtype=torch.bool).tril()
            else:
                own = torch.ones(n, n, dtype=torch.bool)
            allowed = torch.cat([allowed, own], dim=1)
            key_pos = torch.arange(prefix + n)
        allowed = _window(allowed, query_pos, key_pos, sliding_window_size)
        out = _attend(q_extend[start : start + n].float(), k, v, allowed, sm_scale, 0.0, sinks)
        o_extend[start : start + n] = out.to(o_extend.dtype)


IMPLS = {"decode_attention_cpu": decode_attention_cpu, "extend_attention_cpu": extend_attention_cpu}
