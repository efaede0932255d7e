"""The stand-in sgl_kernel CPU ops (deploy/sglang-cpu/sgl_kernel_speculative_ops.py, sgl_kernel_kvcache_ops.py).

The attention ops (sgl_kernel_attention_ops.py) are tested in test_sglang_cpu_attention.py; the last test here loads
all three files as common_ops does.

Each op is called as SGLang calls it, through ``torch.ops.sgl_kernel``, and compared with a plain loop written from
the C++ it follows (sgl-kernel's csrc/cpu/spec.cpp and csrc/cpu/kvcache.cpp in the sgl-project/sglang repository):
flat pointer arithmetic, one element at a time. The pipeline's draft shape (num_steps 3, topk 1, 4 draft tokens) is
checked against values written by hand too, with the edge cases: an empty batch, every draft rejected, every draft
accepted, a finished request inside the batch.
"""

from __future__ import annotations

import importlib.util
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

OPS_DIR = Path(__file__).resolve().parents[2] / "deploy" / "sglang-cpu"
STEPS, TOPK, DRAFT = 3, 1, 4  # the pipeline's EAGLE-3 shape: a chain of 3 drafts after the bonus token
ops = torch.ops.sgl_kernel


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, OPS_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module", autouse=True)
def registered():
    _load("sgl_kernel_common_ops")  # registers every op file beside it, as sgl_kernel loads it


