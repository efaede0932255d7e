"""STAND-IN (eagle3-pipeline, not SGLang): SGLang's CPU speculative-decoding ops, written in plain torch.

SGLang 0.5.23's EAGLE path on a CPU calls ten ``torch.ops.sgl_kernel.*_cpu`` ops (sgl_kernel/speculative.py of the
sglang-kernel 0.4.10 wheel names them; sglang/kernels/ops/speculative/ calls them). Their C++, csrc/cpu/spec.cpp in
the sgl-project/sglang repository (sgl-kernel/csrc/cpu/, since moved to python/sglang/kernels/aot/csrc/cpu/; read
at commit 71219d32, whose signatures match the 0.4.10 wheel's Python wrappers, e.g. fill_accept_out_cache_loc_cpu's
three tensors), ships in no registry package. These are our own implementations of the same semantics, registered
under the same names with the schema strings of that repository's csrc/cpu/torch_extension_cpu.cpp (commit
004fbaaf), so SGLang's unmodified Python calls them. They are index and copy operations: each one's docstring says
what it does and which C++ function it follows; tests/deploy/test_sglang_cpu_ops.py checks each against a plain
loop of that C++.

The C++ accepts int32 or int64 for most index tensors (AT_DISPATCH_INDEX_TYPES); so do these. Outputs are written
in place where the schema marks them ``Tensor(a!)``, as the C++ does. A wrong dtype or size fails loudly (the C++
checks the same things).

deploy/sglang-cpu/install.sh copies this file into .venv-sglang beside ``sgl_kernel/sm100/common_ops.py``
(sgl_kernel_common_ops.py), which loads it and registers its ``SCHEMAS`` with their ``IMPLS`` (the ops not yet
defined). The kv-cache ops are in sgl_kernel_kvcache_ops.py.
"""

from __future__ import annotations

import warnings

import torch

# The schemas as sglang's csrc/cpu/torch_extension_cpu.cpp declares them (the Tensor(a!) outputs included).
SCHEMAS = {
    "verify_tree_greedy_cpu": (
        "verify_tree_greedy_cpu(Tensor(a!) predicts, Tensor(a!) accept_index, Tensor(a!) accept_token_num, "
        "Tensor candidates, Tensor retrive_index, Tensor retrive_next_token, Tensor retrive_next_sibling, "
        "Tensor target_predict) -> ()"
    ),
    "build_tree_kernel_efficient_cpu": (
        "build_tree_kernel_efficient_cpu(Tensor parent_list, Tensor selected_index, Tensor verified_seq_len, "
        "Tensor(a!) tree_mask, Tensor(a!) positions, Tensor(a!) retrive_index, Tensor(a!) retrive_next_token, "
        "Tensor(a!) retrive_next_sibling, int topk, int depth, int draft_token_num, int tree_mask_mode) -> ()"
    ),
    "reconstruct_indices_from_tree_mask_cpu": (
        "reconstruct_indices_from_tree_mask_cpu(Tensor tree_mask, Tensor verified_seq_len, Tensor(a!) positions, "
        "Tensor(a!) retrive_index, Tensor(a!) retrive_next_token, Tensor(a!) retrive_next_sibling, int batch_size, "
        "int draft_token_num) -> ()"
    ),
    "assign_req_to_token_pool_cpu": (
        "assign_req_to_token_pool_cpu(Tensor req_pool_indices, Tensor(a!) req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor out_cache_loc, int pool_len) -> ()"
    ),
    "build_draft_decode_metadata_cpu": (
        "build_draft_decode_metadata_cpu(Tensor req_to_token, Tensor req_pool_indices, Tensor seq_lens, int topk, "
        "int num_steps, int pool_len) -> Tensor"
    ),
    "fill_bonus_tokens_cpu": (
        "fill_bonus_tokens_cpu(Tensor accept_tokens, Tensor accept_lens, Tensor(a!) bonus_tokens, "
        "int accept_stride) -> ()"
    ),
    "fill_accept_out_cache_loc_cpu": (
        "fill_accept_out_cache_loc_cpu(Tensor accept_index, Tensor out_cache_loc, "
        "Tensor(a!) accept_out_cache_loc) -> ()"
    ),
    "assign_draft_cache_locs_contiguous_cpu": (
        "assign_draft_cache_locs_contiguous_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor seq_lens, "
        "Tensor(a!) out_cache_loc, int pool_len, int topk, int num_steps) -> ()"
    ),
    "assign_extend_cache_locs_cpu": (
        "assign_extend_cache_locs_cpu(Tensor req_pool_indices, Tensor req_to_token, Tensor start_offset, "
        "Tensor end_offset, Tensor(a!) out_cache_loc, int pool_len) -> ()"
    ),
    "rotate_input_ids_cpu": (
        "rotate_input_ids_cpu(Tensor(a!) input_ids, Tensor extend_start_loc, Tensor extend_seq_lens, "
        "Tensor topk_index, Tensor? select_index=None) -> ()"
    ),
}
INDEX_DTYPES = (torch.int32, torch.int64)


