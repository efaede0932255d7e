"""The eval's engine backend, its figures: acceptance length and speedup measured where the draft will be served.

The prompts go through the eval's server (tasks/serving/eval_server.py, which starts it and decodes them).

The eval prompts (models/eval/prompts.py, the same ones the HF backend decodes) go greedily through
the serving engine (`server.engine`: SGLang's /generate or vLLM's /v1/completions, tasks/serving/),
first to a server that serves the target with the exported draft, then (for the speedup) to one
without it. From each reply's verify rounds (SGLang's meta_info.spec_verify_ct, vLLM's
metrics.speculative_decoding.num_spec_steps with --per-request-spec-decode-metrics):

- acceptance length, SGLang's way: sum(completion_tokens) / sum(verify rounds), over the requests
  (SpecForge's benchmark sums the same way). It counts the token of the prefill forward too.
- per round: sum(completion_tokens - 1) / sum(verify rounds), the mean tokens per verify round,
  which is how the HF backend (models/eval/speculative_decoding.py) and SGLang's own `avg_spec_accept_length` count.
  On the same prompts, target and draft, it equals the HF backend's acceptance length exactly.

Both per dataset (the prompt's source) and overall, with the per-request distribution, and the
decode speed in completion tokens/s of each phase. The rounds by context position
(models/eval/context.py): where the engine sends each verify round's accepted draft tokens in
order (vLLM with --per-request-spec-decode-metrics detailed), each round where it starts, and
each prompt's rounds one by one, which the HF backend's are compared with round by round
(`compare_with_hf`); where it sends a request's totals only (SGLang 0.5.23), whole requests
whose rounds all start in one bucket. Every figure comes from the requests' own
counts. SGLang's `internal_states[0].avg_spec_accept_length` is reported beside them, labelled
for what it is in SGLang 0.5.23 (managers/scheduler_components/metrics_reporter.py): folded in only
every 40 decode batches, reset by /flush_cache, over all the traffic the server has seen (warm-up,
health probes and other clients included), so it need not equal the eval's figure. vLLM's
/metrics counters are server-wide too (and count one more accepted token per prompt that ends on a
stop token): they are not read.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Sequence
from typing import Any

from models.eval.context import by_context, count_rounds, request_bucket
from tasks.serving.eval_server import Phase, Served


def acceptance(served: list[Served]) -> dict[str, Any]:
    """SGLang's acceptance length and the per-round mean over `served` (module docstring),
    with the per-request spread."""
    tokens = sum(s.completion_tokens for s in served)
    verify = sum(s.spec_verify_ct or 0 for s in served)
    per_request = sorted(s.completion_tokens / s.spec_verify_ct for s in served if s.spec_verify_ct)
    return {
        "prompts": len(served),
        "completion_tokens": tokens,
        "verify_rounds": verify,
        "acceptance_length": round(tokens / verify, 4) if verify else None,
        "per_round": round((tokens - len(served)) / verify, 4) if verify else None,
        "per_request": spread(per_request),
    }


def context_of(served: list[Served], edges: Sequence[int]) -> dict[str, Any]:
    """The rounds of `served` by context position (models/eval/context.py): {"by_context", "placed_by": "round" (each
    round from the engine's per-round counts) | "request" (whole requests whose rounds all start in one bucket: an
    engine that sends totals only) | "round and request", "unplaced": prompt id -> why its rounds are not in the
    buckets (only when some are not)}; {} without replies that carry verify rounds."""
    counted = [s for s in served if s.spec_verify_ct is not None]
    if not counted:
        return {}
    rounds_in, tokens_in = [0] * (len(edges) + 1), [0] * (len(edges) + 1)
    unplaced: dict[str, str] = {}
    by: set[str] = set()
    for s in counted:
        if not s.spec_verify_ct:  # no verify round (ended on the prefill's token): nothing to place
            continue
        try:
            rounds = s.rounds()
        except ValueError as e:
            unplaced[s.id] = f"its per-round counts cannot be placed: {e}"
            continue
        if rounds is not None:
            r, t = count_rounds(rounds, edges)
            rounds_in = [a + b for a, b in zip(rounds_in, r)]
            tokens_in = [a + b for a, b in zip(tokens_in, t)]
            by.add("round")
        elif (b := request_bucket(s.prompt_tokens, s.completion_tokens, edges)) is not None:
            rounds_in[b] += s.spec_verify_ct
            tokens_in[b] += s.completion_tokens - 1
            by.add("request")
        else:
            unplaced[s.id] = (
                f"its rounds start at {s.prompt_tokens + 1}-{s.prompt_tokens + s.completion_tokens - 1} tokens, across "
                "a bucket edge, and the engine sent the request's totals only"
            )
    out: dict[str, Any] = {
        "by_context": by_context(rounds_in, tokens_in, edges),
        "placed_by": " and ".join(sorted(by, reverse=True)) or None,
    }
    if unplaced:
        out["unplaced"] = unplaced
    return out


def spread(values: list[float]) -> dict[str, float] | None:
    """min, p10, median, p90, max of sorted `values` (None when empty)."""
    if not values:
        return None

    def at(q: float) -> float:
        return round(values[min(len(values) - 1, int(q * len(values)))], 4)

    return {
        "min": round(values[0], 4),
        "p10": at(0.1),
        "median": round(statistics.median(values), 4),
        "p90": at(0.9),
        "max": round(values[-1], 4),
    }


def speed(served: list[Served], wall_s: float) -> dict[str, Any]:
    """Decode speed of one phase: completion tokens over the wall time, and over the requests' own times."""
    tokens = sum(s.completion_tokens for s in served)
    busy = sum(s.seconds for s in served)
    return {
        "completion_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(tokens / wall_s, 2) if wall_s > 0 else None,
        "tokens_per_s_per_request": round(tokens / busy, 2) if busy > 0 else None,
    }