def _i32(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


# --- the references: loops over flat lists, as the C++ reads its pointers ---------------------------------------


def ref_verify(cand, ri, rnt, rns, tp, bs, num_draft, num_spec_step):
    predicts = [0] * (bs * num_draft)
    accept_index = [-1] * (bs * num_spec_step)
    accept_num = [0] * bs
    for bx in range(bs):
        off, ai_off = bx * num_draft, bx * num_spec_step
        last = ri[off]
        accept_index[ai_off] = last
        correct, cur = 0, 0
        for _ in range(1, num_spec_step):
            cur = rnt[off + cur]
            while cur != -1:
                if cand[off + cur] == tp[last]:
                    predicts[last] = tp[last]
                    correct += 1
                    accept_index[ai_off + correct] = ri[off + cur]
                    last = ri[off + cur]
                    break
                cur = rns[off + cur]
            if cur == -1:
                break
        accept_num[bx] = correct
        predicts[last] = tp[last]
    return predicts, accept_index, accept_num


def ref_build_tree(parent, sel, seq_lens, mask, topk, depth, n, mode):
    """`mask` (a flat list) is updated; returns positions, retrive_index, next_token, next_sibling (flat)."""
    bs = len(seq_lens)
    pos, ri, rnt, rns = [0] * (bs * n), [0] * (bs * n), [-1] * (bs * n), [-1] * (bs * n)
    pstride, sstride = topk * (depth - 1) + 1, n - 1

    def find(bid, token):
        for i in range(sstride):
            if sel[bid * sstride + i] == token:
                return i
        return -1

    acc = 0
    for bid in range(bs):
        off, seq_len = bid * n, seq_lens[bid]
        pos[off], ri[off] = seq_len, off
        for i in range(n - 1, 0, -1):
            ri[off + i] = off + i
            ptb = sel[bid * sstride + i - 1] // topk
            ppos = 0
            if ptb > 0:
                found = find(bid, parent[bid * pstride + ptb])
                if found < 0:
                    continue
                ppos = found + 1
            if rnt[off + ppos] == -1:
                rnt[off + ppos] = i
            else:
                rns[off + i] = rnt[off + ppos]
                rnt[off + ppos] = i
        base = bid * n * n + acc
        acc += seq_len * n
        for tid in range(n):
            row = (off + tid) * n if mode == 1 else base + (seq_len + n) * tid + seq_len
            mask[row] = True
            for j in range(1, n):
                mask[row + j] = False
            if tid == 0:
                continue
            position, cur = 0, tid - 1
            while position < depth:
                position += 1
                mask[row + cur + 1] = True
                ptb = sel[bid * sstride + cur] // topk
                if ptb == 0:
                    break
                cur = find(bid, parent[bid * pstride + ptb])
                if cur < 0:
                    break
            pos[off + tid] = position + seq_len
    return pos, ri, rnt, rns


def ref_reconstruct(mask, seq_lens, bs, n):
    pos, ri, rnt, rns = ([0] * (bs * n) for _ in range(4))
    for idx in range(bs * n):
        bid, tid = divmod(idx, n)
        token_idx, moff = bid * n, bid * n * n
        depth, parent = 0, -1
        for i in range(tid - 1, -1, -1):
            if mask[moff + tid * n + i]:
                depth += 1
                if parent == -1:
                    parent = i
        ri[token_idx + tid] = token_idx + tid
        pos[token_idx + tid] = depth + seq_lens[bid]
        nxt = -1
        for i in range(tid + 1, n):
            if mask[moff + i * n + tid]:
                nxt = i
                break
        rnt[token_idx + tid] = nxt
        sib = -1
        if parent != -1:
            for i in range(tid + 1, n):
                si = moff + i * n + parent
                if mask[si]:
                    ei = moff + i * n + i
                    if not any(mask[j] for j in range(si + 1, ei)):
                        sib = i
                        break
        rns[token_idx + tid] = sib
    return pos, ri, rnt, rns


def ref_assign_req_to_token_pool(rpi, rtt, starts, ends, ocl, pool_len):
    prefix = [0]
    for s, e in zip(starts, ends):
        prefix.append(prefix[-1] + e - s)
    for pid in range(len(rpi)):
        for j in range(starts[pid], ends[pid]):
            rtt[rpi[pid] * pool_len + j] = ocl[prefix[pid] + j - starts[pid]]
    return rtt


def ref_assign_extend_cache_locs(rpi, rtt, starts, ends, out, pool_len):
    prefix = [0]
    for s, e in zip(starts, ends):
        prefix.append(prefix[-1] + e - s)
    for pid in range(len(rpi)):
        for j in range(ends[pid] - starts[pid]):
            out[prefix[pid] + j] = rtt[rpi[pid] * pool_len + starts[pid] + j]
    return out


def ref_rotate(ids, starts, lens, tokens, select):
    for pid in range(len(lens)):
        start, seq_len = starts[pid], lens[pid]
        if seq_len > 1:
            ids[start : start + seq_len - 1] = ids[start + 1 : start + seq_len]  # memmove
        if seq_len > 0:
            ids[select[pid] if select is not None else start + seq_len - 1] = tokens[pid]
    return ids


# --- the pipeline's chain (topk 1) and a topk-2 tree -----------------------------------------------------------

# topk 1, 3 steps: the draft loop's parents are [-1, 0] then [1]; parent_list drops the last step's, the top-3
# candidates are all three steps in order
CHAIN_PARENTS, CHAIN_SELECTED = [-1, 0, 1], [0, 1, 2]
# topk 2, depth 3, 6 draft tokens: candidates 0,1 (step 0, parent the root), 2..5 (step 1; 3 under candidate 0, 4
# under candidate 1), 6..9 (step 2; 6 under candidate 3). Nodes 1..5 hold candidates 0, 1, 3, 4, 6.
TREE_PARENTS, TREE_SELECTED = [-1, 0, 1, 3, 4], [0, 1, 3, 4, 6]


def build_tree(parents, selected, seq_lens, topk, depth, n, mode=1):
    bs = len(seq_lens)
    rows = sum(seq_lens) + bs * n if mode == 0 else bs * n
    out = dict(
        tree_mask=torch.ones(rows * n, dtype=torch.bool),
        positions=torch.empty(bs * n, dtype=torch.int64),
        retrive_index=torch.full((bs, n), -1, dtype=torch.int64),
        retrive_next_token=torch.full((bs, n), -1, dtype=torch.int64),
        retrive_next_sibling=torch.full((bs, n), -1, dtype=torch.int64),
    )
    ops.build_tree_kernel_efficient_cpu(
        _i64(parents).view(bs, topk * (depth - 1) + 1 if depth > 1 else 0),
        _i64(selected).view(bs, n - 1),
        _i64(seq_lens),
        *out.values(),
        topk,
        depth,
        n,
        mode,
    )
    return out


def test_build_tree_chain_by_hand():
    tree = build_tree([CHAIN_PARENTS] * 2, [CHAIN_SELECTED] * 2, [5, 9], TOPK, STEPS, DRAFT)
    assert tree["retrive_next_token"].tolist() == [[1, 2, 3, -1]] * 2
    assert tree["retrive_next_sibling"].tolist() == [[-1] * 4] * 2
    assert tree["retrive_index"].tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert tree["positions"].tolist() == [5, 6, 7, 8, 9, 10, 11, 12]
    causal = torch.tril(torch.ones(DRAFT, DRAFT, dtype=torch.bool))
    assert torch.equal(tree["tree_mask"].view(2, DRAFT, DRAFT), causal.expand(2, -1, -1))


def test_build_tree_with_siblings_by_hand():
    tree = build_tree([TREE_PARENTS], [TREE_SELECTED], [7], topk=2, depth=3, n=6)
    assert tree["retrive_next_token"].tolist() == [[1, 3, 4, 5, -1, -1]]
    assert tree["retrive_next_sibling"].tolist() == [[-1, 2, -1, -1, -1, -1]]
    assert tree["positions"].tolist() == [7, 8, 8, 9, 9, 10]
    assert tree["tree_mask"].view(6, 6).int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [1, 0, 1, 0, 0, 0],
        [1, 1, 0, 1, 0, 0],
        [1, 0, 1, 0, 1, 0],
        [1, 1, 0, 1, 0, 1],
    ]


