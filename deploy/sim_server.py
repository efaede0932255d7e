"""Simulated SGLang server: SGLang's native HTTP protocol with deterministic fake outputs, no model.

For the generate-stage tests (fault injection, kill/resume determinism) and for the generate
benchmark (a server of known capacity). It speaks the same subset of SGLang's native API as
``deploy/dev_server.py``, with the same request, response and error shapes (see that module's
docstring), and adds fault injection.

Outputs are a pure function of the prompt and the sampling parameters (``simulate_output``):
the same prompt always gets the same answer, so "outputs equal a clean run" is checkable after
crashes, retries and restarts. The output length is drawn from a long-tailed distribution
(lognormal by default), the ids are random in ``[10, vocab_size)``, a natural end appends the stop
token (``stop_token_ids[0]``, else ``eos_token_id``) with finish ``stop``; otherwise the output is
cut at ``max_new_tokens`` with finish ``length``. A natural end AT ``max_new_tokens`` is ``stop``,
as SGLang 0.5.23 checks the stop token before the length cap (schedule_batch.py
``Req.update_finish_state``; with ``sglang_version="0.4"``: ``length``, 0.4.x ``check_finished``).
A smaller ``max_new_tokens`` gives a prefix of the same output, as greedy decoding would.

Capacity model (continuous batching): at most ``max_running`` sequences run at once, the others
wait FIFO; a running sequence of L output tokens finishes ``prefill_s_per_token * len(prompt) +
L * decode_s_per_token`` seconds after it started, however many run together (a GPU below
saturation). Capacity is ``max_running / decode_s_per_token`` tokens/s. ``SimServer.stats``
counts served and aborted tokens, the busy-slot integral and the observed maxima.

Endpoints: SGLang's, from ``deploy/sglang_protocol.py`` (``text`` is refused: no tokenizer;
sampling params SGLang knows but the simulation does not model are accepted and ignored), with
its rules (SGLang 0.5.23, or 0.4.x with ``sglang_version="0.4"``): a held rid refused as a
duplicate, a disconnected client noticed only on the ``disconnect_poll_s`` poll (SGLang's 4 s;
meanwhile the request runs and holds its rid), /abort_request by rid prefix, the queued- and
running-abort answers, ``api_key`` / ``admin_api_key``, the contract gate's 400s, and
``reserved_tokens`` (what an EAGLE server reserves per request in its length checks). Admin:
``POST /_fault`` (see ``SimServer.apply_fault``) and ``GET /_stats`` for a server in another
process; they take no key. The app is FastAPI, as the dev server's; the faults that answer
instead of the routes (an outage, ``fail_next``, ``drop_next``) are an ASGI middleware in front of
them, the others (``drop_fraction``, ``slow``, ``reject_if``, ``abort_if``) live in the handlers and the engine.

Run it in-process (``with SimServer(max_running=4) as srv: srv.url``: uvicorn in a background
thread with its own event loop) or in the foreground:
``python -m deploy.sim_server --port N [--max-running ..] [--decode-ms ..] [--mean-len ..] [--seed ..]
[--api-key ..] [--admin-api-key ..] [--sglang-version 0.5|0.4] [--disconnect-poll-s ..] [--reserved-tokens ..]``.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import hashlib
import json
import logging
import math
import random
import socket
import struct
import sys
import threading
import time
from array import array
from collections import deque
from typing import Any, Callable

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from uvicorn.protocols.http.h11_impl import H11Protocol

from deploy import sglang_protocol as sglang
from deploy.sglang_protocol import parse_sampling_params

logger = logging.getLogger("eagle3.sim_server")

VERSION = "0.1.0-eagle3-sim"
_FIRST_ID = 10  # output ids are drawn from [10, vocab_size): clear of the usual special ids

__all__ = ["SimConfig", "SimOutput", "SimServer", "SimStats", "main", "parse_sampling_params", "simulate_output"]


# ---------------------------------------------------------------------------------------------
# The pure part: configuration and the simulated output
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """What the simulated model and server look like."""

    vocab_size: int = 32000
    eos_token_id: int = 1  # the stop token when a request gives no stop_token_ids
    length_dist: str = "lognormal"  # "lognormal" (long tail) | "exponential" | "fixed"
    mean_len: float = 200.0  # mean natural output length, before the max_new_tokens cut
    sigma: float = 1.0  # lognormal shape: larger = longer tail
    context_length: int = 32768
    max_running: int = 16  # sequences decoding at once; the rest wait FIFO
    decode_s_per_token: float = 0.01  # wall time per output token of one running sequence
    prefill_s_per_token: float = 0.0  # wall time per prompt token, once, at the start
    seed: int = 0  # mixed into every output: another seed, another "model"
    model_path: str = "sim-model"
    # SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT: a gone client is noticed on a poll this often (<= 0: at once)
    disconnect_poll_s: float = sglang.DISCONNECT_POLL_S
    sglang_version: str = "0.5"  # "0.5" (SGLang 0.5.23) | "0.4" (0.4.x where they differ)
    reserved_tokens: int = 0  # per-request tokens an EAGLE server reserves in its length checks (0: no draft)

    def __post_init__(self):
        if self.length_dist not in ("lognormal", "exponential", "fixed"):
            raise ValueError(f"length_dist must be lognormal, exponential or fixed, got {self.length_dist!r}")
        if self.vocab_size <= _FIRST_ID + 1:
            raise ValueError(f"vocab_size must exceed {_FIRST_ID + 1}, got {self.vocab_size}")
        if self.mean_len < 1 or self.sigma < 0:
            raise ValueError(f"need mean_len >= 1 and sigma >= 0, got {self.mean_len}, {self.sigma}")
        if self.context_length < 8:
            raise ValueError(f"context_length must be at least 8, got {self.context_length}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {self.max_running}")
        if self.decode_s_per_token < 0 or self.prefill_s_per_token < 0:
            raise ValueError("decode_s_per_token and prefill_s_per_token must be >= 0")
        sglang.SGLangVersion.of(self.sglang_version)  # validates
        if self.reserved_tokens < 0:
            raise ValueError(f"reserved_tokens must be >= 0, got {self.reserved_tokens}")

    @property
    def version(self) -> sglang.SGLangVersion:
        return sglang.SGLangVersion.of(self.sglang_version)

    @property
    def limits(self) -> sglang.ModelLimits:
        """The vocabulary and context, and SGLang's limits from them (reserved tokens included)."""
        return sglang.ModelLimits(vocab_size=self.vocab_size, context_length=self.context_length,
                                  reserved_tokens=self.reserved_tokens, sglang_version=self.version)

    @property
    def max_req_len(self) -> int:
        return self.limits.max_req_len

    @property
    def max_req_input_len(self) -> int:
        return self.limits.max_req_input_len

    @property
    def capacity_tokens_per_s(self) -> float:
        """Output tokens/s with every slot busy (inf when decoding takes no time)."""
        return math.inf if self.decode_s_per_token == 0 else self.max_running / self.decode_s_per_token


