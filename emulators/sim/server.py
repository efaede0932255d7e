"""The simulated SGLang server's lifecycle: `SimServer`, uvicorn in a background thread or in the foreground.

It serves sglang_protocol's app (SGLang 0.5.23's endpoints and rules, or 0.4.x with ``sglang_version="0.4"``)
over the simulated engine (scheduler.py, backend.py), with the fault API (faults.py), the admin endpoints and
the counters (stats.py). The app is FastAPI, as the dev server's.

Run it in-process (``with SimServer(max_running=4) as srv: srv.url``: uvicorn in a background
thread with its own event loop) or in the foreground: ``python -m emulators.sim --port N ...`` (__main__.py).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import logging
import math
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from emulators.sglang_protocol.app import create_sglang_app
from emulators.sglang_protocol.auth import Auth
from emulators.sglang_protocol.errors import BadRequest
from emulators.sim.backend import VERSION, SimBackend
from emulators.sim.config import SimConfig
from emulators.sim.connections import Connections
from emulators.sim.faults import ADMIN_PATHS, FaultInjection, FaultMiddleware
from emulators.sim.scheduler import Scheduler
from emulators.sim.stats import SimStats

logger = logging.getLogger("eagle3.sim_server")


class SimServer(Scheduler, FaultInjection):
    """A simulated SGLang server on 127.0.0.1; see the package docstring (emulators/sim/__init__.py).

    Every public method is safe to call from any thread (it runs on the server's event loop).
    `api_key` / `admin_api_key` are SGLang's ``--api-key`` / ``--admin-api-key`` (sglang_protocol.auth.Auth);
    `config_fields` override fields of `config` (e.g. ``disconnect_poll_s=0.3, sglang_version="0.4"``).
    Test usage::

        with SimServer(max_running=4, decode_s_per_token=0.01) as srv:
            httpx.post(srv.url + "/generate", json={"input_ids": [5, 6], ...})
            srv.fail_next(2)            # the next 2 /generate answer 503
            srv.drop_next(1)            # the next /generate gets its connection closed, no answer
            srv.drop_fraction(0.2, seed=1, after_s=0.1)  # 20% of /generate: admitted, cut 0.1 s later
            srv.slow(0.5)               # every /generate waits 0.5 s before it is scheduled
            srv.set_starting(True)      # /health and /health_generate answer 503
            srv.down(); srv.up()        # outage: refuse connections, drop in-flight; restart
            srv.reject_if(lambda ids: 7 in ids)   # 400 for matching prompts
            srv.abort_if(lambda ids: 8 in ids)    # the server aborts matching prompts as they start running
            srv.snapshot().max_in_flight
    """

    def __init__(
        self,
        config: SimConfig | None = None,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        starting: bool = False,
        log_level: str = "warning",
        api_key: str | None = None,
        admin_api_key: str | None = None,
        **config_fields: Any,
    ):
        self.config = dataclasses.replace(config or SimConfig(), **config_fields)
        self.version = self.config.version
        # SGLang's --api-key / --admin-api-key (sglang_protocol.auth.Auth); the admin paths take no key.
        self.auth = Auth(api_key=api_key, admin_api_key=admin_api_key, version=self.version)
        self.host, self.port = host, port
        self.log_level = log_level
        self.stats = SimStats()
        self._init_faults(starting)
        self._init_engine()
        # Serving state.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._connections = Connections()
        self._app = self._create_app()
        self._uv: _Uvicorn | None = None
        self._uv_task: asyncio.Task | None = None
        self._exit: asyncio.Event | None = None
        self._restarting = False

    # -- lifecycle -------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        if not self.port:
            raise RuntimeError("SimServer is not started")
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> SimServer:
        """Serve from a background thread with its own event loop; returns once listening."""
        if self._thread is not None:
            raise RuntimeError("SimServer already started")
        loop = asyncio.new_event_loop()
        self._loop = loop
        self._thread = threading.Thread(target=self._thread_main, name="sim-server", daemon=True)
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._begin(), loop).result(timeout)
        return self

    def stop(self, timeout: float = 30.0) -> None:
        """Drop everything in flight, stop listening and end the background thread."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout)
            asyncio.run_coroutine_threadsafe(_cancel_other_tasks(), loop).result(timeout)
        finally:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(timeout)
            if not thread.is_alive():
                loop.close()
            self._thread = self._loop = None

    def __enter__(self) -> SimServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        loop = self._loop
        if loop is None:
            raise RuntimeError("SimServer's thread started without its event loop (start() sets it first)")
        asyncio.set_event_loop(loop)
        loop.run_forever()

    async def serve_forever(self) -> None:
        """Serve on the current event loop until uvicorn is told to exit (SIGINT/SIGTERM)."""
        self._loop = asyncio.get_running_loop()
        await self._begin()
        print(f"sim_server listening on {self.url}", flush=True)
        exit_event = self._exit
        if exit_event is None:
            raise RuntimeError("SimServer._begin() did not set the exit event")
        await exit_event.wait()
        await self._shutdown()

    async def _begin(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._exit = asyncio.Event()
        now = self._loop.time()
        self.stats.since = self.stats.clock = self._last_touch = now
        await self._listen()

    async def _listen(self) -> None:
        """Start a uvicorn server on self.port (0 the first time: the OS picks it)."""
        # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say so, and
        # without it every response body waits ~40 ms for a delayed ACK (Nagle).
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app,
            host=self.host,
            port=self.port,
            lifespan="off",
            ws="none",
            interface="asgi3",
            http=self._connections.protocol_class,  # h11, recording its connections: see Connections
            proxy_headers=False,
            server_header=False,
            date_header=False,
            log_config=None,
            log_level=self.log_level,
            access_log=False,
            timeout_keep_alive=120,  # idle keep-alive closes race with client reuse: keep them long
            timeout_graceful_shutdown=1,
        )
        uv = _Uvicorn(config)
        self._uv = uv
        self._uv_task = asyncio.create_task(self._serve_life(uv, sock))
        listening = asyncio.ensure_future(uv.listening.wait())
        done, _ = await asyncio.wait((listening, self._uv_task), timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if listening not in done:
            listening.cancel()
            if self._uv_task.done():
                self._uv_task.result()  # raises what went wrong
                raise RuntimeError("sim server exited during startup")
            raise RuntimeError("sim server did not start within 30 s")

    async def _serve_life(self, uv: _Uvicorn, sock: socket.socket) -> None:
        try:
            await uv.serve(sockets=[sock])
        finally:
            sock.close()
            if not self._restarting and self._exit is not None:
                self._exit.set()  # a signal ended uvicorn: the foreground CLI exits

    async def _stop_listening(self) -> None:
        """Stop uvicorn: refuse new connections, close every open one, drop what was in flight."""
        uv, task = self._uv, self._uv_task
        if uv is None or task is None:
            return
        self._restarting = True
        # uvicorn closes its listener only at its next tick (<= 0.1 s): until then a connection
        # is cut as soon as it is made, so nothing new is served once down() has begun.
        self._connections.refusing = True
        try:
            self._connections.abort_all()
            await asyncio.sleep(0)  # let connection_lost run: the handlers see a disconnect
            self._drop_all_sequences("Server shutting down")
            uv.should_exit = uv.force_exit = True
            await asyncio.wait_for(task, timeout=10)
        finally:
            self._uv = self._uv_task = None
            self._restarting = False
            self._connections.refusing = False

    async def _shutdown(self) -> None:
        await self._stop_listening()
        self._drop_all_sequences("Server shutting down")

    # -- thread-safe access ----------------------------------------------------------------------

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run fn on the event loop (directly when not started or already on it) and return its result."""
        loop = self._loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            return fn(*args)
        result: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            try:
                result.set_result(fn(*args))
            except BaseException as exc:  # handed back to the calling thread
                result.set_exception(exc)

        loop.call_soon_threadsafe(run)
        return result.result(timeout=30)

    def _run_coro(self, make: Callable[[], Any], timeout: float = 30.0) -> Any:
        loop = self._loop
        if loop is None or not loop.is_running():
            raise RuntimeError("SimServer is not started")
        if _running_loop() is loop:
            raise RuntimeError("use the async variant from the server's own event loop")
        return asyncio.run_coroutine_threadsafe(make(), loop).result(timeout)

    # -- counters (public) -----------------------------------------------------------------------

    def snapshot(self) -> SimStats:
        """A copy of the counters, with the time integrals brought up to now."""

        def take():
            if self._loop is not None:
                self._touch()
                self.stats.clock = self._loop.time()
            return dataclasses.replace(self.stats)

        return self._call(take)

    def reset_stats(self) -> None:
        """Zero the counters (the current running/queued gauges stay), e.g. after a warm-up."""

        def apply():
            now = 0.0
            if self._loop is not None:
                self._touch()
                now = self._loop.time()
            self.stats = SimStats(
                running=len(self._running),
                queued=len(self._live) - len(self._running),
                in_flight=len(self._live),
                max_running_seen=len(self._running),
                max_in_flight=len(self._live),
                open_requests=self.stats.open_requests,
                max_open_requests=self.stats.open_requests,
                since=now,
                clock=now,
            )

        self._call(apply)

    def utilisation(self) -> float:
        """Served tokens / (capacity * wall time since start or reset_stats)."""
        s = self.snapshot()
        capacity = self.config.capacity_tokens_per_s
        return 0.0 if s.wall_s <= 0 or math.isinf(capacity) else s.served_tokens / (capacity * s.wall_s)

    def wait_for(
        self, condition: Callable[[SimStats], bool], timeout: float = 10.0, interval: float = 0.005
    ) -> SimStats:
        """Poll snapshot() until condition(stats) holds (bounded); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.snapshot()
            if condition(s):
                return s
            if time.monotonic() >= deadline:
                raise TimeoutError(f"sim server condition not met within {timeout}s; stats: {s}")
            time.sleep(interval)

    # -- HTTP (event loop only) -----------------------------------------------------------------

    def _create_app(self) -> FastAPI:
        """SGLang's endpoints over the simulated engine, the admin endpoints, the fault middleware."""

        def refused():
            self.stats.auth_refused += 1

        app = create_sglang_app(
            SimBackend(self),
            title="eagle3 simulated SGLang server",
            version=VERSION,
            sglang_version=self.version,
            auth=self.auth,
            open_paths=ADMIN_PATHS,
            on_auth_refused=refused,
        )

        @app.get("/_stats")
        async def stats():
            return JSONResponse(self.snapshot().to_dict())

        @app.post("/_fault")
        async def fault(request: Request):
            try:
                spec = json.loads(await request.body() or b"{}")
                if not isinstance(spec, dict):
                    raise ValueError("the body must be a JSON object")
                state = self.apply_fault(spec)
            except (ValueError, TypeError) as exc:
                raise BadRequest(f"bad fault spec: {exc}") from exc
            return JSONResponse(state)

        app.add_middleware(FaultMiddleware, server=self)
        return app


class _Uvicorn(uvicorn.Server):
    """uvicorn's Server, with an event for "listening" (it has none to await, only a flag to poll)."""

    def __init__(self, config: uvicorn.Config):
        super().__init__(config)
        self.listening = asyncio.Event()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        self.listening.set()


async def _cancel_other_tasks() -> None:
    """Cancel what is left on this loop (handlers of dropped connections) before it stops."""
    tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None