def random_tree(rng: random.Random, topk: int, depth: int, n: int) -> tuple[list[int], list[int]]:
    """parent_list and selected_index as SGLang's draft loop makes them: each step's topk picks among the previous
    step's topk * topk children, and the selected candidates include every selected one's parent."""
    parents = list(range(-1, topk))  # step 0: the root's children are candidates 0..topk-1
    for step in range(1, depth - 1):
        first = topk + (step - 1) * topk * topk  # the step's candidates start here
        parents += sorted(rng.sample(range(first, first + topk * topk), topk))
    parent_of = {c: -1 for c in range(topk)}
    for step in range(1, depth):
        first = topk + (step - 1) * topk * topk
        for c in range(first, first + topk * topk):
            parent_of[c] = parents[c // topk]
    chosen: set[int] = set()
    while len(chosen) < n - 1:
        c = rng.choice(sorted(parent_of))
        path = []
        while c != -1 and c not in chosen:
            path.append(c)
            c = parent_of[c]
        if len(chosen) + len(path) <= n - 1:
            chosen.update(path)
    return parents, sorted(chosen)


@pytest.mark.parametrize("mode", [0, 1])
def test_build_tree_matches_the_loop(mode):
    rng = random.Random(mode)
    for topk, depth, n, seq_lens in [(1, 3, 4, [3, 0, 6]), (2, 3, 6, [4, 1]), (3, 4, 8, [2, 5, 0, 1]), (2, 1, 2, [3])]:
        trees = [random_tree(rng, topk, depth, n) for _ in seq_lens]
        parents = [p for tree in trees for p in tree[0]] if depth > 1 else []
        selected = [s for tree in trees for s in tree[1]]
        parent_list = _i64(parents).view(len(seq_lens), -1)
        tree = build_tree(parent_list.tolist(), selected, seq_lens, topk, depth, n, mode)
        mask = [True] * tree["tree_mask"].numel()
        pos, ri, rnt, rns = ref_build_tree(parents, selected, seq_lens, mask, topk, depth, n, mode)
        assert tree["tree_mask"].tolist() == mask
        assert tree["positions"].tolist() == pos
        assert tree["retrive_index"].view(-1).tolist() == ri
        assert tree["retrive_next_token"].view(-1).tolist() == rnt
        assert tree["retrive_next_sibling"].view(-1).tolist() == rns


def test_build_tree_full_mask_leaves_the_prefix_to_the_caller():
    tree = build_tree([CHAIN_PARENTS] * 2, [CHAIN_SELECTED] * 2, [2, 3], TOPK, STEPS, DRAFT, mode=0)
    first = tree["tree_mask"][: 4 * 6].view(4, 6)  # request 0: rows of 2 + 4 columns
    assert first[:, :2].all()  # the caller's prefix fill, untouched
    assert torch.equal(first[:, 2:], torch.tril(torch.ones(4, 4, dtype=torch.bool)))


def test_build_tree_and_verify_on_an_empty_batch():
    tree = build_tree([], [], [], TOPK, STEPS, DRAFT)
    assert tree["tree_mask"].numel() == 0
    predicts, accept_index, accept_num = _i32([]), torch.full((0, STEPS + 1), -1, dtype=torch.int32), _i32([])
    empty = torch.empty(0, DRAFT, dtype=torch.int64)
    ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, empty, empty, empty, empty, empty)
    assert accept_num.numel() == 0