@dataclasses.dataclass(frozen=True)
class SimOutput:
    """What the simulated model answers to one prompt."""

    output_ids: list[int]  # the matched stop token included, as SGLang returns them
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id} | {"type": "length", "length": n}
    natural_length: int  # the drawn length before the max_new_tokens cut (ignores ignore_eos)
    no_stop_trim: bool = False

    @property
    def text(self) -> str:
        return _text(self.output_ids, self.finish_reason, self.no_stop_trim)


def _text(ids: list[int], finish: dict, no_stop_trim: bool) -> str:
    """Deterministic detokenisation: ``t<id>`` per token; the matched stop token is trimmed."""
    return " ".join([f"t{t}" for t in sglang.text_token_ids(ids, finish, no_stop_trim)])


def _id_array(prompt_ids: Any) -> array:
    """The prompt as a C array of int64 (type-checks every element at C speed)."""
    if isinstance(prompt_ids, array) and prompt_ids.typecode == "q":
        return prompt_ids
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise sglang.MalformedRequest("input_ids must be a list of ints or a list of lists of ints")
    try:
        return array("q", prompt_ids)
    except (TypeError, OverflowError):
        raise sglang.MalformedRequest("input_ids must be a list of ints or a list of lists of ints") from None


def _natural_length(rng: random.Random, cfg: SimConfig) -> int:
    if cfg.length_dist == "fixed":
        x = cfg.mean_len
    elif cfg.length_dist == "exponential":
        x = rng.expovariate(1.0 / cfg.mean_len)
    else:  # lognormal with the requested mean: E[X] = exp(mu + sigma^2 / 2)
        mu = math.log(cfg.mean_len) - cfg.sigma**2 / 2
        x = rng.lognormvariate(mu, cfg.sigma)
    return max(1, int(round(min(x, 1e9))))