def _check(ok: bool, message: str) -> None:
    """TORCH_CHECK: a caller's wrong tensor fails here, as it would in the C++."""
    if not ok:
        raise RuntimeError(message)


def _index(name: str, t: torch.Tensor) -> None:
    _check(t.dtype in INDEX_DTYPES, f"{name} must be int32 or int64, got {t.dtype}")


def verify_tree_greedy_cpu(
    predicts: torch.Tensor,
    accept_index: torch.Tensor,
    accept_token_num: torch.Tensor,
    candidates: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    target_predict: torch.Tensor,
) -> None:
    """Greedy tree verification: per request, the longest root path whose drafts equal the target's argmax.

    Follows ``verify_tree_greedy_cpu`` in csrc/cpu/spec.cpp. From the root (node 0), each step tries the current
    node's children (first child, then its siblings) and takes the first whose draft token equals the target's
    token at the last accepted node; a step with no match ends the walk. Writes ``accept_index[b, 0..n]`` (flat
    indices of the root and the accepted nodes; the rest keeps the caller's -1), ``accept_token_num[b] = n``
    (bonus excluded), and ``predicts`` at each accepted node's flat index: the target's token there (the last one
    is the bonus token). Shapes: predicts [bs * D] int32, accept_index [bs, S] int32, accept_token_num [bs] int32,
    the others [bs, D], one index dtype.
    """
    _check(candidates.dim() == 2 and accept_index.dim() == 2, "candidates and accept_index must be 2-D")
    bs, num_draft = candidates.shape
    num_spec_step = accept_index.shape[1]
    for name, t in (("predicts", predicts), ("accept_index", accept_index), ("accept_token_num", accept_token_num)):
        _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    _check(predicts.numel() == bs * num_draft and accept_token_num.numel() == bs, "predicts / accept_token_num size")
    tree = (candidates, retrive_index, retrive_next_token, retrive_next_sibling, target_predict)
    _index("retrive_index", retrive_index)
    _check(all(t.dtype == retrive_index.dtype and t.shape == (bs, num_draft) for t in tree), "tree tensors")

    cand, index, first_child, sibling, target = (t.tolist() for t in tree)
    flat_target = [tok for row in target for tok in row]  # read by flat node index, as the C++ reads it
    for b in range(bs):
        path = [index[b][0]]  # flat indices of the root and of each accepted node
        node = 0
        for _ in range(1, num_spec_step):
            node = first_child[b][node]
            while node != -1 and cand[b][node] != flat_target[path[-1]]:
                node = sibling[b][node]
            if node == -1:
                break
            path.append(index[b][node])
        accept_index[b, : len(path)] = torch.tensor(path, dtype=torch.int32)
        accept_token_num[b] = len(path) - 1
        predicts.view(-1)[torch.tensor(path)] = torch.tensor([flat_target[i] for i in path], dtype=torch.int32)


