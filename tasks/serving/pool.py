"""A pool of servers of one serving engine (SGLang servers or one router; vLLM servers) that the generate stage
sends its requests through.

One pool serves every dataset of a run. Per server it keeps a concurrency limit
(`server.max_concurrency` each), its health, its input limit (SGLang's max_req_input_len, vLLM's
max_model_len) and its figures. The engine's client (tasks/serving/) makes and reads each request.

- A request goes to the least-loaded healthy server that can take its prompt (`reserve`).
- A request that fails in a retryable way is sent again, to the least-loaded healthy server
  (possibly the same one), with a fresh rid (tasks.serving.client.request_id); the log says why. The
  first re-send goes at once, later ones of the same request after the retry policy's backoff.
  Whether the server is taken out of the pool depends on what failed:
  - it cannot be reached (connect error) or answered 200 with impossible content: marked down;
  - the connection dropped, the request timed out, or it answered 408/429/5xx: one health probe
    (the engine's health path: SGLang's /health_generate, vLLM's /health) decides. A server that answers it
    stays in: one dropped connection is not a dead server, and marking healthy servers down would leave
    capacity idle.
  A monitor polls a down server's health path, with backoff, until it answers again.
- A prompt is at one server at a time and its reply is recorded only by the caller, so every
  prompt is still recorded exactly once. A timed-out request is aborted at the server that held it.
- The pool fails (`ServerOutage`) only when no server has been healthy for the outage window,
  or when one request has failed everywhere for that long.

Behind an SGLang router (`sglang-router`), the pool sees one server. The router answers
/get_server_info with its own shape: the input limit is then read from its workers (/workers,
then each worker's /server_info), or taken from `server.max_req_input_len`. It answers
/abort_request with 404, and a server started with --admin-api-key answers our key there with
401: `abort` then returns False (said once in the log), and the caller cancels the HTTP request
instead (SGLang aborts a request whose connection closes, after its disconnect poll). vLLM has no
abort for these requests at all: its client's `abort` is always False, and vLLM aborts a request
whose connection closes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import httpx

from tasks.serving import client_class
from tasks.serving.client import Completion, RetryPolicy, request_id
from tasks.serving.client import log as client_log
from tasks.serving.errors import (
    BadRequest,
    DuplicateRequestId,
    EngineError,
    InvalidReply,
    ServerOutage,
    ServerUnavailable,
)
from tasks.serving.pooled_server import Lease, Server

PROBE_TIMEOUT_S = 30.0  # SGLang's /health_generate gives up on its own 1-token probe after 20 s (HEALTH_CHECK_TIMEOUT)


class ServerPool:
    """The servers of a run. Use as an async context manager; share one pool across datasets."""

    def __init__(
        self,
        urls: list[str],
        *,
        max_concurrency: int = 64,
        retry: RetryPolicy | None = None,
        request_timeout_s: float = 1800.0,
        health_timeout_s: float | None = None,
        api_key: str | None = None,
        auth_hint: str = "Check the API key the server expects.",
        max_input_len: int | None = None,
        logger: logging.Logger | logging.LoggerAdapter = client_log,
        transport: httpx.AsyncBaseTransport | None = None,
        engine: str = "sglang",
    ):
        if not urls:
            raise ValueError("a server pool needs at least one URL")
        if len(set(urls)) != len(urls):
            raise ValueError(f"server URLs repeat: {urls}")
        self.retry = retry or RetryPolicy()
        self.health_timeout_s = health_timeout_s if health_timeout_s is not None else self.retry.outage_window_s
        self.max_input_len = max_input_len
        self.log = logger
        self.engine = engine
        client = client_class(engine)
        self.servers = [
            Server(
                url.rstrip("/"),
                client(
                    url,
                    request_timeout_s=request_timeout_s,
                    retry=self.retry,
                    api_key=api_key,
                    auth_hint=auth_hint,
                    max_connections=max_concurrency + 8,
                    logger=logger,
                    transport=transport,
                ),
                max_concurrency,
            )
            for url in urls
        ]
        self._waiters: list[asyncio.Future] = []  # woken whenever a place frees up or a server's state changes
        self.holders: dict[str, tuple[Server, str]] = {}  # request key -> (its server, the rid it was sent with)
        self.all_down_since: float | None = None
        self.started_at: float | None = None
        self._start_lock = asyncio.Lock()
        # Awaited once, by the first `start` that finds a server healthy, before any request goes out (the generate
        # stage's check of the engine that made a run's responses); what it raises refuses every later `start` too.
        self.before_first_request: Callable[[], Awaitable[object]] | None = None
        self.refused_start: Exception | None = None  # what before_first_request raised: the run's, not one dataset's
        self._closed = False

    @property
    def urls(self) -> list[str]:
        return [s.url for s in self.servers]

    @property
    def invalid_replies(self) -> dict[str, int]:
        """Impossible replies by kind, over every server (never recorded)."""
        out: dict[str, int] = {}
        for s in self.servers:
            for kind, n in s.client.invalid_replies.items():
                out[kind] = out.get(kind, 0) + n
        return out

    @property
    def capacity(self) -> int:
        """Requests in flight at once when every server is healthy."""
        return sum(s.max_concurrency for s in self.servers)

    async def __aenter__(self) -> ServerPool:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        self._closed = True
        monitors = [t for s in self.servers for t in (s.monitor, s.probe) if t is not None]
        for m in monitors:
            m.cancel()
        await asyncio.gather(*monitors, return_exceptions=True)
        for s in self.servers:
            await s.client.aclose()

    # --- start and health -------------------------------------------------------------------

    async def start(self) -> None:
        """Wait until a server is healthy (the others join as they come up); ServerOutage after health_timeout_s.

        Idempotent: every dataset calls it, the first one waits, the others find the pool started.
        """
        async with self._start_lock:
            if self.refused_start is not None:
                raise self.refused_start
            if self.started_at is not None:
                down = self.all_down_since
                if down is not None and time.monotonic() - down >= self.retry.outage_window_s:
                    self.all_down_since = time.monotonic()  # a retried task gets a whole outage window again
                return
            if len(self.servers) > 1:
                self.log.info(
                    "waiting up to %.0fs for a healthy server among %s", self.health_timeout_s, ", ".join(self.urls)
                )
            else:
                self.log.info(
                    "waiting up to %.0fs for %s%s",
                    self.health_timeout_s,
                    self.urls[0],
                    self.servers[0].client.health_path,
                )
            self.all_down_since = time.monotonic()
            for s in self.servers:
                if s.monitor is None or s.monitor.done():  # a start that failed left its watchers running
                    s.monitor = asyncio.create_task(self._monitor(s, first=True))
            deadline = time.monotonic() + self.health_timeout_s
            while not any(s.healthy for s in self.servers):
                self._check_refused()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ServerOutage(
                        f"no server healthy after {self.health_timeout_s:.0f}s ({self._states()}); "
                        f"is the {self.servers[0].client.name} server running and done loading?"
                    )
                await self._wait(left)
            if self.before_first_request is not None:
                try:
                    await self.before_first_request()
                except Exception as exc:
                    self.refused_start = exc
                    raise
            self.started_at = time.monotonic()

    async def _monitor(self, s: Server, *, first: bool = False) -> None:
        """Poll a server that is not healthy until it is, then read its limits and put it in the pool."""
        if not first:
            await asyncio.sleep(self.retry.delay(min(s.failures_in_a_row, 10)))
        try:
            await s.client.wait_healthy(10.0**9)  # the pool, not the monitor, decides when waiting has lasted too long
            await self._read_limits(s)
        except EngineError as exc:  # a refused key or a wrong URL will not heal by waiting: the run stops
            s.refused = exc
            self._notify()
            return
        except Exception as exc:  # a bug here must stop the run, not leave the server out in silence
            self.log.error("watching server %s failed: %r", s.url, exc)
            s.refused = exc
            self._notify()
            return
        s.healthy = True
        s.down_since = None
        if s.seen_healthy:
            self.log.warning("server %s is healthy again", s.url)
        s.seen_healthy = True
        self.all_down_since = None
        self._notify()

    async def _read_limits(self, s: Server) -> None:
        limits = await s.client.limits()
        s.router = limits.router
        s.max_input = limits.max_input
        if s.max_input is None and self.max_input_len is not None:
            s.max_input = self.max_input_len
        if self.max_input_len is not None and s.max_input is not None:
            s.max_input = min(s.max_input, self.max_input_len)

    def _mark_down(self, s: Server, exc: BaseException) -> None:
        """Take a server out of the pool after a failure; its monitor brings it back."""
        s.failures += 1
        s.failures_in_a_row += 1
        if not s.healthy:
            return
        s.healthy = False
        s.down_since = time.monotonic()
        self.log.warning(
            "server %s is down (%s); its requests go to the other servers, or wait (%s)", s.url, exc, self._states()
        )
        if not any(x.healthy for x in self.servers):
            self.all_down_since = time.monotonic()
        if not self._closed and (s.monitor is None or s.monitor.done()):
            s.monitor = asyncio.create_task(self._monitor(s))
        self._notify()

    def _failed(self, s: Server, exc: ServerUnavailable) -> None:
        """A request failed at `s` (module docstring): down now, or a health probe decides;
        a rid clash changes nothing."""
        if isinstance(exc, DuplicateRequestId):  # the server still held that rid: not a fault of the server
            return
        cause = exc.__cause__
        if isinstance(exc, InvalidReply) or isinstance(cause, (httpx.ConnectError, httpx.ConnectTimeout)):
            self._mark_down(s, exc)
            return
        s.failures += 1
        s.failures_in_a_row += 1
        if s.healthy and not self._closed and (s.probe is None or s.probe.done()):
            s.probe = asyncio.create_task(self._probe(s, exc))

    async def _probe(self, s: Server, exc: ServerUnavailable) -> None:
        """One health probe after a failed request: down unless it answers 200."""
        s.probes += 1
        try:
            healthy = await s.client.healthy(timeout_s=PROBE_TIMEOUT_S)
        except EngineError:  # a refused key: the monitor started by _mark_down reports it and stops the run
            healthy = False
        if not healthy:
            s.failures -= 1  # _mark_down counts this failure again
            s.failures_in_a_row -= 1
            self._mark_down(s, exc)
            return
        self.log.info(
            "server %s answered its health probe after a failed request (%s): it stays in the pool", s.url, exc
        )

    def _notify(self) -> None:
        waiters, self._waiters = self._waiters, []
        for f in waiters:
            if not f.done():
                f.set_result(None)

    async def _wait(self, timeout: float | None) -> None:
        """Until `_notify` or `timeout`. Callers check their condition first, with no await in between."""
        f = asyncio.get_running_loop().create_future()
        self._waiters.append(f)
        try:
            await asyncio.wait_for(f, timeout)
        except asyncio.TimeoutError:
            pass

    def _states(self) -> str:
        return ", ".join(f"{s.url} {s.state()}" for s in self.servers)

    # --- requests ---------------------------------------------------------------------------

    def input_limit(self) -> int | None:
        """The longest prompt + 1 that some server takes, over the servers seen so far
        (None: a limit is unknown, no check).

        A prompt rejected as too long here is checked again on every run (a server with a bigger
        context, or one that was not up yet, may take it then).
        """
        limits = [s.max_input for s in self.servers if s.seen_healthy]
        known = [limit for limit in limits if limit is not None]
        if not limits or len(known) < len(limits):  # none seen, or one unknown
            return None
        return max(known)

    async def reserve(self, prompt_len: int, lease: Lease | None = None) -> Lease:
        """A place at the least-loaded healthy server that takes the prompt (into `lease` when given, a failover);
        waits for one; ServerOutage when none comes within the outage window."""
        unserved_since: float | None = None  # since when no healthy server takes this prompt at all
        while True:
            self._check_refused()
            takers = [s for s in self.servers if s.healthy and s.fits(prompt_len)]
            free = [s for s in takers if s.in_flight < s.max_concurrency]
            if free:
                s = min(free, key=Server.load)
                if s.in_flight == 0:
                    s.busy_since = time.monotonic()
                s.in_flight += 1
                if lease is None:
                    return Lease(s)
                lease.server, lease.held = s, True
                return lease
            self._check_outage()
            timeout = self._outage_left()
            if not takers:  # the servers that take it are down (or still starting): they have the window to come back
                now = time.monotonic()
                unserved_since = unserved_since if unserved_since is not None else now
                waited = now - unserved_since
                if waited >= self.retry.outage_window_s:
                    raise ServerOutage(
                        f"no healthy server takes a prompt of {prompt_len} tokens for {waited:.0f}s "
                        f"(outage window {self.retry.outage_window_s:.0f}s): {self._states()}"
                    )
                left = self.retry.outage_window_s - waited
                timeout = left if timeout is None else min(timeout, left)
            else:
                unserved_since = None
            await self._wait(timeout)

    def _check_refused(self) -> None:
        for s in self.servers:
            if s.refused is not None:
                raise s.refused

    def _outage_left(self) -> float | None:
        if self.all_down_since is None:
            return None
        return max(0.01, self.retry.outage_window_s - (time.monotonic() - self.all_down_since))

    def _check_outage(self) -> None:
        if self.all_down_since is not None and time.monotonic() - self.all_down_since >= self.retry.outage_window_s:
            raise ServerOutage(
                f"no server healthy for {time.monotonic() - self.all_down_since:.0f}s "
                f"(outage window {self.retry.outage_window_s:.0f}s): {self._states()}"
            )

    def release(self, lease: Lease) -> None:
        """Give the lease's place back (idempotent; safe from a task's done callback)."""
        if not lease.held:
            return
        lease.held = False
        s = lease.server
        s.in_flight -= 1
        if s.in_flight == 0 and s.busy_since is not None:
            s.busy_s += time.monotonic() - s.busy_since
            s.busy_since = None
        self._notify()

    async def generate(
        self,
        lease: Lease,
        input_ids: list[int],
        sampling_params: dict[str, Any],
        key: str,
        *,
        vocab_size: int | None = None,
    ) -> Completion:
        """Send one prompt through the pool, starting at the lease's server; the lease is released at the end.

        `key` names the request for the log and for `abort` (e.g. "dataset:prompt id"); each send
        carries its own fresh rid. A retryable failure sends the prompt again at once (module
        docstring), saying why in the log; ServerOutage once this prompt has failed for the outage
        window, or no server came back. BadRequest and ServerRefused go to the caller as they are.
        """
        first_failure: float | None = None
        failures = 0
        try:
            while True:
                s = lease.server
                rid = request_id(key)
                self.holders[key] = (s, rid)
                try:
                    done = await s.client.attempt(input_ids, sampling_params, rid, vocab_size=vocab_size)
                except ServerUnavailable as exc:
                    self.holders.pop(key, None)
                    self._failed(s, exc)
                    self.release(lease)
                    now = time.monotonic()
                    first_failure = first_failure if first_failure is not None else now
                    if now - first_failure >= self.retry.outage_window_s:
                        raise ServerOutage(
                            f"request {key} failing for {now - first_failure:.0f}s "
                            f"(outage window {self.retry.outage_window_s:.0f}s): {exc}"
                        ) from exc
                    self.log.info("%s: sending again with a new rid, after a failure at %s: %s", key, s.url, exc)
                    failures += 1
                    if failures > 1:  # at once the first time; then with backoff, as a server that stays up
                        # (a router answers its own /health_generate while its workers fail) must not be hammered
                        await asyncio.sleep(
                            min(
                                self.retry.delay(failures - 2),
                                max(0.0, self.retry.outage_window_s - (now - first_failure)),
                            )
                        )
                    await self.reserve(len(input_ids), lease)
                    continue
                except BadRequest:
                    self.holders.pop(key, None)
                    s.failures_in_a_row = 0
                    raise
                self.holders.pop(key, None)
                s.failures_in_a_row = 0
                if done.finish_reason != "abort":
                    s.responses += 1
                    s.completion_tokens += done.completion_tokens
                return done
        finally:
            self.release(lease)

    async def abort(self, key: str) -> bool:
        """Abort request `key` at the server that holds it; False when that server will not abort for us (a router,
        or /abort_request refuses our key): cancel the request instead."""
        held = self.holders.pop(key, None)
        if held is None:
            return True  # not at any server (finished, or failed over and not yet re-sent)
        s, rid = held
        return await s.client.abort(rid)

    # --- figures ----------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """Per-server figures since the pool started (the summary artifact's server table)."""
        now = time.monotonic()
        wall = now - self.started_at if self.started_at is not None else 0.0
        out = []
        for s in self.servers:
            busy = s.busy_s + (now - s.busy_since if s.busy_since is not None else 0.0)
            out.append(
                {
                    "server": s.url,
                    "state": s.state() + (" (router)" if s.router else ""),
                    "responses": s.responses,
                    "completion_tokens": s.completion_tokens,
                    "tok_per_s": round(s.completion_tokens / wall, 1) if wall > 0 else 0.0,
                    "busy_pct": round(100 * busy / wall, 1) if wall > 0 else 0.0,
                    "in_flight": s.in_flight,
                    "failed_requests": s.failures,
                    "health_probes": s.probes,
                    "max_req_input_len": s.max_input,
                }
            )
        return out

    def line(self) -> str:
        """Per-server throughput in one line (for progress lines; empty for a single server)."""
        if len(self.servers) < 2:
            return ""
        parts = [
            f"{r['server']} {r['tok_per_s']:,.0f} tok/s"
            + ("" if r["state"].startswith("healthy") else f" ({r['state']})")
            for r in self.rows()
        ]
        return "servers: " + ", ".join(parts)