def simulate_output(prompt_ids: Any, params: Any = None, config: SimConfig | None = None) -> SimOutput:
    """The simulated model's answer: a pure function of (prompt ids, sampling params, config).

    `params` is a request's raw ``sampling_params`` dict (or None, or a `SamplingParams`). The
    random stream is seeded from a sha256 of config.seed, the prompt ids and the parameters that
    change a real model's sampling (temperature, top_p, top_k, sampling_seed; none of them when
    greedy). max_new_tokens, ignore_eos and the stop ids only decide where the stream is cut.
    """
    cfg = config or SimConfig()
    p = parse_sampling_params(params)
    ids = _id_array(prompt_ids)
    n = len(ids)

    limit = cfg.limits.max_new_tokens(n, p)

    h = hashlib.sha256(b"eagle3-sim-v1")
    h.update(struct.pack("<q", cfg.seed))
    if p.greedy:
        h.update(b"greedy")
    else:
        h.update(struct.pack("<ddqq", p.temperature, p.top_p, p.top_k,
                             -1 if p.sampling_seed is None else p.sampling_seed))
    h.update(ids.tobytes())
    rng = random.Random(int.from_bytes(h.digest(), "big"))

    natural = _natural_length(rng, cfg)  # drawn first: the ids below never depend on the cut
    if p.ignore_eos:
        length, stop = limit, False  # ignore_eos also disables stop_token_ids, as in SGLang
    elif natural <= limit:
        length, stop = natural, True
    else:
        length, stop = limit, False
    n_content = length - 1 if stop else length

    # 4 random bytes per token; randbytes(k) is a prefix of randbytes(k + m) for one seed.
    span = cfg.vocab_size - _FIRST_ID
    raw = array("I")
    raw.frombytes(rng.randbytes(4 * n_content))
    out = [_FIRST_ID + v % span for v in raw]
    stop_id = p.stop_token_ids[0] if p.stop_token_ids else cfg.eos_token_id
    stops = {cfg.eos_token_id, *p.stop_token_ids}
    if any(_FIRST_ID <= s < cfg.vocab_size for s in stops):  # keep stop ids out of the content
        out = [_avoid(t, stops, span) for t in out]
    if stop:
        out.append(stop_id)
    # The finish of those ids as SGLang labels it (sglang_protocol.finish_reason): a natural end AT the cap is
    # "stop" in 0.5.23 (`update_finish_state` checks the stop token first), "length" in 0.4.x (`check_finished`).
    finish = sglang.finish_reason(out, limit, () if p.ignore_eos else (stop_id,), cfg.version)
    assert finish is not None  # the ids end at the stop token or at the cap
    return SimOutput(out, finish, natural, p.no_stop_trim)


def _avoid(t: int, stops: set[int], span: int) -> int:
    while t in stops:
        t = _FIRST_ID + (t - _FIRST_ID + 1) % span
    return t


# ---------------------------------------------------------------------------------------------
# Counters
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class SimStats:
    """Server counters. Live on `SimServer.stats`; `SimServer.snapshot()` returns a current copy.

    Utilisation of a run = served_tokens / (config.capacity_tokens_per_s * wall_s).
    """

    requests: int = 0  # /generate HTTP requests received (including failed and dropped ones)
    sequences: int = 0  # prompts accepted for generation (a batch counts each item)
    completed: int = 0  # sequences finished with stop or length
    aborted: int = 0  # sequences finished by abort: /abort_request, client gone, down/restart
    served_tokens: int = 0  # completion tokens of completed sequences
    aborted_tokens: int = 0  # tokens generated for aborted sequences: wasted capacity
    busy_slot_s: float = 0.0  # integral over time of the number of running sequences
    busy_wall_s: float = 0.0  # wall time with at least one sequence running
    queue_wait_s: float = 0.0  # summed time sequences waited for a slot (after any slow() hold)
    queued_sequences: int = 0  # sequences that found no free slot and had to wait
    running: int = 0
    queued: int = 0  # waiting for a slot (including those held by slow())
    in_flight: int = 0  # running + queued
    max_running_seen: int = 0
    max_in_flight: int = 0
    open_requests: int = 0  # /generate HTTP requests being handled now
    max_open_requests: int = 0
    injected_errors: int = 0  # answered by fail_next
    dropped_connections: int = 0  # closed by drop_next, and admitted requests cut by drop_fraction
    rejected: int = 0  # 400 answers to /generate (bad input, reject_if, contract gate, duplicate rids)
    duplicate_rids: int = 0  # of those, refused for a rid the server still holds (or repeated in the batch)
    abort_requests: int = 0  # /abort_request calls answered (ignored ones included; not the 401s)
    aborted_by_request: int = 0  # sequences aborted by /abort_request or abort_all() (prefix matches included)
    aborted_by_disconnect: int = 0  # sequences aborted when the disconnect poll found their client gone
    queued_aborts: int = 0  # of the aborted, those still queued: SGLang's queued-abort answer (not down()'s drops)
    auth_refused: int = 0  # 401/403 answers (a missing or wrong API key)
    restarts: int = 0  # down()/up() cycles
    since: float = 0.0  # event-loop clock when counting started (start or reset_stats)
    clock: float = 0.0  # event-loop clock of this snapshot

    @property
    def wall_s(self) -> float:
        return max(0.0, self.clock - self.since)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "wall_s": self.wall_s}