def build_tree_kernel_efficient_cpu(
    parent_list: torch.Tensor,
    selected_index: torch.Tensor,
    verified_seq_len: torch.Tensor,
    tree_mask: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    topk: int,
    depth: int,
    draft_token_num: int,
    tree_mask_mode: int,
) -> None:
    """The draft tree for target verify: linkage (index, first child, next sibling), positions and tree mask.

    Follows ``build_tree_kernel_efficient_cpu`` in csrc/cpu/spec.cpp. Node 0 is the root (the bonus token); node
    i > 0 is draft ``selected_index[b, i - 1]`` (an index into the draft steps' top-k candidates), whose parent
    candidate is ``parent_list[b, selected_index[b, i - 1] // topk]`` (0: the root). Nodes are linked from the last
    to the first, each becoming its parent's first child and pushing the previous first child to its sibling, so
    siblings end in increasing order. Position = seq_len + the node's depth. Mask row of node t: the root and t's
    ancestors and t itself. ``tree_mask_mode`` 1 (QLEN_ONLY): rows of draft_token_num columns, fully written;
    0 (FULL_MASK): rows of seq_len + draft_token_num columns, only the last draft_token_num written (the caller
    fills the prefix). ``retrive_next_token`` / ``retrive_next_sibling`` come pre-filled with -1.
    """
    _check(tree_mask_mode in (0, 1), f"only FULL_MASK (0) and QLEN_ONLY (1) are supported, got {tree_mask_mode}")
    _check(parent_list.dim() == 2, "parent_list must be 2-D")
    _index("parent_list", parent_list)
    bs = parent_list.shape[0]
    if depth > 1:
        _check(parent_list.shape[1] == topk * (depth - 1) + 1, "parent_list width must be topk * (depth - 1) + 1")
    dtype = parent_list.dtype
    expected = (
        (selected_index, (bs, draft_token_num - 1)),
        (verified_seq_len, (bs,)),
        (positions, (bs * draft_token_num,)),
        (retrive_index, (bs, draft_token_num)),
        (retrive_next_token, (bs, draft_token_num)),
        (retrive_next_sibling, (bs, draft_token_num)),
    )
    _check(all(t.dtype == dtype and tuple(t.shape) == s for t, s in expected), "tree tensor dtype or shape")
    _check(tree_mask.dtype == torch.bool, "tree_mask must be bool")
    seq_lens = verified_seq_len.tolist()
    rows_total = sum(seq_lens) + bs * draft_token_num if tree_mask_mode == 0 else bs * draft_token_num
    _check(tree_mask.numel() == rows_total * draft_token_num, "tree_mask size")

    parents, selected = parent_list.tolist(), selected_index.tolist()
    first_child, sibling = retrive_next_token.tolist(), retrive_next_sibling.tolist()
    n = draft_token_num
    flat_mask = tree_mask.view(-1)
    mask_offset = 0  # FULL_MASK: where request b's rows start
    for b in range(bs):
        for i in range(n - 1, 0, -1):
            parent = _parent_node(selected[b], parents[b], topk, i)
            if parent < 0:
                warnings.warn(
                    f"build_tree_kernel_efficient_cpu: invalid eagle tree, parent of node {i} not found", stacklevel=2
                )
                continue
            if first_child[b][parent] != -1:
                sibling[b][i] = first_child[b][parent]
            first_child[b][parent] = i

        rows = torch.zeros(n, n, dtype=torch.bool)  # [node, node]: the root, the node and its ancestors
        rows[:, 0] = True
        node_depth = [0] * n
        for t in range(1, n):
            node, steps = t, 0
            while steps < depth:  # a valid walk to the root has at most `depth` steps; a cyclic tree warns instead
                steps += 1
                rows[t, node] = True
                if selected[b][node - 1] // topk == 0:
                    break
                node = _parent_node(selected[b], parents[b], topk, node)
                if node < 0:
                    warnings.warn(
                        f"build_tree_kernel_efficient_cpu: invalid eagle tree, ancestor of {t} not found", stacklevel=2
                    )
                    break
            node_depth[t] = steps
        seq_len = seq_lens[b]
        if tree_mask_mode == 1:
            flat_mask[b * n * n : (b + 1) * n * n] = rows.view(-1)
        else:
            width = seq_len + n
            flat_mask[mask_offset : mask_offset + n * width].view(n, width)[:, seq_len:] = rows
            mask_offset += n * width
        positions[b * n : (b + 1) * n] = torch.tensor(node_depth, dtype=dtype) + seq_len

    retrive_index.copy_(torch.arange(bs * n, dtype=dtype).view(bs, n))
    retrive_next_token.copy_(torch.tensor(first_child, dtype=dtype).view(bs, n))
    retrive_next_sibling.copy_(torch.tensor(sibling, dtype=dtype).view(bs, n))


