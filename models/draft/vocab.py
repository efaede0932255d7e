"""The draft vocabulary: the target tokens an EAGLE-3 draft can propose, and the maps SGLang loads.

A draft's lm_head covers only `D` of the target's `V` tokens (Kimi: 32000 of 163840), the most
frequent loss-masked tokens of the training data. Draft index `i` (0..D-1) stands for target id
`draft_ids[i]`, with `draft_ids` sorted ascending. Serving engines load two buffers:

    d2t  int64 [D]   d2t[i] = draft_ids[i] - i     (an offset, so target id = i + d2t[i])
    t2d  bool  [V]   t2d[j] = j is in the draft vocab
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)


def draft_vocab(
    counts: np.ndarray | Mapping[int, int], target_vocab_size: int, draft_vocab_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t int64 [D], t2d bool [V]) for the `draft_vocab_size` most frequent ids, D = min(draft_vocab_size, V).

    `counts` is a dense array indexed by token id (shorter than V is zero-padded) or {id: count}.
    Ranking is by count descending, ties by id ascending; when fewer than D ids ever occur, the
    never-seen ids fill the rest in id order (so D is exact). The chosen ids are sorted by id.
    """
    vocab = int(target_vocab_size)
    if vocab < 1:
        raise ValueError(f"target_vocab_size must be >= 1, got {target_vocab_size}")
    if int(draft_vocab_size) < 1:
        raise ValueError(f"draft_vocab_size must be >= 1, got {draft_vocab_size}")
    dense = _dense_counts(counts, vocab)
    size = min(int(draft_vocab_size), vocab)
    # A stable sort of -count keeps equal counts in id order: ties go to the lower id.
    ranked = np.argsort(-dense, kind="stable")
    ids = torch.from_numpy(np.sort(ranked[:size]).astype(np.int64))  # [D] target ids, ascending
    d2t = ids - torch.arange(size, dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids] = True
    return d2t, t2d


def draft_to_target_ids(d2t: torch.Tensor) -> torch.Tensor:
    """Target id of every draft index: LongTensor [D] = arange(D) + d2t."""
    d2t = torch.as_tensor(d2t)
    return torch.arange(d2t.shape[0], dtype=torch.int64, device=d2t.device) + d2t.to(torch.int64)


def draft_vocab_coverage(counts: np.ndarray | Mapping[int, int], t2d: torch.Tensor) -> float:
    """Fraction of all counted tokens that fall inside the draft vocab (1.0 when nothing was counted)."""
    dense = _dense_counts(counts, int(t2d.shape[0]))
    total = int(dense.sum())
    if total == 0:
        return 1.0
    return float(dense[t2d.cpu().numpy()].sum()) / total


def load_token_counts(path: str | Path, vocab_size: int) -> np.ndarray:
    """Dense int64 [vocab_size] counts from a Parquet file (or directory) with columns token_id, count.

    Repeated ids (e.g. one row per shard) are summed.
    """
    import pyarrow.parquet as pq

    table = pq.read_table(str(path), columns=["token_id", "count"])
    ids = table.column("token_id").to_numpy(zero_copy_only=False).astype(np.int64)
    cnt = table.column("count").to_numpy(zero_copy_only=False).astype(np.int64)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        bad = ids[(ids < 0) | (ids >= vocab_size)][0]
        raise ValueError(f"{path}: token_id {bad} outside the target vocab [0, {vocab_size})")
    if cnt.size and cnt.min() < 0:
        raise ValueError(f"{path}: negative count {cnt.min()}")
    dense = np.zeros(vocab_size, dtype=np.int64)
    np.add.at(dense, ids, cnt)
    return dense


def _dense_counts(counts: np.ndarray | Mapping[int, int], vocab: int) -> np.ndarray:
    """Counts as int64 [vocab]; raises on negative counts or ids outside the vocab."""
    if isinstance(counts, Mapping):
        dense = np.zeros(vocab, dtype=np.int64)
        for token, n in counts.items():
            token, n = int(token), int(n)
            if not 0 <= token < vocab:
                raise ValueError(f"token id {token} outside the target vocab [0, {vocab})")
            if n < 0:
                raise ValueError(f"negative count {n} for token {token}")
            dense[token] += n
        return dense
    arr = np.asarray(counts)
    if arr.ndim != 1:
        raise ValueError(f"counts must be 1-D (indexed by token id), got shape {arr.shape}")
    if arr.size and arr.min() < 0:
        raise ValueError(f"negative count {arr.min()} in counts")
    if arr.shape[0] > vocab:
        if np.any(arr[vocab:]):
            raise ValueError(f"counts has nonzero entries at ids >= the target vocab size {vocab}")
        arr = arr[:vocab]
    dense = np.zeros(vocab, dtype=np.int64)
    dense[: arr.shape[0]] = arr.astype(np.int64)
    return dense