# ---------------------------------------------------------------------------------------------
# The server
# ---------------------------------------------------------------------------------------------


class _Seq:
    """One prompt inside the simulated engine."""

    __slots__ = ("rid", "prompt_len", "out", "arrived", "queued_at", "started", "handle", "future", "state", "doomed")

    def __init__(self, rid: str, prompt_len: int, out: SimOutput, arrived: float, future: asyncio.Future,
                 doomed: bool = False):
        self.rid, self.prompt_len, self.out = rid, prompt_len, out
        self.arrived, self.future = arrived, future
        self.doomed = doomed  # abort_if: the server aborts it when it starts running
        self.queued_at = self.started = 0.0
        self.handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self.state = "new"  # new -> delay (slow) -> queued -> running -> done


_ADMIN_PATHS = ("/_fault", "/_stats")


class SimServer:
    """A simulated SGLang server on 127.0.0.1; see the module docstring.

    Every public method is safe to call from any thread (it runs on the server's event loop).
    `api_key` / `admin_api_key` are SGLang's ``--api-key`` / ``--admin-api-key`` (sglang_protocol.Auth);
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
        # SGLang's --api-key / --admin-api-key (sglang_protocol.Auth); the admin paths take no key.
        self.auth = sglang.Auth(api_key=api_key, admin_api_key=admin_api_key, version=self.version)
        self.host, self.port = host, port
        self.log_level = log_level
        self.stats = SimStats()
        # Fault injection state (touched only on the event loop once started).
        self._starting = starting
        self._fail_left, self._fail_status, self._fail_message, self._fail_path = 0, 503, "", "/generate"
        self._drop_left, self._drop_reset, self._drop_path = 0, False, "/generate"
        self._drop_fraction, self._drop_after_s, self._drop_rng = 0.0, 0.0, random.Random(0)
        self._slow_s = 0.0
        self._reject: Callable[[list[int]], Any] | None = None
        self._abort_if: Callable[[list[int]], Any] | None = None
        self._down: str | None = None  # None | "refuse" | "503"
        # Engine state (event loop only).
        self._running: set[_Seq] = set()
        self._waiting: deque[_Seq] = deque()
        self._live: set[_Seq] = set()  # every unfinished sequence (delay, queued, running)
        self._held = sglang.HeldRids(self.version)  # SGLang's rid_to_state: claimed at admission, freed at the end
        self._last_touch = 0.0
        # Serving state.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._connections = _Connections()
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

    def start(self, timeout: float = 30.0) -> "SimServer":
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

    def __enter__(self) -> "SimServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def _thread_main(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    async def serve_forever(self) -> None:
        """Serve on the current event loop until uvicorn is told to exit (SIGINT/SIGTERM)."""
        self._loop = asyncio.get_running_loop()
        await self._begin()
        print(f"sim_server listening on {self.url}", flush=True)
        await self._exit.wait()
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
            self._app, host=self.host, port=self.port, lifespan="off", ws="none", interface="asgi3",
            http=self._connections.protocol_class,  # h11, recording its connections: see _Connections
            proxy_headers=False, server_header=False, date_header=False,
            log_config=None, log_level=self.log_level, access_log=False,
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

    # -- fault injection (public) ----------------------------------------------------------------

    def fail_next(self, n: int, status: int = 503, message: str | None = None,
                  path: str | None = "/generate") -> None:
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

    def clear_faults(self) -> None:
        """Undo fail_next, drop_next, drop_fraction, slow, reject_if, abort_if and starting (not down: use up)."""

        def apply():
            self._fail_left = self._drop_left = 0
            self._drop_fraction = 0.0
            self._slow_s, self._reject, self._abort_if, self._starting = 0.0, None, None, False

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
            self.drop_fraction(float(spec["drop_fraction"]), seed=int(spec.get("drop_seed", 0)),
                               after_s=float(spec.get("drop_after_s", 0.0)))
        if "slow" in spec:
            self.slow(float(spec["slow"]))
        if "starting" in spec:
            self.set_starting(bool(spec["starting"]))
        if "reject_token" in spec:
            token = spec["reject_token"]
            self.reject_if(None if token is None else (lambda ids, t=int(token): t in ids))
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
        return {"fail_next": self._fail_left, "status": self._fail_status, "drop_next": self._drop_left,
                "drop_fraction": self._drop_fraction, "drop_after_s": self._drop_after_s,
                "slow": self._slow_s, "starting": self._starting, "down": self._down,
                "reject": self._reject is not None}

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
                running=len(self._running), queued=len(self._live) - len(self._running),
                in_flight=len(self._live), max_running_seen=len(self._running), max_in_flight=len(self._live),
                open_requests=self.stats.open_requests, max_open_requests=self.stats.open_requests,
                since=now, clock=now,
            )

        self._call(apply)

    def utilisation(self) -> float:
        """Served tokens / (capacity * wall time since start or reset_stats)."""
        s = self.snapshot()
        capacity = self.config.capacity_tokens_per_s
        return 0.0 if s.wall_s <= 0 or math.isinf(capacity) else s.served_tokens / (capacity * s.wall_s)

    def wait_for(self, condition: Callable[[SimStats], bool], timeout: float = 10.0,
                 interval: float = 0.005) -> SimStats:
        """Poll snapshot() until condition(stats) holds (bounded); TimeoutError otherwise."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.snapshot()
            if condition(s):
                return s
            if time.monotonic() >= deadline:
                raise TimeoutError(f"sim server condition not met within {timeout}s; stats: {s}")
            time.sleep(interval)

    # -- the simulated engine (event loop only) --------------------------------------------------

    def _touch(self) -> None:
        """Advance the busy integrals to now (call before the running set changes)."""
        now = self._loop.time()
        dt = now - self._last_touch
        if dt > 0 and self._running:
            self.stats.busy_slot_s += len(self._running) * dt
            self.stats.busy_wall_s += dt
        self._last_touch = now

    def _gauges(self) -> None:
        s = self.stats
        s.running, s.in_flight = len(self._running), len(self._live)
        s.queued = s.in_flight - s.running
        if s.running > s.max_running_seen:
            s.max_running_seen = s.running
        if s.in_flight > s.max_in_flight:
            s.max_in_flight = s.in_flight

    def _admit(self, seqs: list[_Seq]) -> None:
        """New sequences enter the server: held by slow(), else queued for a slot."""
        for seq in seqs:
            self._live.add(seq)
            self.stats.sequences += 1
        delay = self._slow_s
        for seq in seqs:
            if delay > 0:
                seq.state = "delay"
                seq.handle = self._loop.call_later(delay, self._enqueue, seq)
            else:
                self._enqueue(seq)
        self._gauges()

    def _enqueue(self, seq: _Seq) -> None:
        if seq.state == "done":
            return
        seq.handle = None
        if seq.out.finish_reason.get("length") == 0:  # max_new_tokens 0: nothing to run
            self._finish(seq, seq.out.output_ids, seq.out.finish_reason)
            return
        seq.state, seq.queued_at = "queued", self._loop.time()
        if self._waiting or len(self._running) >= self.config.max_running:
            self.stats.queued_sequences += 1  # no free slot: it will wait
        self._waiting.append(seq)
        self._schedule()

    def _schedule(self) -> None:
        """Give free slots to waiting sequences, FIFO."""
        if not self._waiting or len(self._running) >= self.config.max_running:
            return
        self._touch()
        loop, cfg = self._loop, self.config
        now = loop.time()
        while self._waiting and len(self._running) < cfg.max_running:
            seq = self._waiting.popleft()
            seq.state, seq.started = "running", now
            self.stats.queue_wait_s += now - seq.queued_at
            self._running.add(seq)
            if seq.doomed:  # abort_if: aborted by the server itself, before any token
                seq.handle = loop.call_soon(self._abort_seq, seq, "server")
                continue
            duration = cfg.prefill_s_per_token * seq.prompt_len + len(seq.out.output_ids) * cfg.decode_s_per_token
            seq.handle = loop.call_at(now + duration, self._complete, seq)
        self._gauges()

    def _complete(self, seq: _Seq) -> None:
        if seq.state != "running":
            return
        self.stats.completed += 1
        self.stats.served_tokens += len(seq.out.output_ids)
        self._finish(seq, seq.out.output_ids, seq.out.finish_reason)

    def _finish(self, seq: _Seq, ids: list[int], reason: dict, *, result: dict | None = None) -> None:
        """Leave the engine, free the rid and resolve the request's future with SGLang's response shape
        (`result`: an answer built elsewhere, the queued abort's)."""
        if seq.state == "running":
            self._touch()
            self._running.discard(seq)
        elif seq.state == "queued":
            try:
                self._waiting.remove(seq)
            except ValueError:
                pass
        if seq.handle is not None:
            seq.handle.cancel()
            seq.handle = None
        seq.state = "done"
        self._live.discard(seq)
        self._held.release(seq.rid)  # tokenizer_manager.py deletes rid_to_state[rid] with the final output
        if not seq.future.done():
            seq.future.set_result(result or sglang.generate_result(
                rid=seq.rid, text=_text(ids, reason, seq.out.no_stop_trim), output_ids=ids, finish_reason=reason,
                prompt_tokens=seq.prompt_len, e2e_latency=self._loop.time() - seq.arrived, version=self.version,
            ))
        self._schedule()
        self._gauges()

    def _abort_seq(self, seq: _Seq, cause: str) -> bool:
        """Abort `seq` for `cause` ("request", "disconnect", "server" or "shutdown"); False if it had already finished.

        Still queued (or held by slow()): SGLang's queued-abort answer (sglang_protocol.queued_abort_result).
        Running: FINISH_ABORT() through the normal output path with the tokens generated so far.
        """
        if seq.state == "done":
            return False
        cfg, ids = self.config, seq.out.output_ids
        reason = sglang.finish_abort("Server shutting down" if cause == "shutdown" else None)
        if seq.state == "running":
            elapsed = self._loop.time() - seq.started - cfg.prefill_s_per_token * seq.prompt_len
            done = len(ids) if cfg.decode_s_per_token == 0 else int(max(0.0, elapsed) / cfg.decode_s_per_token)
            if cause == "server":  # abort_if aborts it as it starts
                done = 0
            if done >= len(ids):  # it had finished; the timer just has not fired yet
                self._complete(seq)
                return False
            result = None
        else:
            done = 0
            result = None
            if cause != "shutdown":
                result = sglang.queued_abort_result(rid=seq.rid, e2e_latency=self._loop.time() - seq.arrived,
                                                    version=self.version)
                self.stats.queued_aborts += 1
        self.stats.aborted += 1
        self.stats.aborted_tokens += done
        if cause == "request":
            self.stats.aborted_by_request += 1
        elif cause == "disconnect":
            self.stats.aborted_by_disconnect += 1
        self._finish(seq, ids[:done], reason, result=result)
        return True

    def _abort(self, rid: str, abort_all: bool = False, cause: str = "request") -> int:
        """/abort_request: every sequence whose rid starts with `rid`, if `rid` is held (sglang_protocol.abort_matcher)."""
        match = sglang.abort_matcher(rid, abort_all, self._held)
        if match is None:
            return 0
        # scheduler.py abort_request: the waiting queue first (those never start), then the running ones.
        victims = sorted((s for s in self._live if match(s.rid)), key=lambda s: s.state == "running")
        return sum(self._abort_seq(seq, cause) for seq in victims)

    def _drop_all_sequences(self, message: str) -> None:
        for seq in list(self._live):
            self._abort_seq(seq, "shutdown")

    def _cut_later(self, scope: dict, after_s: float, seqs: list[_Seq]) -> None:
        """drop_fraction: close this request's connection (FIN) `after_s` seconds from now, counted.

        Not if the request has been answered by then: a kept-alive connection may carry the next one.
        """
        transport = self._connections.open.get(_peer(scope.get("client")))
        if transport is None:
            return

        def cut():
            if not transport.is_closing() and any(seq.state != "done" for seq in seqs):
                self.stats.dropped_connections += 1
                transport.close()

        self._loop.call_later(after_s, cut)

    def _take_fault(self, path: str) -> str | None:
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

    # -- HTTP (event loop only) -----------------------------------------------------------------

    def _create_app(self) -> FastAPI:
        """SGLang's endpoints over the simulated engine, the admin endpoints, the fault middleware."""
        def refused():
            self.stats.auth_refused += 1

        app = sglang.create_sglang_app(_SimBackend(self), title="eagle3 simulated SGLang server", version=VERSION,
                                       sglang_version=self.version, auth=self.auth, open_paths=_ADMIN_PATHS,
                                       on_auth_refused=refused)

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
                raise sglang.BadRequest(f"bad fault spec: {exc}") from exc
            return JSONResponse(state)

        app.add_middleware(_FaultMiddleware, server=self)
        return app