def verify(tree, candidates, target):
    bs, n = candidates.shape
    predicts = torch.zeros(bs * n, dtype=torch.int32)
    accept_index = torch.full((bs, STEPS + 1), -1, dtype=torch.int32)
    accept_num = torch.empty(bs, dtype=torch.int32)
    ops.verify_tree_greedy_cpu(
        predicts,
        accept_index,
        accept_num,
        candidates,
        tree["retrive_index"],
        tree["retrive_next_token"],
        tree["retrive_next_sibling"],
        target,
    )
    return predicts, accept_index, accept_num


def test_verify_chain_by_hand():
    # four requests: every draft rejected, every draft accepted, one accepted, two accepted then a miss
    tree = build_tree([CHAIN_PARENTS] * 4, [CHAIN_SELECTED] * 4, [5, 5, 5, 5], TOPK, STEPS, DRAFT)
    candidates = _i64([[10, 11, 12, 13], [20, 21, 22, 23], [30, 31, 32, 33], [40, 41, 42, 43]])
    target = _i64([[99, 98, 97, 96], [21, 22, 23, 24], [31, 77, 76, 75], [41, 42, 66, 65]])
    predicts, accept_index, accept_num = verify(tree, candidates, target)
    assert accept_num.tolist() == [0, 3, 1, 2]
    assert accept_index.tolist() == [[0, -1, -1, -1], [4, 5, 6, 7], [8, 9, -1, -1], [12, 13, 14, -1]]
    # the target's token at every accepted node; the last one is the bonus token
    assert predicts.view(4, 4).tolist() == [[99, 0, 0, 0], [21, 22, 23, 24], [31, 77, 0, 0], [41, 42, 66, 0]]


def test_verify_takes_a_sibling_by_hand():
    tree = build_tree([TREE_PARENTS], [TREE_SELECTED], [7], topk=2, depth=3, n=6)
    candidates = _i64([[1, 100, 200, 300, 400, 500]])
    target = _i64([[200, 0, 400, 0, 9, 0]])  # the root's target is node 2's token, node 2's is node 4's
    predicts, accept_index, accept_num = verify(tree, candidates, target)
    assert accept_num.tolist() == [2]
    assert accept_index.tolist() == [[0, 2, 4, -1]]
    assert predicts.tolist() == [200, 0, 400, 0, 9, 0]


def test_verify_matches_the_loop():
    rng = random.Random(0)
    for topk, depth, n, bs in [(1, 3, 4, 5), (2, 3, 6, 4), (3, 4, 8, 6)]:
        trees = [random_tree(rng, topk, depth, n) for _ in range(bs)]
        tree = build_tree([t[0] for t in trees], [t[1] for t in trees], [3] * bs, topk, depth, n)
        candidates = torch.randint(0, 3, (bs, n), generator=torch.Generator().manual_seed(n))
        target = torch.randint(0, 3, (bs, n), generator=torch.Generator().manual_seed(n + 1))
        predicts = torch.zeros(bs * n, dtype=torch.int32)
        accept_index = torch.full((bs, depth + 1), -1, dtype=torch.int32)
        accept_num = torch.empty(bs, dtype=torch.int32)
        links = [tree[k] for k in ("retrive_index", "retrive_next_token", "retrive_next_sibling")]
        ops.verify_tree_greedy_cpu(predicts, accept_index, accept_num, candidates, *links, target)
        flat = [t.view(-1).tolist() for t in (candidates, *links, target)]
        assert (predicts.tolist(), accept_index.view(-1).tolist(), accept_num.tolist()) == ref_verify(
            *flat, bs, n, depth + 1
        )