def engine_report(
    with_draft: Phase,
    without: Phase | None,
    num_steps: int,
    concurrency: int,
    engine: str = "sglang",
    context_edges: Sequence[int] = (),
) -> dict[str, Any]:
    """eval.json's `engine` block: acceptance and speed per dataset and overall, the speedup over no draft, and the
    rounds by context position (`context_edges`) where the engine sent each round's counts."""
    sources = sorted({s.source for s in with_draft.served})
    by_source = {src: [s for s in with_draft.served if s.source == src] for src in sources}
    base_by_source = {src: [s for s in without.served if s.source == src] for src in sources} if without else {}
    datasets = {}
    for src, served in by_source.items():
        row = {
            **acceptance(served),
            **context_of(served, context_edges),
            "with_draft": speed(served, sum(s.seconds for s in served)),
        }
        if without is not None:
            base = base_by_source[src]
            row["without_draft"] = speed(base, sum(s.seconds for s in base))
            row["speedup"] = speedup(served, sum(s.seconds for s in served), base, sum(s.seconds for s in base))
        datasets[src] = row
    info = with_draft.limits.info
    internal = info.get("internal_states") if isinstance(info, dict) else None
    server_avg = (
        internal[0].get("avg_spec_accept_length")
        if isinstance(internal, list) and internal and isinstance(internal[0], dict)
        else None
    )
    report: dict[str, Any] = {
        "engine": engine,
        "num_steps": num_steps,
        "concurrency": concurrency,
        "overall": {
            **acceptance(with_draft.served),
            **context_of(with_draft.served, context_edges),
            "with_draft": speed(with_draft.served, with_draft.wall_s),
        },
        "datasets": datasets,
        "server": {
            "version": info.get("version") if isinstance(info, dict) else None,  # the dev server's ends -eagle3-dev
            "speculative_draft_model_path": with_draft.limits.speculative.get("path"),
            "avg_spec_accept_length": server_avg,
            "note": "server-wide, not this eval's: SGLang folds it in every 40 decode batches, resets it on "
            "/flush_cache, and counts all traffic (warm-up, health probes, other clients); the figures "
            "above are from this eval's requests (their own verify rounds). vLLM reports no such figure "
            "per server over HTTP (its /metrics counters are not read)",
        },
        "refused": with_draft.refused,
        "skipped": with_draft.skipped,
        "per_prompt": [per_prompt(s) for s in with_draft.served],
    }
    if without is not None:
        report["overall"]["without_draft"] = speed(without.served, without.wall_s)
        report["overall"]["speedup"] = speedup(with_draft.served, with_draft.wall_s, without.served, without.wall_s)
        changed = [
            s.id
            for s, b in zip(sorted(with_draft.served, key=lambda s: s.id), sorted(without.served, key=lambda s: s.id))
            if s.id == b.id and s.output_ids != b.output_ids
        ]
        report["outputs_differ_without_draft"] = len(
            changed
        )  # greedy: 0 unless numerics differ between the two servers
    return report


def per_prompt(s: Served) -> dict[str, Any]:
    """One reply's counts for eval.json; "round_tokens": the tokens each verify round added, in order, where the engine
    sent per-round counts that place them."""
    row: dict[str, Any] = {
        "source": s.source,
        "id": s.id,
        "completion_tokens": s.completion_tokens,
        "spec_verify_ct": s.spec_verify_ct,
    }
    with contextlib.suppress(ValueError):
        if (rounds := s.rounds()) is not None:
            row["round_tokens"] = [kept for _, kept in rounds]
    return row


def compare_with_hf(engine: dict[str, Any], hf_trained: dict[str, Any]) -> dict[str, Any]:
    """The engine's per-round acceptance against the HF backend's on the same prompts, per prompt and overall."""
    hf_rows = {(row["source"], row["id"]): row for row in hf_trained.get("per_prompt", [])}
    same = [(hf_rows[(p["source"], p["id"])], p) for p in engine["per_prompt"] if (p["source"], p["id"]) in hf_rows]
    equal_tokens = sum(hf["new_tokens"] == p["completion_tokens"] for hf, p in same)
    equal_rounds = sum(hf["rounds"] == (p["spec_verify_ct"] or 0) for hf, p in same)
    out: dict[str, Any] = {
        "prompts_compared": len(same),
        "same_completion_tokens": equal_tokens,
        "same_verify_rounds": equal_rounds,
        "hf_acceptance_length": hf_trained["acceptance_length"],
        "engine_per_round": engine["overall"]["per_round"],
        "equal": len(same) > 0
        and equal_tokens == equal_rounds == len(same)
        and engine["overall"]["per_round"] == hf_trained["acceptance_length"],
    }
    ordered = [(hf, p) for hf, p in same if "round_tokens" in p and "round_tokens" in hf]
    if ordered:  # the engine sent each round's counts: the same rounds in the same order, and so the same buckets
        out["prompts_compared_round_by_round"] = len(ordered)
        out["same_rounds_in_order"] = sum(hf["round_tokens"] == p["round_tokens"] for hf, p in ordered)
        out["same_by_context"] = engine["overall"].get("by_context") == hf_trained.get("by_context")
        out["equal"] = out["equal"] and out["same_rounds_in_order"] == len(ordered) and out["same_by_context"]
    return out


def speedup(with_draft: list[Served], with_s: float, without: list[Served], without_s: float) -> float | None:
    """Tokens/s with the draft over tokens/s without it (None when either is unknown)."""
    a, b = sum(s.completion_tokens for s in with_draft), sum(s.completion_tokens for s in without)
    if not (a and b and with_s > 0 and without_s > 0):
        return None
    return round((a / with_s) / (b / without_s), 3)
