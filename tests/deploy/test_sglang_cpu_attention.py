"""The stand-in attention ops of SGLang's intel_amx backend (deploy/sglang-cpu/sgl_kernel_attention_ops.py).

Each op is called as intel_amx_backend.py calls it, through ``torch.ops.sgl_kernel``, on a paged KV cache (requests
in scattered rows of req_to_token, their tokens in shuffled cache slots), and compared with plain loops written from
the C++ (csrc/cpu/decode.cpp, csrc/cpu/extend.cpp): per request, per head, per query token, the logits, their cap,
the softmax and the weighted sum written out in Python floats. The ops' inputs are fp16 or bf16 (all the C++ takes);
the loops read the same rounded values. Tolerance: rtol = the output dtype's eps (at least twice the rounding of the
output to that dtype) and atol 1e-5 (float32 accumulation).
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path

import pytest
import torch

OPS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "sglang-cpu"
ops = torch.ops.sgl_kernel
HEADS, KV_HEADS = 4, 2  # GQA: query heads 0, 1 read KV head 0, heads 2, 3 read KV head 1
SLOTS, MAX_REQS, MAX_CONTEXT = 64, 6, 24
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@pytest.fixture(scope="module", autouse=True)
def registered():
    # common_ops registers every op file beside it, as sgl_kernel loads it
    spec = importlib.util.spec_from_file_location("sgl_kernel_common_ops", OPS_DIR / "sgl_kernel_common_ops.py")
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))


def assert_matches(out: torch.Tensor, expected: list) -> float:
    """The op's output against the loop's, within the module's tolerance; returns the largest difference."""
    reference = torch.tensor(expected, dtype=torch.float64).view(out.shape)
    eps = torch.finfo(out.dtype).eps
    torch.testing.assert_close(out.double(), reference, rtol=eps, atol=1e-5)
    return float((out.double() - reference).abs().max()) if out.numel() else 0.0


# --- the reference: one query row of one head, as the C++ computes it --------------------------------------------


def ref_row(q, keys, values, visible, sm_scale, logit_cap=0.0, sink=None):
    """Attention of one query over the visible (key, value) rows: logits, cap, softmax with the sink, weighted sum."""
    logits = []
    for j, key in enumerate(keys):
        if not visible[j]:
            continue
        s = sm_scale * sum(a * b for a, b in zip(q, key))
        if logit_cap > 0:
            s = logit_cap * math.tanh(s / logit_cap)
        logits.append((s, j))
    top = max(s for s, _ in logits)
    denominator = sum(math.exp(s - top) for s, _ in logits)
    if sink is not None:
        denominator += math.exp(sink - top)
    return [sum(math.exp(s - top) * values[j][d] for s, j in logits) / denominator for d in range(len(values[0]))]