class _SimBackend:
    """The simulated engine behind the SGLang endpoints (see sglang_protocol.SGLangBackend)."""

    def __init__(self, server: SimServer):
        self.server = server

    async def generate(self, request: Request) -> Any:
        srv = self.server
        stats = srv.stats
        stats.requests += 1
        stats.open_requests += 1
        if stats.open_requests > stats.max_open_requests:
            stats.max_open_requests = stats.open_requests
        try:
            arrived = srv._loop.time()
            try:
                req = sglang.parse_generate(await request.body(), server="sim server", accepts_text=False,
                                            version=srv.version)
                # tokenizer_manager.py generate_request: normalise, `_init_req_state` (duplicate rids),
                # then check each prompt; a failure frees the batch's rids again.
                try:
                    srv._held.claim(req.rids)
                except sglang.BadRequest:
                    srv.stats.duplicate_rids += 1
                    raise
                try:
                    seqs = [self._sequence(ids, raw, rid, arrived)
                            for ids, raw, rid in zip(req.prompts, req.sampling_params, req.rids)]
                except BaseException:
                    for rid in req.rids:
                        srv._held.release(rid)
                    raise
            except (sglang.BadRequest, sglang.ContractError, sglang.MalformedRequest):
                srv.stats.rejected += 1
                raise
            srv._admit(seqs)
            if srv._drop_fraction > 0 and srv._drop_rng.random() < srv._drop_fraction:
                srv._cut_later(request.scope, srv._drop_after_s, seqs)
            results = await sglang.results_or_abort(
                request, asyncio.gather(*(s.future for s in seqs)),
                # The poll noticed the client is gone: abort_request(rid) for each (prefix rule included).
                lambda: [srv._abort(s.rid, cause="disconnect") for s in seqs],
                poll_s=srv.config.disconnect_poll_s,
            )
            return results[0] if req.single else results
        finally:
            stats = srv.stats  # reset_stats may have replaced it meanwhile
            stats.open_requests = max(0, stats.open_requests - 1)

    def _sequence(self, ids: list[int], raw_params: Any, rid: str, arrived: float) -> _Seq:
        """Check one prompt as SGLang would, then as reject_if says; its simulated answer."""
        srv = self.server
        params = srv.config.limits.admit(ids, raw_params)
        if srv._reject is not None:
            verdict = srv._reject(ids)
            if verdict:
                raise sglang.BadRequest(verdict if isinstance(verdict, str)
                                        else "The prompt was rejected by the sim server's reject_if rule.")
        out = simulate_output(ids, params, srv.config)
        doomed = srv._abort_if is not None and bool(srv._abort_if(ids))
        return _Seq(rid, len(ids), out, arrived, srv._loop.create_future(), doomed)

    def abort(self, rid: str, abort_all: bool) -> int:
        self.server.stats.abort_requests += 1
        return self.server._abort(rid, abort_all)

    def flush_cache(self) -> bool:
        return not self.server._live  # scheduler.py flush_cache: only when idle (nothing else to reset here)

    def healthy(self) -> bool:
        return not self.server._starting

    async def health_generate(self) -> bool:
        return not self.server._starting  # no model to probe: as healthy as /health

    def server_info(self) -> dict[str, Any]:
        srv = self.server
        cfg = srv.config
        return sglang.server_info(
            model_path=cfg.model_path, served_model_name=cfg.model_path, limits=cfg.limits,
            max_running=cfg.max_running, dtype="simulated", device="none", skip_tokenizer_init=True,
            version=VERSION, running=len(srv._running), waiting=len(srv._live) - len(srv._running),
        )

    def model_info(self) -> dict[str, Any]:
        return sglang.model_info(model_path=self.server.config.model_path, model_type="simulated",
                                 architectures=["SimulatedForCausalLM"])


