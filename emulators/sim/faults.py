"""Fault injection for the simulated SGLang server: `SimServer`'s fault API and the middleware before its routes.

The faults: answer errors (``fail_next``), close connections without an answer (``drop_next``, or cut a random
fraction of admitted requests later: ``drop_fraction``), hold requests (``slow``, or until aborted: ``hold_if``),
report starting (``set_starting``), refuse or abort prompts (``reject_if``, ``abort_if``), an outage
(``down``/``up``/``restart``). Admin: ``POST /_fault`` (see ``FaultInjection.apply_fault``) and ``GET /_stats`` for a
server in another process; they take no key. The faults that answer instead of the routes (an outage, ``fail_next``,
``drop_next``) are an ASGI middleware in front of them (`FaultMiddleware`), the others (``drop_fraction``, ``slow``,
``reject_if``, ``abort_if``, ``hold_if``) live in the handlers (backend.py) and the engine (scheduler.py). What the
server then does follows SGLang 0.5.23: a cut client is noticed only on the disconnect poll (tokenizer_manager.py
``_stream_one_response``, sglang_protocol.disconnect.results_or_abort), a server-side abort is ``FINISH_ABORT()``.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from emulators.sglang_protocol.errors import error_response
from emulators.sim.connections import Connections, peer
from emulators.sim.scheduler import Seq
from emulators.sim.stats import SimStats

ADMIN_PATHS = ("/_fault", "/_stats")


class FaultInjection:
    """The fault API of `SimServer` (server.py mixes it in). Every public method is safe to call from any thread."""

    # What it uses of SimServer (server.py) and of the engine (Scheduler, scheduler.py).
    stats: SimStats
    _loop: asyncio.AbstractEventLoop | None
    _connections: Connections
    _call: Callable[..., Any]
    _run_coro: Callable[..., Any]
    _listen: Callable[[], Awaitable[None]]
    _stop_listening: Callable[[], Awaitable[None]]
    reset_stats: Callable[[], None]
    _abort: Callable[[str, bool], int]
    _drop_all_sequences: Callable[[str], None]
    _batch_loop: Callable[[], asyncio.AbstractEventLoop]
    # Its own state that may be None (set in _init_faults).
    _fail_path: str | None  # None: any non-admin path
    _drop_path: str | None

    def _init_faults(self, starting: bool) -> None:
        # Fault injection state (touched only on the event loop once started).
        self._starting = starting
        self._fail_left, self._fail_status, self._fail_message, self._fail_path = 0, 503, "", "/generate"
        self._drop_left, self._drop_reset, self._drop_path = 0, False, "/generate"
        self._drop_fraction, self._drop_after_s, self._drop_rng = 0.0, 0.0, random.Random(0)
        self._slow_s = 0.0
        self._reject: Callable[[list[int]], Any] | None = None
        self._abort_if: Callable[[list[int]], Any] | None = None
        self._hold_if: Callable[[list[int]], Any] | None = None
        self._down: str | None = None  # None | "refuse" | "503"

    # -- fault injection (public) ----------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503, message: str | None = None, path: str | None = "/generate") -> None:
        """Answer the next `n` requests to `path` (None: any non-admin path) with `status`."""

        def apply():
            self._fail_left, self._fail_status = int(n), int(status)
            self._fail_message = message or f"Injected failure: HTTP {status} from the simulated server."
            self._fail_path = path

        self._call(apply)

    def drop_next(self, n: int, *, reset: bool = False, path: str | None = "/generate") -> None:
        """Close the connection of the next `n` requests to `path` without answering.

        The request body is read first and nothing is generated. reset=False closes cleanly (FIN:
        httpx raises RemoteProtocolError "Server disconnected without sending a response"),
        reset=True aborts the socket (RST: httpx usually raises ReadError).
        """

        def apply():
            self._drop_left, self._drop_reset, self._drop_path = int(n), bool(reset), path

        self._call(apply)

    def drop_fraction(self, fraction: float, *, seed: int = 0, after_s: float = 0.0) -> None:
        """Cut the connection of a random `fraction` of /generate requests `after_s` seconds after admission.

        Each /generate that passes its checks is admitted normally and, with probability `fraction`
        (drawn from random.Random(seed), one draw per admitted request: deterministic for a given
        seed and request order), has its connection closed (FIN, as drop_next does) `after_s` seconds
        later. The request then goes on running and holds its rid (a re-send with it is refused as
        a duplicate) until the disconnect poll (config.disconnect_poll_s) notices and aborts it, as
        SGLang does with a client that went away. 0 turns it off.
        """
        if not 0.0 <= fraction <= 1.0 or after_s < 0:
            raise ValueError(f"need 0 <= fraction <= 1 and after_s >= 0, got {fraction}, {after_s}")

        def apply():
            self._drop_fraction, self._drop_after_s = float(fraction), float(after_s)
            self._drop_rng = random.Random(seed)

        self._call(apply)

    def slow(self, seconds: float) -> None:
        """Hold every new /generate `seconds` before it is scheduled (0 to stop); counted in flight."""
        self._call(setattr, self, "_slow_s", max(0.0, float(seconds)))

    def set_starting(self, starting: bool) -> None:
        """While starting, /health and /health_generate answer 503 (generation is still served)."""
        self._call(setattr, self, "_starting", bool(starting))

    def reject_if(self, predicate: Callable[[list[int]], Any] | None) -> None:
        """400 for prompts where predicate(prompt_ids) is truthy (a str return is the message); None clears."""
        self._call(setattr, self, "_reject", predicate)

    def abort_if(self, predicate: Callable[[list[int]], Any] | None) -> None:
        """The server aborts prompts where predicate(prompt_ids) is truthy as they start running; None clears.

        As SGLang's scheduler aborting a request on its own: it is admitted, then finishes with
        FINISH_ABORT() and no tokens (counted in `aborted`, not in `aborted_by_request`).
        """
        self._call(setattr, self, "_abort_if", predicate)

    def hold_if(self, predicate: Callable[[list[int]], Any] | None) -> None:
        """Hold prompts where predicate(prompt_ids) is truthy before they are scheduled, until they are aborted (by
        /abort_request, their client's disconnect, or shutdown); None clears (prompts already held stay held).

        A test's causal stand-in for "still queued when the client acts": no timing decides whether they finish first.
        They count in flight and end as SGLang's queued abort (sglang_protocol.results.queued_abort_result).
        """
        self._call(setattr, self, "_hold_if", predicate)

    def clear_faults(self) -> None:
        """Undo fail_next, drop_next, drop_fraction, slow, reject_if, abort_if, hold_if and starting (not down)."""

        def apply():
            self._fail_left = self._drop_left = 0
            self._drop_fraction = 0.0
            self._slow_s, self._reject, self._abort_if, self._hold_if, self._starting = 0.0, None, None, None, False

        self._call(apply)

    def down(self, *, refuse: bool = True) -> None:
        """Simulate an outage, as a crashed or restarting server.

        Every open connection is closed and every in-flight request dropped (its tokens counted
        as aborted). refuse=True also stops listening (connect errors until up()); refuse=False
        keeps listening and answers 503 to everything but the admin endpoints.
        """
        self._run_coro(lambda: self.down_async(refuse=refuse))

    def up(self, *, starting: bool | None = None) -> None:
        """End an outage (listening again on the same port); `starting` optionally sets the flag."""
        self._run_coro(lambda: self.up_async(starting=starting))

    def restart(self, *, starting: bool | None = None) -> None:
        """down() then up(): in-flight requests lose their connections, as in a real restart."""
        self.down()
        self.up(starting=starting)

    def abort_all(self) -> int:
        """Abort every in-flight sequence as /abort_request {"abort_all": true} would; returns the count."""
        return self._call(self._abort, "", True)

    async def down_async(self, *, refuse: bool = True) -> None:
        if self._down is not None:
            return
        self._down = "refuse" if refuse else "503"
        if refuse:
            await self._stop_listening()
        else:
            self._connections.abort_all()
            await asyncio.sleep(0)
            self._drop_all_sequences("Server shutting down")

    async def up_async(self, *, starting: bool | None = None) -> None:
        if starting is not None:
            self._starting = starting
        mode, self._down = self._down, None
        if mode is not None:
            self.stats.restarts += 1
        if mode == "refuse":
            await self._listen()

    async def _down_for(self, refuse: bool, seconds: float | None) -> None:
        await asyncio.sleep(0.05)  # let the admin answer leave before its connection is closed
        await self.down_async(refuse=refuse)
        if seconds is not None:
            await asyncio.sleep(seconds)
            await self.up_async()

    def apply_fault(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Apply an admin spec (the body of POST /_fault); returns the fault state.

        Keys (all optional): fail_next (int), status (int, default 503), drop_next (int),
        reset (bool), drop_fraction (0..1, with drop_seed (int, default 0) and drop_after_s (seconds,
        default 0): see drop_fraction), slow (seconds), starting (bool), reject_token (int: 400 for
        prompts holding it; null clears), down (seconds of outage, or true: until up; refuse: bool,
        default true), up (true), clear (true), reset_stats (true). Must run on the server's event loop.
        """
        if spec.get("clear"):
            self.clear_faults()
        if "fail_next" in spec:
            self.fail_next(int(spec["fail_next"]), int(spec.get("status", 503)))
        if "drop_next" in spec:
            self.drop_next(int(spec["drop_next"]), reset=bool(spec.get("reset", False)))
        if "drop_fraction" in spec:
            self.drop_fraction(
                float(spec["drop_fraction"]),
                seed=int(spec.get("drop_seed", 0)),
                after_s=float(spec.get("drop_after_s", 0.0)),
            )
        if "slow" in spec:
            self.slow(float(spec["slow"]))
        if "starting" in spec:
            self.set_starting(bool(spec["starting"]))
        if "reject_token" in spec:
            token = spec["reject_token"]
            if token is None:
                self.reject_if(None)
            else:
                rejected = int(token)
                self.reject_if(lambda ids: rejected in ids)
        if spec.get("reset_stats"):
            self.reset_stats()
        if spec.get("up") and self._down == "503":
            asyncio.get_running_loop().create_task(self.up_async())
        down = spec.get("down")
        if down is not None and down is not False:
            seconds = None if down is True else float(down)
            asyncio.get_running_loop().create_task(self._down_for(bool(spec.get("refuse", True)), seconds))
        return self._fault_state()

    def _fault_state(self) -> dict[str, Any]:
        return {
            "fail_next": self._fail_left,
            "status": self._fail_status,
            "drop_next": self._drop_left,
            "drop_fraction": self._drop_fraction,
            "drop_after_s": self._drop_after_s,
            "slow": self._slow_s,
            "starting": self._starting,
            "down": self._down,
            "reject": self._reject is not None,
        }

    def _cut_later(self, scope: MutableMapping[str, Any], after_s: float, seqs: list[Seq]) -> None:
        """drop_fraction: close this request's connection (FIN) `after_s` seconds from now, counted.

        Not if the request has been answered by then: a kept-alive connection may carry the next one.
        """
        key = peer(scope.get("client"))
        transport = None if key is None else self._connections.open.get(key)
        if transport is None:
            return

        def cut():
            if not transport.is_closing() and any(seq.state != "done" for seq in seqs):
                self.stats.dropped_connections += 1
                transport.close()

        self._batch_loop().call_later(after_s, cut)

    def _take_fault(self, path: str | None) -> str | None:
        """The injected fault that takes this request, "fail" or "drop", counted; None: serve it."""
        if self._fail_left > 0 and self._fail_path in (None, path):
            self._fail_left -= 1
            self.stats.injected_errors += 1
            fault = "fail"
        elif self._drop_left > 0 and self._drop_path in (None, path):
            self._drop_left -= 1
            self.stats.dropped_connections += 1
            fault = "drop"
        else:
            return None
        if path == "/generate":
            self.stats.requests += 1  # a /generate request all the same
        return fault


class FaultMiddleware:
    """ASGI middleware: the faults that answer in place of the routes (admin paths exempt).

    An outage in 503 mode and fail_next answer an error body; drop_next closes the connection
    without an answer. The request body is read first, as a server that got the request would.
    """

    def __init__(self, app: Callable, server: FaultInjection):
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        srv = self.server
        path = scope.get("path")
        if scope["type"] != "http" or path in ADMIN_PATHS:
            await self.app(scope, receive, send)
            return
        fault: str | None
        if srv._down is not None:  # the "503" outage mode (refuse mode has no listener)
            fault = "down"
        else:
            fault = srv._take_fault(path)
        if fault is None:
            await self.app(scope, receive, send)
            return
        await _read_body(receive)
        if fault == "down":
            await error_response(503, "The server is down (simulated outage).")(scope, receive, send)
        elif fault == "fail":
            await error_response(srv._fail_status, srv._fail_message)(scope, receive, send)
        else:
            await srv._connections.drop(scope, receive, reset=srv._drop_reset)


async def _read_body(receive: Callable) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)