def ref_decode(q, k_cache, v_cache, req_to_token, rows, seq_lens, sm_scale, logit_cap, window, sinks):
    """decode.cpp: each sequence's one query over its cached tokens (the last `window` when the window is shorter)."""
    out = []
    group = len(q[0]) // len(k_cache[0])
    for b, (row, length) in enumerate(zip(rows, seq_lens)):
        offset = 0
        if 0 < window < length:
            offset, length = length - window, window
        slots = [req_to_token[row][offset + i] for i in range(length)]
        for h in range(len(q[0])):
            keys = [k_cache[s][h // group] for s in slots]
            values = [v_cache[s][h // group] for s in slots]
            sink = None if sinks is None else sinks[h]
            out.append(ref_row(q[b][h], keys, values, [True] * length, sm_scale, logit_cap, sink))
    return out


def ref_extend(q, k_new, v_new, k_cache, v_cache, req_to_token, rows, seq_lens, ext_lens, starts, sm_scale, **opts):
    """extend.cpp: new token i of a sequence over its cached prefix (stage 1) and the new keys j <= i (stage 2), or
    the tree mask's, or every new key when not causal; sinks per head."""
    tree_mask, causal, sinks = opts.get("tree_mask"), opts.get("is_causal", True), opts.get("sinks")
    out = [None] * (sum(ext_lens) * len(q[0]))
    group = len(q[0]) // len(k_cache[0])
    for b, (row, length, n, start) in enumerate(zip(rows, seq_lens, ext_lens, starts)):
        prefix = length - n
        slots = [req_to_token[row][j] for j in range(prefix)]
        for i in range(n):
            visible = [True] * prefix
            for j in range(n):
                if tree_mask is not None:
                    visible.append(tree_mask[b * n * n + i * n + j])
                else:
                    visible.append(j <= i or not causal)
            for h in range(len(q[0])):
                keys = [k_cache[s][h // group] for s in slots] + [k_new[start + j][h // group] for j in range(n)]
                values = [v_cache[s][h // group] for s in slots] + [v_new[start + j][h // group] for j in range(n)]
                sink = None if sinks is None else sinks[h]
                out[(start + i) * len(q[0]) + h] = ref_row(q[start + i][h], keys, values, visible, sm_scale, 0.0, sink)
    return out


# --- a paged batch -------------------------------------------------------------------------------------------------


def paged(seq_lens, rows, head, dtype, seed=0):
    """A KV cache of shuffled slots and a req_to_token whose row rows[b] names sequence b's seq_lens[b] slots."""
    gen = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(SLOTS, KV_HEADS, head, generator=gen).to(dtype)
    v_cache = torch.randn(SLOTS, KV_HEADS, head, generator=gen).to(dtype)
    free = torch.randperm(SLOTS, generator=gen).tolist()
    req_to_token = torch.full((MAX_REQS, MAX_CONTEXT), SLOTS - 1, dtype=torch.int32)
    for row, length in zip(rows, seq_lens):
        req_to_token[row, :length] = torch.tensor([free.pop() for _ in range(length)], dtype=torch.int32)
    return k_cache, v_cache, req_to_token, gen


def decode(query, k_cache, v_cache, req_to_token, rows, seq_lens, key=None, value=None, loc=None, **opts):
    bs = len(seq_lens)
    output = torch.empty(bs, HEADS, v_cache.shape[2], dtype=query.dtype)
    attn_logits = torch.empty(bs, HEADS, 8, v_cache.shape[2] + 1)  # 8 KV splits, as the backend sizes it
    ops.decode_attention_cpu(
        query,
        k_cache,
        v_cache,
        opts.get("k_scale", 1.0),
        opts.get("v_scale", 1.0),
        output,
        key,
        value,
        loc if loc is not None else torch.zeros(bs, dtype=torch.int64),
        attn_logits,
        req_to_token,
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(seq_lens, dtype=torch.int64),
        opts.get("sm_scale", 0.25),
        opts.get("logit_cap", 0.0),
        False,
        opts.get("window", 0),
        None,
        opts.get("sinks"),
    )
    return output


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("logit_cap, with_sinks", [(0.0, False), (2.0, True)])
def test_decode_matches_the_loop(dtype, logit_cap, with_sinks):
    # four sequences, one of length 1, in scattered pool rows; the new token's K and V are written by the op at its
    # slot (the sequence's last, as SGLang allocates it) before attending
    rows, seq_lens, head = [3, 0, 5, 1], [1, 6, 11, 4], 16
    k_cache, v_cache, req_to_token, gen = paged(seq_lens, rows, head, dtype)
    query = torch.randn(4, HEADS, head, generator=gen).to(dtype)
    key = torch.randn(4, KV_HEADS, head, generator=gen).to(dtype)
    value = torch.randn(4, KV_HEADS, head, generator=gen).to(dtype)
    loc = torch.tensor([int(req_to_token[r, n - 1]) for r, n in zip(rows, seq_lens)])
    sinks = torch.randn(HEADS, generator=gen).to(dtype) if with_sinks else None
    stored_k, stored_v = k_cache.clone(), v_cache.clone()
    stored_k[loc], stored_v[loc] = key, value
    out = decode(
        query, k_cache, v_cache, req_to_token, rows, seq_lens, key, value, loc, logit_cap=logit_cap, sinks=sinks
    )
    assert torch.equal(k_cache, stored_k) and torch.equal(v_cache, stored_v)
    expected = ref_decode(
        query.float().tolist(),
        stored_k.float().tolist(),
        stored_v.float().tolist(),
        req_to_token.tolist(),
        rows,
        seq_lens,
        0.25,
        logit_cap,
        0,
        None if sinks is None else sinks.float().tolist(),
    )
    assert_matches(out, expected)


def test_decode_sliding_window_reads_the_last_keys():
    rows, seq_lens, head = [2, 4], [9, 2], 8  # head_dim 8: decode has no multiple-of-32 rule
    k_cache, v_cache, req_to_token, gen = paged(seq_lens, rows, head, torch.float16, seed=1)
    query = torch.randn(2, HEADS, head, generator=gen).to(torch.float16)
    out = decode(query, k_cache, v_cache, req_to_token, rows, seq_lens, window=4)
    caches = k_cache.float().tolist(), v_cache.float().tolist()
    expected = ref_decode(query.float().tolist(), *caches, req_to_token.tolist(), rows, seq_lens, 0.25, 0.0, 4, None)
    assert_matches(out, expected)
    full = ref_decode(query.float().tolist(), *caches, req_to_token.tolist(), rows, seq_lens, 0.25, 0.0, 0, None)
    assert not torch.allclose(out[0].double(), torch.tensor(full[:HEADS], dtype=torch.float64), atol=1e-3)


def test_decode_reads_an_fp8_cache_through_its_scales():
    rows, seq_lens, head = [1, 0], [5, 3], 16
    k_cache, v_cache, req_to_token, gen = paged(seq_lens, rows, head, torch.bfloat16, seed=2)
    k8, v8 = (k_cache.float() / 0.5).to(torch.float8_e4m3fn), (v_cache.float() / 0.25).to(torch.float8_e4m3fn)
    query = torch.randn(2, HEADS, head, generator=gen).to(torch.bfloat16)
    out = decode(query, k8, v8, req_to_token, rows, seq_lens, k_scale=0.5, v_scale=0.25)
    caches = (k8.float() * 0.5).tolist(), (v8.float() * 0.25).tolist()
    assert_matches(
        out, ref_decode(query.float().tolist(), *caches, req_to_token.tolist(), rows, seq_lens, 0.25, 0, 0, None)
    )


def test_decode_on_an_empty_batch():
    k_cache, v_cache, req_to_token, _ = paged([], [], 16, torch.bfloat16)
    out = decode(torch.empty(0, HEADS, 16, dtype=torch.bfloat16), k_cache, v_cache, req_to_token, [], [])
    assert out.shape == (0, HEADS, 16)


def extend(q, k_new, v_new, k_cache, v_cache, req_to_token, rows, seq_lens, ext_lens, **opts):
    starts = [sum(ext_lens[:b]) for b in range(len(ext_lens))]
    o = torch.empty(q.shape[0], HEADS, v_cache.shape[2], dtype=q.dtype)
    ops.extend_attention_cpu(
        q,
        k_new,
        v_new,
        o,
        k_cache,
        v_cache,
        1.0,
        1.0,
        req_to_token,
        torch.tensor(rows, dtype=torch.int64),
        torch.tensor(seq_lens, dtype=torch.int64),
        torch.tensor(ext_lens, dtype=torch.int32),  # the dtype of req_to_token, as the C++ requires
        torch.tensor(starts, dtype=torch.int32),
        max(ext_lens, default=0),
        opts.get("sm_scale", 0.125),
        0.0,
        False,
        0,
        None,
        opts.get("sinks"),
        opts.get("tree_mask"),
        opts.get("is_causal", True),
    )
    return o, starts


def extend_batch(prefixes, ext_lens, dtype, seed=0):
    rows, head = [4, 1, 0, 3][: len(prefixes)], 32  # extend.cpp packs 512-bit rows: head sizes are multiples of 32
    seq_lens = [p + n for p, n in zip(prefixes, ext_lens)]
    k_cache, v_cache, req_to_token, gen = paged(seq_lens, rows, head, dtype, seed)
    tokens = sum(ext_lens)
    q = torch.randn(tokens, HEADS, head, generator=gen).to(dtype)
    k_new = torch.randn(tokens, KV_HEADS, head, generator=gen).to(dtype)
    v_new = torch.randn(tokens, KV_HEADS, head, generator=gen).to(dtype)
    return q, k_new, v_new, k_cache, v_cache, req_to_token, rows, seq_lens


def expected_extend(batch, ext_lens, starts, **opts):
    q, k_new, v_new, k_cache, v_cache, req_to_token, rows, seq_lens = batch
    floats = [t.float().tolist() for t in (q, k_new, v_new, k_cache, v_cache)]
    return ref_extend(*floats, req_to_token.tolist(), rows, seq_lens, ext_lens, starts, 0.125, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_extend_matches_the_loop(dtype, with_sinks):
    # a prefill (no prefix), a request extending by 1, a long prefix extending by 5 (its K/V not yet in the cache:
    # extend_attention_cpu reads the new keys from k_extend / v_extend)
    prefixes, ext_lens = [0, 4, 7], [3, 1, 5]
    batch = extend_batch(prefixes, ext_lens, dtype)
    sinks = torch.randn(HEADS, generator=torch.Generator().manual_seed(5)).to(dtype) if with_sinks else None
    out, starts = extend(*batch, ext_lens, sinks=sinks)
    sink_list = None if sinks is None else sinks.float().tolist()
    assert_matches(out, expected_extend(batch, ext_lens, starts, sinks=sink_list))


def test_extend_with_a_tree_mask():
    # target verify with topk > 1: 4 draft tokens per request, root 0, nodes 1 and 2 its children, 3 under 1
    n, mask_rows = 4, [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    tree_mask = torch.tensor([mask_rows, mask_rows], dtype=torch.bool).view(-1)
    batch = extend_batch([6, 2], [n, n], torch.float16, seed=3)
    out, starts = extend(*batch, [n, n], tree_mask=tree_mask)
    assert_matches(out, expected_extend(batch, [n, n], starts, tree_mask=tree_mask.tolist()))


def test_extend_chain_needs_no_mask():
    # EAGLE topk 1 (QLEN_ONLY): the backend drops the chain's mask, whose rows are exactly the causal ones
    batch = extend_batch([5, 3, 9], [4, 4, 4], torch.bfloat16, seed=4)
    causal = torch.ones(4, 4, dtype=torch.bool).tril().repeat(3, 1, 1).view(-1)
    assert torch.equal(extend(*batch, [4] * 3)[0], extend(*batch, [4] * 3, tree_mask=causal)[0])


def test_extend_not_causal_sees_every_new_token():
    batch = extend_batch([2, 0], [3, 2], torch.float16, seed=6)
    out, starts = extend(*batch, [3, 2], is_causal=False)
    assert_matches(out, expected_extend(batch, [3, 2], starts, is_causal=False))


def test_an_mla_prefill_as_mha_reads_nothing_from_the_latent_cache():
    """SGLang prefills an MLA layer as plain multi-head attention (deepseek_v2.py, MHA for a fresh prefill): k and v
    with heads of their own, the cache one latent head wide, which extend.cpp then does not read (is_prefix_skipped,
    prefix 0). Before: the empty latent rows were concatenated with the new keys ("Sizes of tensors must match")."""
    gen = torch.Generator().manual_seed(8)
    ext_lens, rows = [3, 2], [2, 5]
    starts, tokens = [0, 3], sum(ext_lens)
    q, k_new = (torch.randn(tokens, HEADS, 64, generator=gen) for _ in range(2))
    v_new = torch.randn(tokens, HEADS, 32, generator=gen)
    latent = torch.randn(SLOTS, 1, 96, generator=gen)  # kv_lora_rank + rope dims, one head
    req_to_token = torch.arange(MAX_REQS * MAX_CONTEXT, dtype=torch.int32).view(MAX_REQS, MAX_CONTEXT) % SLOTS
    o = torch.empty(tokens, HEADS, 32)
    ops.extend_attention_cpu(
        *(q, k_new, v_new, o, latent, latent[..., :64], 1.0, 1.0, req_to_token, torch.tensor(rows)),
        *(torch.tensor(ext_lens), torch.tensor(ext_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32)),
        *(3, 0.125, 0.0, False, 0, None, None, None, True),
    )
    # no prefix: the loop reads only the new keys (the "cache" it is given has their heads but is never read)
    floats = [t.tolist() for t in (q, k_new, v_new, k_new, v_new)]
    assert_matches(o, ref_extend(*floats, req_to_token.tolist(), rows, ext_lens, ext_lens, starts, 0.125))
    with pytest.raises(RuntimeError, match="expect seq_len_prefix to be 0, got 1"):  # a prefix there: refused
        ops.extend_attention_cpu(
            *(q[:2], k_new[:2], v_new[:2], o[:2], latent, latent[..., :64], 1.0, 1.0, req_to_token),
            *(torch.tensor([2]), torch.tensor([3]), torch.tensor([2], dtype=torch.int32)),
            *(torch.tensor([0], dtype=torch.int32), 2, 0.125, 0.0, False, 0, None, None, None, True),
        )


def test_extend_without_new_kv_reads_them_from_the_cache():
    # a KV-shared layer: k_extend / v_extend None, the new tokens' K/V already in the cache at prefix + i
    prefixes, ext_lens = [3, 0], [2, 4]
    batch = extend_batch(prefixes, ext_lens, torch.float16, seed=7)
    q, k_new, v_new, k_cache, v_cache, req_to_token, rows, seq_lens = batch
    for b, (row, prefix) in enumerate(zip(rows, prefixes)):
        slots = req_to_token[row, prefix : seq_lens[b]].long()
        k_cache[slots] = k_new[sum(ext_lens[:b]) : sum(ext_lens[: b + 1])]
        v_cache[slots] = v_new[sum(ext_lens[:b]) : sum(ext_lens[: b + 1])]
    out, starts = extend(q, None, None, k_cache, v_cache, req_to_token, rows, seq_lens, ext_lens)
    assert_matches(out, expected_extend(batch, ext_lens, starts))


def test_extend_on_an_empty_batch():
    batch = extend_batch([], [], torch.bfloat16)
    out, _ = extend(*batch, [])
    assert out.shape == (0, HEADS, 32)


def test_what_the_cpp_refuses_fails_loudly():
    batch = extend_batch([1], [2], torch.float16)
    q, k_new, v_new, k_cache, v_cache, req_to_token, rows, seq_lens = batch
    with pytest.raises(RuntimeError, match="not implemented for torch.float64"):
        extend(q.double(), k_new.double(), v_new.double(), k_cache.double(), v_cache.double(), *batch[5:], [2])
    with pytest.raises(RuntimeError, match="invalid head_size"):
        extend(q[..., :16], k_new[..., :16], v_new, k_cache[..., :16], v_cache, *batch[5:], [2])
    with pytest.raises(RuntimeError, match="tree_mask numel"):
        extend(*batch, [2], tree_mask=torch.ones(3, dtype=torch.bool))
    with pytest.raises(RuntimeError, match="req_lens to be int64"):
        ops.decode_attention_cpu(
            *(q[:1], k_cache, v_cache, 1.0, 1.0, torch.empty(1, HEADS, 32, dtype=q.dtype), None, None),
            *(torch.zeros(1, dtype=torch.int64), torch.empty(1, HEADS, 8, 33), req_to_token),
            *(torch.tensor([rows[0]]), torch.tensor([3], dtype=torch.int32), 0.1, 0.0, False, 0, None, None),
        )