class _FaultMiddleware:
    """ASGI middleware: the faults that answer in place of the routes (admin paths exempt).

    An outage in 503 mode and fail_next answer an error body; drop_next closes the connection
    without an answer. The request body is read first, as a server that got the request would.
    """

    def __init__(self, app: Callable, server: SimServer):
        self.app, self.server = app, server

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        srv = self.server
        path = scope.get("path")
        if scope["type"] != "http" or path in _ADMIN_PATHS:
            await self.app(scope, receive, send)
            return
        if srv._down is not None:  # the "503" outage mode (refuse mode has no listener)
            fault = "down"
        else:
            fault = srv._take_fault(path)
        if fault is None:
            await self.app(scope, receive, send)
            return
        await _read_body(receive)
        if fault == "down":
            await sglang.error_response(503, "The server is down (simulated outage).")(scope, receive, send)
        elif fault == "fail":
            await sglang.error_response(srv._fail_status, srv._fail_message)(scope, receive, send)
        else:
            await srv._connections.drop(scope, receive, reset=srv._drop_reset)


class _Connections:
    """The server's open TCP connections by client address, for the faults HTTP has no words for.

    drop_next closes one request's connection without an answer (FIN, or RST with reset=True);
    down() cuts every open connection at once. Both need the connection's transport, which
    neither ASGI nor Starlette hands to an app: raising from the app makes uvicorn answer 500
    instead (or, once a response has started, close after sending its status line), and a TCP
    proxy in front would copy every byte through Python. uvicorn takes its HTTP protocol class
    through its public config (``Config(http=...)``), so a subclass of its h11 protocol records
    each connection in asyncio's own Protocol callbacks (``connection_made``/``connection_lost``),
    keyed by the peer address that ASGI gives every request as ``scope["client"]``.
    """

    def __init__(self):
        self.open: dict[tuple[str, int], asyncio.Transport] = {}
        self.refusing = False  # cut new connections at once (down() before uvicorn stops listening)
        self.protocol_class = self._tracking_protocol()

    def _tracking_protocol(self) -> type[H11Protocol]:
        connections = self

        class TrackedH11Protocol(H11Protocol):
            def connection_made(self, transport):
                super().connection_made(transport)
                self.tracked_transport = transport
                connections.opened(transport)

            def connection_lost(self, exc):
                connections.closed(self.tracked_transport)
                super().connection_lost(exc)

        return TrackedH11Protocol

    def opened(self, transport: asyncio.Transport) -> None:
        if self.refusing:
            transport.abort()
            return
        key = _peer(transport.get_extra_info("peername"))
        if key is not None:
            self.open[key] = transport

    def closed(self, transport: asyncio.Transport) -> None:
        key = _peer(transport.get_extra_info("peername"))
        if key is not None and self.open.get(key) is transport:
            del self.open[key]

    def abort_all(self) -> None:
        for transport in list(self.open.values()):
            transport.abort()

    async def drop(self, scope: dict, receive: Callable, *, reset: bool) -> None:
        """Close the connection of the request in `scope` without a response."""
        transport = self.open.get(_peer(scope.get("client")))
        if transport is None:
            raise RuntimeError(f"sim server: no open connection from {scope.get('client')} to drop")
        if reset:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # linger 0: close() sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        else:
            transport.close()
        # Return only once uvicorn has seen the disconnect, so it does not answer 500 for us.
        while (await receive())["type"] != "http.disconnect":
            pass