def test_reconstruct_gives_back_the_built_tree():
    tree = build_tree([TREE_PARENTS, [-1, 0, 1, 2, 3]], [TREE_SELECTED, [0, 2, 3, 6, 8]], [7, 2], 2, 3, 6)
    outs = [torch.empty(2 * 6, dtype=torch.int64) for _ in range(4)]
    ops.reconstruct_indices_from_tree_mask_cpu(tree["tree_mask"], _i64([7, 2]), *outs, 2, 6)
    assert outs[0].tolist() == tree["positions"].tolist()
    assert outs[1].tolist() == tree["retrive_index"].view(-1).tolist()
    assert outs[2].tolist() == tree["retrive_next_token"].view(-1).tolist()
    assert outs[3].tolist() == tree["retrive_next_sibling"].view(-1).tolist()


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_reconstruct_matches_the_loop_on_any_mask(dtype):
    gen = torch.Generator().manual_seed(3)
    for bs, n in [(3, 5), (1, 8), (0, 4), (2, 1)]:
        mask = (torch.rand(bs, n, n, generator=gen) < 0.4) | torch.eye(n, dtype=torch.bool)
        seq_lens = torch.randint(0, 9, (bs,), generator=gen, dtype=dtype)
        outs = [torch.empty(bs * n, dtype=dtype) for _ in range(4)]
        ops.reconstruct_indices_from_tree_mask_cpu(mask.view(-1), seq_lens, *outs, bs, n)
        expected = ref_reconstruct(mask.view(-1).tolist(), seq_lens.tolist(), bs, n)
        assert [t.tolist() for t in outs] == list(expected)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_assign_req_to_token_pool(dtype):
    pool_len = 12
    req_to_token = torch.arange(5 * pool_len, dtype=torch.int32).view(5, pool_len)
    # a request extending by 3, a finished one with nothing to add (start == end), one extending by 4 (a verify)
    rpi, starts, ends = [3, 0, 4], [2, 6, 7], [5, 6, 11]
    ocl = _i64([100 + i for i in range(7)])
    expected = ref_assign_req_to_token_pool(rpi, req_to_token.view(-1).tolist(), starts, ends, ocl.tolist(), pool_len)
    args = torch.tensor(rpi, dtype=dtype), torch.tensor(starts, dtype=dtype), torch.tensor(ends, dtype=dtype)
    ops.assign_req_to_token_pool_cpu(args[0], req_to_token, args[1], args[2], ocl, pool_len)
    assert req_to_token.view(-1).tolist() == expected
    assert req_to_token[3, 2:5].tolist() == [100, 101, 102] and req_to_token[4, 7:11].tolist() == [103, 104, 105, 106]
    ops.assign_req_to_token_pool_cpu(_i64([]), req_to_token, _i64([]), _i64([]), _i64([]), pool_len)
    assert req_to_token.view(-1).tolist() == expected


def test_assign_req_to_token_pool_refuses_too_few_locations():
    with pytest.raises(RuntimeError, match="out_cache_loc"):
        ops.assign_req_to_token_pool_cpu(
            _i64([0]), torch.zeros(1, 8, dtype=torch.int32), _i64([0]), _i64([4]), _i64([1]), 8
        )


@pytest.mark.parametrize("topk, num_steps", [(TOPK, STEPS), (2, 3)])
def test_build_draft_decode_metadata(topk, num_steps):
    pool_len = 20
    req_to_token = torch.arange(4 * pool_len, dtype=torch.int32).view(4, pool_len)
    rpi, seq_lens = [2, 0, 3], [5, 0, 9]
    out = ops.build_draft_decode_metadata_cpu(req_to_token, _i64(rpi), _i32(seq_lens), topk, num_steps, pool_len)
    assert out.shape == (3 * topk, pool_len) and out.dtype == torch.int32
    flat = req_to_token.view(-1).tolist()
    for b in range(3):
        for tk in range(topk):
            row = [flat[rpi[b] * pool_len + j] for j in range(seq_lens[b])]
            row += [flat[rpi[b] * pool_len + seq_lens[b] + tk * num_steps + s] for s in range(num_steps)]
            assert out[b * topk + tk, : seq_lens[b] + num_steps].tolist() == row  # the rest is undefined
    assert ops.build_draft_decode_metadata_cpu(req_to_token, _i64([]), _i64([]), topk, num_steps, pool_len).numel() == 0


