"""The eval's server: started for each phase (with the draft, then without it) or already running, and the eval
prompts decoded through it greedily (`decode_prompts`); the figures are tasks/eval/engine_report.py's.

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
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.eval.context import rounds_from_steps
from models.eval.prompts import EvalPrompt
from settings.server import ServerSettings
from tasks.runtime.heartbeat import Heartbeat
from tasks.serving import client_class
from tasks.serving.client import RetryPolicy, ServerLimits
from tasks.serving.errors import BadRequest
from tasks.serving.launch import SERVER_LOG, ServerProcess, launched_servers
from tasks.serving.watch import ServerWatch


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
    death ends the phase at once with EngineDied (tasks/serving/watch.py) instead of the outage window's retries.
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