def _parent_node(selected: list[int], parents: list[int], topk: int, node: int) -> int:
    """Node `node`'s parent node: 0 for the root, -1 where the parent candidate is in no node (a malformed tree)."""
    slot = selected[node - 1] // topk
    if slot == 0:
        return 0
    candidate = parents[slot]
    return selected.index(candidate) + 1 if candidate in selected else -1


def reconstruct_indices_from_tree_mask_cpu(
    tree_mask: torch.Tensor,
    verified_seq_len: torch.Tensor,
    positions: torch.Tensor,
    retrive_index: torch.Tensor,
    retrive_next_token: torch.Tensor,
    retrive_next_sibling: torch.Tensor,
    batch_size: int,
    draft_token_num: int,
) -> None:
    """The tree linkage read back from a QLEN_ONLY tree mask (the n-gram path's trees).

    Follows ``reconstruct_indices_from_tree_mask_cpu`` in csrc/cpu/spec.cpp. Per node t of request b (mask
    ``m = tree_mask.view(bs, n, n)``): depth = the true cells of row t left of the diagonal, position = seq_len +
    depth, parent = the rightmost of them (-1: none), first child = the first later row i with m[i, t], next
    sibling = the first later row i whose parent is t's parent (the C++ tests m[i, parent] and no true cell between
    it and the diagonal, which is the same thing). retrive_index = the flat node index.
    """
    bs, n = batch_size, draft_token_num
    _check(tree_mask.dtype == torch.bool and tree_mask.numel() == bs * n * n, "tree_mask must be bool [bs * n * n]")
    _index("verified_seq_len", verified_seq_len)
    _check(verified_seq_len.numel() == bs, "verified_seq_len size")
    outs = (positions, retrive_index, retrive_next_token, retrive_next_sibling)
    _check(all(t.dtype == verified_seq_len.dtype and t.numel() == bs * n for t in outs), "output dtype or size")
    if bs == 0:
        return
    mask = tree_mask.view(bs, n, n)
    col = torch.arange(n)
    below = mask & (col.view(1, n) < col.view(n, 1))  # [bs, row, col]: strictly left of the diagonal
    depth = below.sum(-1)
    parent = torch.where(below.any(-1), (below * col).amax(-1), -1)  # [bs, n]
    later = col.view(n, 1) < col.view(1, n)  # [t, i]: i after t
    children = mask.transpose(1, 2) & later  # [bs, t, i]: row i attends to t
    same_parent = (parent.unsqueeze(2) == parent.unsqueeze(1)) & (parent.unsqueeze(2) != -1) & later
    positions.view(bs, n).copy_(depth + verified_seq_len.view(bs, 1))
    retrive_index.view(bs, n).copy_(torch.arange(bs * n).view(bs, n))
    retrive_next_token.view(bs, n).copy_(_first_true(children))
    retrive_next_sibling.view(bs, n).copy_(_first_true(same_parent))


def _first_true(flags: torch.Tensor) -> torch.Tensor:
    """Along the last dimension: the index of the first True, -1 where there is none."""
    return torch.where(flags.any(-1), flags.int().argmax(-1), -1)


