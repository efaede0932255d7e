"""The eval's engine backend: acceptance length and speedup measured where the draft will be served.

The eval prompts (models/eval/prompts.py, the same ones the HF backend decodes) go greedily through
the serving engine (`server.engine`: SGLang's /generate or vLLM's /v1/completions, tasks/engines/),
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

Both phases decode the same prompts. With an EAGLE draft SGLang reserves max(topk * num_steps,
num_draft_tokens) tokens of context per request (managers/tokenizer_manager.py
`_validate_one_request`, managers/utils.py `compute_num_reserved_tokens`), so a prompt near the
context limit is refused only by the server with the draft: such prompts are left out of both
phases before anything is sent (`fit_draft_context`), and the baseline decodes exactly the prompts
the draft phase served.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import statistics
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.common.jobs import ServerSettings
from models.eval.context import by_context, count_rounds, request_bucket, rounds_from_steps
from models.eval.prompts import EvalPrompt
from tasks.engines import client_class
from tasks.engines.client import RetryPolicy, ServerLimits
from tasks.engines.errors import BadRequest
from tasks.heartbeat import Heartbeat
from tasks.launch_servers import SERVER_LOG, ServerProcess, launched_servers
from tasks.server_watch import ServerWatch


@dataclass(frozen=True)
class EvalServer:
    """The server the engine eval measures at: started here (launch dev|command, one server) or already running."""

    settings: (
        ServerSettings  # url: where the server with the draft answers; the engine; timeouts; the API key's variable
    )
    launch: str  # none | dev | command
    target: str
    log_dir: Path
    command: list[str] | None = None
    gpus_per_replica: int | None = None
    trust_remote_code: bool = False  # the dev server's: the target's tokenizer is remote code (Kimi-K2.5's)

    @property
    def engine(self) -> str:
        return self.settings.engine

    def speculative_args(self, draft_dir: str, num_steps: int) -> list[str]:
        """The engine's launch flags that serve `draft_dir` as a chain draft of num_steps tokens per round."""
        return client_class(self.engine).speculative_args(draft_dir, num_steps)

    def serving(
        self, extra_args: list[str], name: str, logger: Any, beat: Heartbeat | None = None
    ) -> contextlib.AbstractContextManager:
        """The server with `extra_args` (the draft's flags, or none) for one phase;
        nothing to start with launch: none.

        With `beat`, the wait for its health check and its stop are the heartbeat's steps (a line every ~10 s while
        a server loads for minutes), and a line says when it answered."""
        if self.launch == "none":
            return contextlib.nullcontext()
        log_path = self.log_dir / name / SERVER_LOG
        logger.info(
            "engine eval: starting the %s server (%s) at %s %s(log: %s)",
            self.launch,
            self.engine,
            self.settings.url,
            "with the draft " if extra_args else "without a draft ",
            log_path,
        )
        servers = launched_servers(
            self.launch,
            self.settings.url,
            gpus_per_replica=self.gpus_per_replica,
            target=Path(self.target),
            command=self.command,
            log_dir=self.log_dir / name,
            health_timeout_s=self.settings.health_timeout_s,
            extra_args=extra_args,
            engine=self.engine,
            trust_remote_code=self.trust_remote_code,
        )
        if beat is None:
            return servers
        what = (
            f"the {self.launch} server {'with the draft' if extra_args else 'without a draft'} at {self.settings.url}"
        )
        return announced(servers, beat, what, log_path)

    def watch(self, launched: list[ServerProcess] | None) -> ServerWatch | None:
        """What ends a phase at once when the server it launched (`launched`, what `serving` yielded) dies; None
        for launch: none (a server someone else runs may come back within the outage window)."""
        name = "dev server" if self.launch == "dev" else f"{self.engine} server"
        return ServerWatch.of(launched, self.settings.outage_window_s, name)


@contextlib.contextmanager
def announced(servers: contextlib.AbstractContextManager, beat: Heartbeat, what: str, log_path: Path) -> Iterator[Any]:
    """`servers` (a `launched_servers` context) with its start and stop as the heartbeat's steps: "waiting for WHAT to
    answer its health check (log ...): N s so far" every ~10 s while it loads, a line once it answers, "stopping WHAT"
    while it stops."""
    started = beat.clock()
    beat.doing(f"engine eval: waiting for {what} to answer its health check (log: {log_path})")
    try:
        with servers as launched:
            beat.log(f"engine eval: {what} answers its health check after {beat.clock() - started:.0f} s")
            beat.doing(None)  # the phase's own steps say what they do
            try:
                yield launched
            finally:
                beat.doing(f"engine eval: stopping {what}")
    finally:
        beat.doing(None)


@dataclass(frozen=True)
class Served:
    """One eval prompt's reply."""

    source: str
    id: str
    completion_tokens: int
    spec_verify_ct: int | None
    seconds: float  # from sending the request to its reply, measured here
    output_ids: tuple[int, ...]
    prompt_tokens: int  # the prompt's ids sent
    # the draft tokens each verify round accepted, in order (vLLM detailed metrics); None when the engine has no list
    accepted: tuple[int, ...] | None = None

    def rounds(self) -> list[tuple[int, int]] | None:
        """(start, kept) of each verify round (models/eval/context.py `rounds_from_steps`); None when the engine sent
        no per-round counts. ValueError when they cannot be placed."""
        if self.accepted is None:
            return None
        return rounds_from_steps(self.prompt_tokens, self.completion_tokens, self.accepted)