def _peer(address: Any) -> tuple[str, int] | None:
    """A TCP peer address as ASGI's scope["client"] gives it: (host, port)."""
    if not isinstance(address, (tuple, list)) or len(address) < 2:
        return None
    return str(address[0]), int(address[1])


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


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m deploy.sim_server --port N [--max-running ..] [--decode-ms ..] ...`` (foreground)."""
    ap = argparse.ArgumentParser(prog="python -m deploy.sim_server", description=__doc__.splitlines()[0])
    d = SimConfig()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000, help="0: any free port (printed on start)")
    ap.add_argument("--max-running", type=int, default=d.max_running, help="sequences decoding at once")
    ap.add_argument("--decode-ms", type=float, default=d.decode_s_per_token * 1e3, help="ms per output token")
    ap.add_argument("--prefill-ms", type=float, default=d.prefill_s_per_token * 1e3, help="ms per prompt token")
    ap.add_argument("--mean-len", type=float, default=d.mean_len, help="mean natural output length")
    ap.add_argument("--sigma", type=float, default=d.sigma, help="lognormal sigma (tail weight)")
    ap.add_argument("--length-dist", default=d.length_dist, choices=["lognormal", "exponential", "fixed"])
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--eos-id", type=int, default=d.eos_token_id)
    ap.add_argument("--context-length", type=int, default=d.context_length)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--starting", action="store_true", help="start with /health_generate answering 503")
    ap.add_argument("--log-level", default="warning")
    ap.add_argument("--api-key", default=None, help="SGLang's --api-key: required on every endpoint but /health*")
    ap.add_argument("--admin-api-key", default=None,
                    help="SGLang's --admin-api-key: the only key /abort_request and /flush_cache take")
    ap.add_argument("--sglang-version", default=d.sglang_version, choices=list(sglang.SGLANG_VERSIONS),
                    help="follow SGLang 0.5.23 (default) or 0.4.x where they differ")
    ap.add_argument("--disconnect-poll-s", type=float, default=d.disconnect_poll_s,
                    help="how often a disconnected client is noticed (SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT)")
    ap.add_argument("--reserved-tokens", type=int, default=d.reserved_tokens,
                    help="tokens reserved per request in the length checks, as an EAGLE server does")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        config = SimConfig(
            vocab_size=args.vocab_size, eos_token_id=args.eos_id, length_dist=args.length_dist,
            mean_len=args.mean_len, sigma=args.sigma, context_length=args.context_length,
            max_running=args.max_running, decode_s_per_token=args.decode_ms / 1e3,
            prefill_s_per_token=args.prefill_ms / 1e3, seed=args.seed, sglang_version=args.sglang_version,
            disconnect_poll_s=args.disconnect_poll_s, reserved_tokens=args.reserved_tokens,
        )
        server = SimServer(config, host=args.host, port=args.port, starting=args.starting, log_level=args.log_level,
                           api_key=args.api_key, admin_api_key=args.admin_api_key)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        asyncio.run(server.serve_forever())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
