"""Context probes: held-out records cut at each context bucket's lower edge, for acceptance by context position in
any engine.

A target that reasons at length (Kimi-K2.5: 1,400-3,800-token answers) fills the buckets with its own answers, but an
engine that reports a request's totals only (SGLang 0.5.23: meta_info.spec_verify_ct) cannot say where in a long
answer each verify round was (models/eval/context.py). A probe can: a held-out record's own tokens (the prompt and the
target's answer so far, as the generate stage recorded them) up to exactly `edge` tokens, cut inside an answer, then
continued greedily for a few tokens. Its rounds start at edge + 1 .. edge + new tokens - 1, inside the bucket [edge,
next edge) when the new tokens are fewer than the bucket is wide, so every engine places it whole (`request_bucket`)
and the in-process eval places each round; both decode the same token ids, so the two can be compared as the eval
prompts are.

What a probe measures: the draft at that position of the target's own text. The context is the recorded answer
(sampled as the generate stage sampled it), not the greedy continuation the eval decodes: close to, not the same as,
where a greedy answer of that length would be.

`probe_rows` writes them as an `ids` benchmark's rows ({id, input_ids}; models/eval/benchmarks.py), decoded as the
benchmark `context_probes` (`eval.context_probes`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any


def probe_rows(
    records: Iterable[tuple[str, str, list[int], list[bool]]], edges: Sequence[int], per_edge: int
) -> list[dict[str, Any]]:
    """Up to `per_edge` probes at each edge: {"id": "<dataset>/<id>@<edge>", "input_ids": the record's first `edge`
    tokens}, from the records (dataset, id, token ids, loss mask; in their order) whose token at `edge` is a loss
    token: the cut falls inside one of the target's answers, where the target writes next. A record may probe several
    edges; the rows come shortest first."""
    wanted = {edge: per_edge for edge in edges}
    rows: list[dict[str, Any]] = []
    for dataset, sid, ids, mask in records:
        for edge in edges:
            if wanted[edge] and edge < len(ids) and mask[edge]:
                rows.append({"id": f"{dataset}/{sid}@{edge}", "input_ids": ids[:edge]})
                wanted[edge] -= 1
        if not any(wanted.values()):
            break
    return sorted(rows, key=lambda r: len(r["input_ids"]))