@dataclass(frozen=True)
class Phase:
    """One pass over the eval prompts at one server: the replies, the ones refused or left out, the wall time."""

    served: list[Served]
    refused: dict[str, str]  # prompt id -> the server's message (HTTP 400: e.g. longer than it takes)
    wall_s: float
    limits: ServerLimits  # what the server said of itself after the pass
    skipped: dict[str, str] = field(default_factory=dict)  # prompt id -> why it was not sent (select)


def fit_draft_context(
    prompts: list[EvalPrompt], limits: ServerLimits, max_new_tokens: int
) -> tuple[list[EvalPrompt], dict[str, str]]:
    """The prompts the draft server takes with its reserved tokens (SGLang's two length checks),
    and why the others not."""
    ctx, reserved = limits.context_length, limits.reserved_tokens
    if ctx is None:
        return prompts, {}
    kept, skipped = [], {}
    for p in prompts:
        n = len(p.input_ids) + reserved
        if n >= ctx or n + max_new_tokens > ctx:
            skipped[p.id] = (
                f"{len(p.input_ids)} prompt tokens + {reserved} reserved for the draft + {max_new_tokens} new "
                f"exceed the context of {ctx}"
            )
        else:
            kept.append(p)
    return kept, skipped


async def decode_prompts(
    url: str,
    prompts: list[EvalPrompt],
    sampling_params: dict[str, Any],
    *,
    engine: str = "sglang",
    concurrency: int,
    retry: RetryPolicy,
    request_timeout_s: float,
    api_key: str | None,
    auth_hint: str,
    vocab_size: int | None,
    on_done: Callable[[int, int], Awaitable[None]] | None = None,
    select: Callable[[ServerLimits, Any], tuple[list[EvalPrompt], dict[str, str]]] | None = None,
    logger: Any = None,
    watch: ServerWatch | None = None,
) -> Phase:
    """Every prompt through the engine at `url`, `concurrency` at a time, each retried within the outage window.

    `select(limits, client)` gets what the server says of itself before anything is sent and returns the prompts
    to send and why the others are not (it raises to send nothing). `watch`: the server the eval launched, whose
    death ends the phase at once with EngineDied (tasks/server_watch.py) instead of the outage window's retries.
    """
    gate = asyncio.Semaphore(concurrency)
    done = 0
    refused: dict[str, str] = {}
    kw = {"logger": logger} if logger is not None else {}
    async with client_class(engine)(
        url,
        request_timeout_s=request_timeout_s,
        retry=retry,
        api_key=api_key,
        auth_hint=auth_hint,
        vocab_size=vocab_size,
        max_connections=max(concurrency, 1),
        on_failure=watch.after_failure if watch is not None else None,
        **kw,
    ) as client:

        async def one(i: int, p: EvalPrompt) -> Served | None:
            nonlocal done
            async with gate:
                started = time.perf_counter()
                try:
                    reply = await client.generate(p.input_ids, sampling_params, f"eval-{i}-{p.id}")
                except BadRequest as e:
                    refused[p.id] = str(e)
                    reply = None
                seconds = time.perf_counter() - started
            done += 1
            if on_done is not None:
                await on_done(done, len(prompts))
            if reply is None:
                return None
            return Served(
                p.source,
                p.id,
                reply.completion_tokens,
                reply.spec_verify_ct,
                seconds,
                tuple(reply.output_ids),
                len(p.input_ids),
                reply.spec_accepted,
            )

        async def phase() -> Phase:
            nonlocal prompts  # `one` counts its progress against the prompts sent
            skipped: dict[str, str] = {}
            limits = await client.limits()
            if select is not None:
                prompts, skipped = select(limits, client)
            started = time.perf_counter()
            results = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
            wall_s = time.perf_counter() - started
            limits = await client.limits()
            return Phase(no_rounds_listed(r for r in results if r is not None), refused, wall_s, limits, skipped)

        return await (watch.guard(phase()) if watch is not None else phase())


def no_rounds_listed(served: Iterable[Served]) -> list[Served]:
    """`served`, where some replies list their rounds, with an empty list for each reply of no verify round: vLLM
    leaves per_step_accepted out when it has no entry (v1/metrics/stats.py `to_dict`), so a request that ended on the
    prefill's token carries none even from a server that lists them."""
    served = list(served)
    if not any(s.accepted is not None for s in served):
        return served
    return [dataclasses.replace(s, accepted=()) if s.accepted is None and s.spec_verify_ct == 0 else s for s in served]


def check_command(command: list[str] | None) -> None:
    """ValueError when a server command to be started for the engine eval already holds --speculative-* flags."""
    given = [w for w in command or [] if w.startswith("--speculative")]
    if given:
        raise ValueError(
            f"server.command already holds {', '.join(given)}: the eval adds the engine's --speculative-* flags "
            "itself (from eval.num_steps and the exported draft) to the command it starts; remove them from "
            "server.command"
        )


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