def test_fill_bonus_tokens():
    stride = STEPS + 1
    # every draft rejected (1: the bonus only), every draft accepted, two accepted
    accept_tokens = _i32([[7, 0, 0, 0], [1, 2, 3, 4], [5, 6, 8, 0]])
    accept_lens = _i32([1, 4, 3])
    bonus = torch.zeros(3, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(accept_tokens, accept_lens, bonus, stride)
    flat = accept_tokens.view(-1).tolist()
    assert bonus.tolist() == [flat[stride * b + n - 1] for b, n in enumerate(accept_lens.tolist())] == [7, 4, 8]
    empty = torch.zeros(0, dtype=torch.int32)
    ops.fill_bonus_tokens_cpu(empty.view(0, stride), empty, empty, stride)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_fill_accept_out_cache_loc(dtype):
    # all rejected, all accepted, a request that finished after its first accepted draft (the rest dropped: -1)
    accept_index = torch.tensor([[0, -1, -1, -1], [4, 5, 6, 7], [8, 9, -1, -1]], dtype=dtype)
    out_cache_loc = _i64([50 + i for i in range(12)])
    out = torch.zeros(12, dtype=torch.int64)
    ops.fill_accept_out_cache_loc_cpu(accept_index, out_cache_loc, out)
    expected, locs = [], out_cache_loc.tolist()
    for src in accept_index.view(-1).tolist():
        if src > -1:
            expected.append(locs[src])
    assert out.tolist() == expected + [0] * (12 - len(expected))
    assert expected == [50, 54, 55, 56, 57, 58, 59]
    ops.fill_accept_out_cache_loc_cpu(accept_index[:0], out_cache_loc, out[:0])


def test_fill_accept_out_cache_loc_refuses_an_index_out_of_range():
    with pytest.raises(RuntimeError, match="out of range"):
        ops.fill_accept_out_cache_loc_cpu(_i32([0, 4]), _i64([1, 2, 3, 4]), torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_assign_draft_cache_locs_contiguous(dtype):
    pool_len = 16
    req_to_token = torch.arange(3 * pool_len, dtype=torch.int32).view(3, pool_len) * 2
    rpi, seq_lens = [2, 0], [4, 11]
    out = torch.empty(2 * TOPK * STEPS, dtype=torch.int64)
    args = torch.tensor(rpi, dtype=dtype), torch.tensor(seq_lens, dtype=dtype)
    ops.assign_draft_cache_locs_contiguous_cpu(args[0], req_to_token, args[1], out, pool_len, TOPK, STEPS)
    flat = req_to_token.view(-1).tolist()
    width = TOPK * STEPS
    expected = [flat[rpi[b] * pool_len + seq_lens[b] + j] for b in range(2) for j in range(width)]
    assert out.tolist() == expected == [72, 74, 76, 22, 24, 26]
    ops.assign_draft_cache_locs_contiguous_cpu(_i64([]), req_to_token, _i64([]), out[:0], pool_len, TOPK, STEPS)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_assign_extend_cache_locs(dtype):
    pool_len = 10
    req_to_token = torch.arange(4 * pool_len, dtype=torch.int32).view(4, pool_len) + 1000
    rpi, starts, ends = [1, 3, 0], [2, 5, 0], [2 + DRAFT, 5, 3]  # a verify window, a finished request, a prefill
    out = torch.full((12,), -7, dtype=torch.int64)  # sized larger than needed: the tail is left alone
    args = [torch.tensor(x, dtype=dtype) for x in (rpi, starts, ends)]
    ops.assign_extend_cache_locs_cpu(args[0], req_to_token, args[1], args[2], out, pool_len)
    expected = ref_assign_extend_cache_locs(rpi, req_to_token.view(-1).tolist(), starts, ends, [-7] * 12, pool_len)
    assert out.tolist() == expected
    assert out[:7].tolist() == [1012, 1013, 1014, 1015, 1000, 1001, 1002]
    ops.assign_extend_cache_locs_cpu(_i64([]), req_to_token, _i64([]), _i64([]), out[:0], pool_len)


@pytest.mark.parametrize("with_select", [False, True])
def test_rotate_input_ids(with_select):
    starts, lens = [0, 4, 5, 5], [4, 1, 0, 3]  # an empty segment (a request with no tokens) in the middle
    tokens = [100, 200, 300, 400]
    select = [2, 4, 5, 6] if with_select else None
    ids = torch.arange(10, 18, dtype=torch.int64)
    expected = ref_rotate(ids.tolist(), starts, lens, tokens, select)
    select_index = _i64(select) if with_select else None
    ops.rotate_input_ids_cpu(ids, _i32(starts), _i64(lens), _i64(tokens), select_index)
    assert ids.tolist() == expected
    if not with_select:
        assert ids.tolist() == [11, 12, 13, 100, 200, 16, 17, 400]
    ops.rotate_input_ids_cpu(ids, _i64([]), _i64([]), _i64([]), None)
    assert ids.tolist() == expected


def test_store_cache():
    gen = torch.Generator().manual_seed(0)
    k, v = (torch.randn(3, 2, 4, generator=gen).to(torch.bfloat16) for _ in range(2))
    # a cache strided in its first dimension (its rows are slices of a wider buffer), as the C++ allows
    k_cache = torch.zeros(8, 2, 2, 4, dtype=torch.bfloat16)[:, 0]
    v_cache = torch.zeros(8, 2, 4, dtype=torch.bfloat16)
    indices = _i32([5, 0, 7])
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    for i, slot in enumerate(indices.tolist()):
        expected_k[slot], expected_v[slot] = k[i], v[i]
    ops.store_cache_cpu(k, v, k_cache, v_cache, indices, 8)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    ops.store_cache_cpu(k[:0], v[:0], k_cache, v_cache, indices[:0], None)
    assert torch.equal(k_cache, expected_k)
    with pytest.raises(RuntimeError, match="row_dim"):
        ops.store_cache_cpu(k, v, k_cache, v_cache, indices, 6)
    with pytest.raises(RuntimeError, match="not implemented"):
        ops.store_cache_cpu(k.float(), v.float(), k_cache.float(), v_cache.float(), indices, None)


def test_copy_all_layer_kv_cache():
    gen = torch.Generator().manual_seed(1)
    # two layers' K and V buffers [slots, heads, head_dim] as the KV pool holds them, one of another width
    buffers = [torch.randn(9, 2, 3, generator=gen).to(torch.bfloat16) for _ in range(3)]
    buffers.append(torch.randint(0, 255, (9, 5), generator=gen, dtype=torch.uint8))
    data_ptrs = torch.tensor([b.data_ptr() for b in buffers], dtype=torch.uint64)
    strides = torch.tensor([b.stride(0) * b.element_size() for b in buffers])
    # overlapping locations (each source row read before any target row is written), as in accepted-token moves
    tgt, src = [1, 2, 3, 8], [0, 1, 2, 5]
    expected = []
    for b in buffers:
        rows = b.clone()
        staged = [rows[s].clone() for s in src]
        for t, row in zip(tgt, staged):
            rows[t] = row
        expected.append(rows)
    ops.copy_all_layer_kv_cache_cpu(data_ptrs, strides, _i64(tgt), _i64(src))
    assert all(torch.equal(b, e) for b, e in zip(buffers, expected))
    ops.copy_all_layer_kv_cache_cpu(data_ptrs, strides, _i32([]), _i32([]))
    assert all(torch.equal(b, e) for b, e in zip(buffers, expected))


def test_a_wrong_dtype_fails_loudly():
    with pytest.raises(RuntimeError, match="int32"):
        ops.fill_bonus_tokens_cpu(_i64([1]), _i32([1]), torch.zeros(1, dtype=torch.int32), 1)
    with pytest.raises(RuntimeError, match="QLEN_ONLY"):
        build_tree([CHAIN_PARENTS], [CHAIN_SELECTED], [1], TOPK, STEPS, DRAFT, mode=2)


@pytest.mark.multiprocess
def test_common_ops_registers_them_all_as_sgl_kernel_loads_it(tmp_path):
    # install.sh's layout: common_ops and the op files side by side, common_ops loaded by path (load_utils.py)
    shutil.copy(OPS_DIR / "sgl_kernel_common_ops.py", tmp_path / "common_ops.py")
    modules = ("sgl_kernel_speculative_ops", "sgl_kernel_kvcache_ops", "sgl_kernel_attention_ops")
    for name in modules:
        shutil.copy(OPS_DIR / f"{name}.py", tmp_path / f"{name}.py")
    names = [op for name in modules for op in sorted(_load(name).SCHEMAS)]
    script = (
        "import importlib.util, sys, torch\n"
        "spec = importlib.util.spec_from_file_location('common_ops', sys.argv[1])\n"
        "spec.loader.exec_module(importlib.util.module_from_spec(spec))\n"
        "for name in sys.argv[2:]:\n"
        "    print(getattr(torch.ops.sgl_kernel, name).default._schema)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "common_ops.py"), *names],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stderr
    assert len(run.stdout.splitlines()) == 14
    assert "sgl_kernel::verify_tree_greedy_cpu(Tensor(a!) predicts" in run.stdout
    assert "sgl_kernel::extend_attention_cpu(Tensor q_extend, Tensor? k_extend" in run.stdout