def _spans(starts: torch.Tensor, ends: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """For per-request ranges [start, end): (request of each element, its position in the range, its packed
    offset, the packed total). The packed offsets are the exclusive prefix sum of end - start, as the C++ computes
    it (a negative length, a caller bug, shifts the later requests' offsets and writes nothing of its own)."""
    lengths = ends.long() - starts.long()
    offsets = torch.cumsum(lengths, 0) - lengths
    counts = lengths.clamp(min=0)
    request = torch.repeat_interleave(torch.arange(len(counts)), counts)
    within = torch.arange(int(counts.sum())) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
    return request, within, offsets[request] + within, int(lengths.sum())


def assign_req_to_token_pool_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Scatter new KV slots into the request-to-token map.

    Follows ``assign_req_to_token_pool_cpu`` in csrc/cpu/spec.cpp: ``req_to_token[req_pool_indices[i],
    start_offset[i]:end_offset[i]] = out_cache_loc[p_i : p_i + end_offset[i] - start_offset[i]]`` with p_i the
    exclusive prefix sum of the lengths. req_to_token [max_reqs, pool_len] int32, out_cache_loc int64.
    """
    _check(req_to_token.dim() == 2 and req_to_token.dtype == torch.int32, "req_to_token must be int32 [reqs, len]")
    _check(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _check(req_to_token.shape[1] == pool_len, "req_to_token width must be pool_len")
    _check(start_offset.dtype == end_offset.dtype, "start_offset and end_offset must share a dtype")
    for name, t in (("req_pool_indices", req_pool_indices), ("start_offset", start_offset)):
        _index(name, t)
    bs = req_pool_indices.numel()
    _check(start_offset.numel() == bs and end_offset.numel() == bs, "offsets size")
    request, within, packed, total = _spans(start_offset, end_offset)
    _check(total <= out_cache_loc.numel(), f"out_cache_loc has {out_cache_loc.numel()} entries, offsets need {total}")
    rows = req_pool_indices.long()[request]
    cols = start_offset.long()[request] + within
    req_to_token.view(-1)[rows * pool_len + cols] = out_cache_loc.view(-1)[packed].to(torch.int32)


def build_draft_decode_metadata_cpu(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    topk: int,
    num_steps: int,
    pool_len: int,
) -> torch.Tensor:
    """A request-to-token map per draft branch, for the draft's multi-step decode.

    Follows ``build_draft_decode_metadata_cpu`` in csrc/cpu/spec.cpp. Returns [num_seqs * topk, pool_len] int32:
    row b * topk + k holds request b's committed prefix (its first seq_lens[b] slots) followed by branch k's
    num_steps draft slots, which sit at seq_lens[b] + k * num_steps in request b's row. Only the first seq_lens[b]
    + num_steps entries of a row are defined (the C++ allocates it uninitialised).
    """
    _check(req_to_token.dim() == 2 and req_to_token.dtype == torch.int32, "req_to_token must be int32 [reqs, len]")
    _check(req_to_token.shape[1] == pool_len, "req_to_token width must be pool_len")
    _index("req_pool_indices", req_pool_indices)
    _index("seq_lens", seq_lens)
    num_seqs = req_pool_indices.numel()
    _check(seq_lens.numel() == num_seqs, "seq_lens size")
    out = torch.empty(num_seqs * topk, pool_len, dtype=req_to_token.dtype)
    flat = req_to_token.view(-1)
    for b, (row, seq_len) in enumerate(zip(req_pool_indices.tolist(), seq_lens.tolist())):
        base = row * pool_len
        for k in range(topk):
            out[b * topk + k, :seq_len] = flat[base : base + seq_len]
            draft = base + seq_len + k * num_steps
            out[b * topk + k, seq_len : seq_len + num_steps] = flat[draft : draft + num_steps]
    return out


def fill_bonus_tokens_cpu(
    accept_tokens: torch.Tensor, accept_lens: torch.Tensor, bonus_tokens: torch.Tensor, accept_stride: int
) -> None:
    """Each request's last accepted token (its bonus token).

    Follows ``fill_bonus_tokens_cpu`` in csrc/cpu/spec.cpp: ``bonus_tokens[b] = accept_tokens.flat[accept_stride *
    b + accept_lens[b] - 1]``; accept_lens counts the bonus token. All int32.
    """
    for name, t in (("accept_tokens", accept_tokens), ("accept_lens", accept_lens), ("bonus_tokens", bonus_tokens)):
        _check(t.dtype == torch.int32, f"{name} must be int32, got {t.dtype}")
    bs = accept_lens.numel()
    _check(accept_tokens.numel() == bs * accept_stride and bonus_tokens.numel() == bs, "accept_tokens / bonus size")
    where = torch.arange(bs) * accept_stride + accept_lens.long() - 1
    bonus_tokens.view(-1).copy_(accept_tokens.reshape(-1)[where])


def fill_accept_out_cache_loc_cpu(
    accept_index: torch.Tensor, out_cache_loc: torch.Tensor, accept_out_cache_loc: torch.Tensor
) -> None:
    """The accepted tokens' KV slots, packed: out_cache_loc at each accept_index entry that is not -1, in order.

    Follows ``fill_accept_out_cache_loc_cpu`` in csrc/cpu/spec.cpp. accept_index [bs, steps] (flat order), -1 for a
    rejected (or dropped) slot; accept_out_cache_loc int64, at least accept_index.numel() long, only the first
    (number accepted) entries written.
    """
    _index("accept_index", accept_index)
    _check(out_cache_loc.dtype == torch.int64 and accept_out_cache_loc.dtype == torch.int64, "cache locs int64")
    _check(accept_out_cache_loc.numel() >= accept_index.numel(), "accept_out_cache_loc shorter than accept_index")
    index = accept_index.reshape(-1).long()
    kept = index[index > -1]
    _check(bool((kept < out_cache_loc.numel()).all()), "fill_accept_out_cache_loc: accept_index out of range")
    accept_out_cache_loc.view(-1)[: kept.numel()] = out_cache_loc.reshape(-1)[kept]


def assign_draft_cache_locs_contiguous_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    seq_lens: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
    topk: int,
    num_steps: int,
) -> None:
    """The draft's KV slots read back from the request-to-token map: topk * num_steps per request, from seq_len.

    Follows ``assign_draft_cache_locs_contiguous_cpu`` in csrc/cpu/spec.cpp: ``out_cache_loc[b * topk * num_steps
    + j] = req_to_token[req_pool_indices[b], seq_lens[b] + j]``. out_cache_loc int64 [bs * topk * num_steps].
    """
    _check(req_to_token.dim() == 2 and req_to_token.dtype == torch.int32, "req_to_token must be int32 [reqs, len]")
    _check(req_to_token.shape[1] == pool_len, "req_to_token width must be pool_len")
    _check(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _index("req_pool_indices", req_pool_indices)
    _index("seq_lens", seq_lens)
    bs, width = req_pool_indices.numel(), topk * num_steps
    _check(out_cache_loc.numel() == bs * width and seq_lens.numel() == bs, "out_cache_loc / seq_lens size")
    # flat addressing, as the C++ pointer arithmetic reads req_to_token
    where = (req_pool_indices.long() * pool_len + seq_lens.long()).view(bs, 1) + torch.arange(width)
    out_cache_loc.view(-1).copy_(req_to_token.view(-1)[where.view(-1)].long())


def assign_extend_cache_locs_cpu(
    req_pool_indices: torch.Tensor,
    req_to_token: torch.Tensor,
    start_offset: torch.Tensor,
    end_offset: torch.Tensor,
    out_cache_loc: torch.Tensor,
    pool_len: int,
) -> None:
    """Each request's KV slots in [start_offset, end_offset), read from the request-to-token map and packed.

    Follows ``assign_extend_cache_locs_cpu`` in csrc/cpu/spec.cpp (the gather that assign_req_to_token_pool_cpu
    scatters). out_cache_loc int64, at least the packed total long (callers may size it larger; the tail is left).
    """
    _check(req_to_token.dim() == 2 and req_to_token.dtype == torch.int32, "req_to_token must be int32 [reqs, len]")
    _check(req_to_token.shape[1] == pool_len, "req_to_token width must be pool_len")
    _check(out_cache_loc.dtype == torch.int64, "out_cache_loc must be int64")
    _check(start_offset.dtype == end_offset.dtype, "start_offset and end_offset must share a dtype")
    _index("req_pool_indices", req_pool_indices)
    _index("start_offset", start_offset)
    bs = req_pool_indices.numel()
    _check(start_offset.numel() == bs and end_offset.numel() == bs, "offsets size")
    request, within, packed, total = _spans(start_offset, end_offset)
    _check(total <= out_cache_loc.numel(), f"out_cache_loc has {out_cache_loc.numel()} entries, offsets need {total}")
    source = req_pool_indices.long()[request] * pool_len + start_offset.long()[request] + within
    out_cache_loc.view(-1)[packed] = req_to_token.view(-1)[source].long()


def rotate_input_ids_cpu(
    input_ids: torch.Tensor,
    extend_start_loc: torch.Tensor,
    extend_seq_lens: torch.Tensor,
    topk_index: torch.Tensor,
    select_index: torch.Tensor | None = None,
) -> None:
    """Shift each request's extend segment of input_ids left by one and put its new draft token at the end.

    Follows ``rotate_input_ids_cpu`` in csrc/cpu/spec.cpp: for a segment [start, start + len), ids[start : start +
    len - 1] = ids[start + 1 : start + len], then (len > 0) ids[start + len - 1] = topk_index[b], or ids[
    select_index[b]] when select_index is given. In place; input_ids, topk_index, select_index int64.
    """
    _check(input_ids.dtype == torch.int64 and topk_index.dtype == torch.int64, "input_ids / topk_index int64")
    _index("extend_start_loc", extend_start_loc)
    _index("extend_seq_lens", extend_seq_lens)
    bs = extend_seq_lens.numel()
    _check(extend_start_loc.numel() == bs and topk_index.numel() == bs, "extend_start_loc / topk_index size")
    if select_index is not None:
        _check(select_index.dtype == torch.int64 and select_index.numel() == bs, "select_index int64 [bs]")
    ids = input_ids.view(-1)
    tokens = topk_index.tolist()
    slots = select_index.tolist() if select_index is not None else [None] * bs
    for start, length, token, slot in zip(extend_start_loc.tolist(), extend_seq_lens.tolist(), tokens, slots):
        if length > 1:
            ids[start : start + length - 1] = ids[start + 1 : start + length].clone()
        if length > 0:
            ids[start + length - 1 if slot is None else slot] = token


IMPLS = {
    "verify_tree_greedy_cpu": verify_tree_greedy_cpu,
    "build_tree_kernel_efficient_cpu": build_tree_kernel_efficient_cpu,
    "reconstruct_indices_from_tree_mask_cpu": reconstruct_indices_from_tree_mask_cpu,
    "assign_req_to_token_pool_cpu": assign_req_to_token_pool_cpu,
    "build_draft_decode_metadata_cpu": build_draft_decode_metadata_cpu,
    "fill_bonus_tokens_cpu": fill_bonus_tokens_cpu,
    "fill_accept_out_cache_loc_cpu": fill_accept_out_cache_loc_cpu,
    "assign_draft_cache_locs_contiguous_cpu": assign_draft_cache_locs_contiguous_cpu,
    "assign_extend_cache_locs_cpu": assign_extend_cache_locs_cpu,
    "rotate_input_ids_cpu": rotate_input_ids_cpu,
}
