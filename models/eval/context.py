"""Acceptance length by context position: an eval's verify rounds in buckets of where each one starts.

A round's context position is the number of tokens before its first draft token: the prompt's, plus those generated
before the round (the prefill's token included; models/eval/speculative_decoding.py `_Round.start`). The buckets are
[0, e1), [e1, e2), ..., [e_last, inf) for the ascending edges of `eval.context_buckets`. A bucket's acceptance length
is the mean over its rounds of the tokens each round added (accepted + 1; a round cut by eos or max_new_tokens with
what it kept), as the overall figure counts: the overall acceptance length is the round-weighted mean of the buckets'.

Why: published drafts lose acceptance with context (speculators PR #684: a Qwen3-8B EAGLE-3 draft from 2.30 at 2k
tokens to 1.08 at 20k), and Kimi-K2.5's answers are 1,400-3,800 tokens long.

Who measures them: the in-process eval, from its own decoding; and vLLM, whose replies carry the accepted draft
tokens of each verify round in order (`--per-request-spec-decode-metrics detailed`:
metrics.speculative_decoding.per_step_accepted, vllm/v1/metrics/stats.py RequestSpecDecodeMetrics, 0.32.0).
`rounds_from_steps` places those rounds. SGLang 0.5.23 reports a request's totals only (meta_info.spec_verify_ct):
a request is placed whole where all its rounds start in one bucket (`request_bucket`), which a long prompt with a
short answer does (data/eval/long_context.jsonl); one whose answer crosses an edge is not placed, and said.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Iterable, Sequence
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


def rounds_from_steps(prompt_tokens: int, completion_tokens: int, accepted: Sequence[int]) -> list[tuple[int, int]]:
    """(start, kept) of each verify round of one greedy request, from the draft tokens each round accepted, in order.

    The prefill's forward gives the first token, so round i starts after the prompt, that token and the rounds before
    it: start_i = prompt_tokens + 1 + sum(accepted_j + 1 for j < i). A round adds its accepted tokens and the target's
    own, except that the end (a stop token or max_tokens) may cut the last one: vLLM counts a round's accepted drafts
    before the stop check trims the output (v1/core/sched/scheduler.py `update_from_output`, 0.32.0), as the in-process
    eval's `_Round.accepted` does, so the last round keeps what is left of `completion_tokens`.

    ValueError when the rounds cannot be placed: a negative count, a round that would start after the answer ended, or
    rounds that leave answer tokens unmade. vLLM makes the last one itself: a step that schedules no draft tokens for a
    request (its token budget cut them, scheduler.py `schedule`) decodes one token and is no verify step, so the
    rounds after it start later than their counts say.
    """
    if any(type(a) is not int or a < 0 for a in accepted):
        raise ValueError(f"accepted draft tokens per round must be non-negative ints, got {list(accepted)[:20]}")
    rounds, made = [], 1  # the prefill's token
    for i, a in enumerate(accepted):
        if made >= completion_tokens:
            raise ValueError(
                f"round {i + 1} of {len(accepted)} starts after the answer's {completion_tokens} tokens were made"
            )
        kept = min(a + 1, completion_tokens - made)
        rounds.append((prompt_tokens + made, kept))
        made += kept
    if made < completion_tokens:
        raise ValueError(f"{len(accepted)} rounds make {made} of the answer's {completion_tokens} tokens")
    return rounds


def request_bucket(prompt_tokens: int, completion_tokens: int, edges: Sequence[int]) -> int | None:
    """The bucket every verify round of a request starts in, when they all start in one; else None.

    For an engine that reports a request's totals only (SGLang's spec_verify_ct): whatever the rounds' sizes, they start
    after the prompt and the prefill's token and before the last answer token, at prompt_tokens + 1 ..
    prompt_tokens + completion_tokens - 1. When both ends fall in one bucket the request's rounds and their tokens
    (completion_tokens - 1) are that bucket's, exactly.
    """
    first, last = prompt_tokens + 1, prompt_tokens + max(completion_tokens - 1, 1)
    b = bucket_of(first, edges)
    return b if bucket_of(last, edges) == b else None


def count_rounds(rounds: Iterable[tuple[int, int]], edges: Sequence[int]) -> tuple[list[int], list[int]]:
    """Rounds and their tokens per bucket (len(edges) + 1 each) of (start, kept) rounds, for `by_context`."""
    in_bucket, tokens = [0] * (len(edges) + 1), [0] * (len(edges) + 1)
    for start, kept in rounds:
        b = bucket_of(start, edges)
        in_bucket[b] += 1
        tokens[b] += kept
    return in_bucket, tokens


def context_text(buckets: list[dict[str, Any]]) -> str:
    """`0-512: 1.852 (120 rounds), 512-1024: ...` for a log line; `-` for none."""
    return ", ".join(f"{b['label']}: {b['acceptance_length']:.3f} ({b['rounds']} rounds)" for b in buckets) or "-"
