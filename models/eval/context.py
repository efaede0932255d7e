"""Acceptance length by context position: an eval's verify rounds in buckets of where each one starts.

A round's context position is the number of tokens before its first draft token: the prompt's, plus those generated
before the round (the prefill's token included; models/eval/speculative_decoding.py `_Round.start`). The buckets are
[0, e1), [e1, e2), ..., [e_last, inf) for the ascending edges of `eval.context_buckets`. A bucket's acceptance length
is the mean over its rounds of the tokens each round added (accepted + 1; a round cut by eos or max_new_tokens with
what it kept), as the overall figure counts: the overall acceptance length is the round-weighted mean of the buckets'.

Why: published drafts lose acceptance with context (speculators PR #684: a Qwen3-8B EAGLE-3 draft from 2.30 at 2k
tokens to 1.08 at 20k), and Kimi-K2.5's answers are 1,400-3,800 tokens long. Measured by the in-process eval only: a
serving engine reports a request's verify rounds, not where each one was.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from typing import Any


def bucket_of(position: int, edges: Sequence[int]) -> int:
    """The index of the bucket holding `position`: 0 for [0, edges[0]), len(edges) for [edges[-1], inf)."""
    return bisect_right(edges, position)


def bucket_label(lo: int, hi: int | None) -> str:
    """`lo-hi` (hi excluded) or `lo+` for the last bucket, e.g. 512-1024, 32768+."""
    return f"{lo}+" if hi is None else f"{lo}-{hi}"


def by_context(rounds: Sequence[int], tokens: Sequence[int], edges: Sequence[int]) -> list[dict[str, Any]]:
    """The non-empty buckets of per-bucket round and token counts (len(edges) + 1 each): {"from", "to" (excluded; None
    for the last), "label", "rounds", "tokens", "acceptance_length"}, in position order."""
    if not (len(rounds) == len(tokens) == len(edges) + 1):
        raise ValueError(f"{len(edges)} edges make {len(edges) + 1} buckets: {len(rounds)}, {len(tokens)} counts")
    bounds = [0, *edges]
    out = []
    for i, (r, t) in enumerate(zip(rounds, tokens)):
        if r:
            hi = edges[i] if i < len(edges) else None
            out.append(
                {
                    "from": bounds[i],
                    "to": hi,
                    "label": bucket_label(bounds[i], hi),
                    "rounds": r,
                    "tokens": t,
                    "acceptance_length": round(t / r, 4),
                }
            )
    return out


def context_text(buckets: list[dict[str, Any]]) -> str:
    """`0-512: 1.852 (120 rounds), 512-1024: ...` for a log line; `-` for none."""
    return ", ".join(f"{b['label']}: {b['acceptance_length']:.3f} ({b['rounds']} rounds)" for b in buckets) or "-"
