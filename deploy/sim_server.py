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
cut at ``max_new_tokens`` with finish ``length``. A smaller ``max_new_tokens`` gives a prefix of
the same output, as greedy decoding would.

Capacity model (continuous batching): at most ``max_running`` sequences run at once, the others
wait FIFO; a running sequence of L output tokens finishes ``prefill_s_per_token * len(prompt) +
L * decode_s_per_token`` seconds after it started, however many run together (a GPU below
saturation). Capacity is ``max_running / decode_s_per_token`` tokens/s. ``SimServer.stats``
counts served and aborted tokens, the busy-slot integral and the observed maxima.

Endpoints: ``POST /generate`` (``input_ids`` single or batch; ``text`` is refused: no tokenizer),
``POST /abort_request``, ``GET /health``, ``GET /health_generate``, ``GET /server_info``,
``GET /model_info`` (also the ``/get_*`` names), ``/flush_cache``; admin: ``POST /_fault``
(see ``SimServer.apply_fault``) and ``GET /_stats`` for a server in another process.

Run it in-process (``with SimServer(max_running=4) as srv: srv.url``: uvicorn in a background
thread with its own event loop) or in the foreground:
``python -m deploy.sim_server --port N [--max-running ..] [--decode-ms ..] [--mean-len ..] [--seed ..]``.
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
import uuid
from array import array
from collections import deque
from typing import Any, Callable

import uvicorn

logger = logging.getLogger("eagle3.sim_server")

VERSION = "0.1.0-eagle3-sim"
_SAMPLING_EPS = 1e-6  # SGLang treats 0 <= temperature < 1e-6 as greedy
_FIRST_ID = 10  # output ids are drawn from [10, vocab_size): clear of the usual special ids

__all__ = ["SimConfig", "SimOutput", "SimServer", "SimStats", "main", "parse_sampling_params", "simulate_output"]


class _BadRequest(ValueError):
    """Bad input SGLang reports as a ValueError: 400 ``{"error": {"message": ...}}``."""


class _Malformed(ValueError):
    """Input SGLang's FastAPI layer rejects (bad JSON, wrong types): 400 OpenAI-style body."""


# ---------------------------------------------------------------------------------------------
# The pure part: configuration, sampling parameters, the simulated output
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

    # SGLang's scheduler limits, as in dev_server: max_req_len = context - 1, prompts of
    # max_req_len - 5 tokens or more are refused, max_new_tokens is clamped to what is left.
    @property
    def max_req_len(self) -> int:
        return self.context_length - 1

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

    @property
    def capacity_tokens_per_s(self) -> float:
        """Output tokens/s with every slot busy (inf when decoding takes no time)."""
        return math.inf if self.decode_s_per_token == 0 else self.max_running / self.decode_s_per_token


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """The sampling parameters the simulation looks at (others are accepted and ignored)."""

    max_new_tokens: int | None = 128  # SGLang's default; None = up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS or self.top_k == 1


def parse_sampling_params(raw: Any) -> SamplingParams:
    """Parse a request's ``sampling_params`` with SGLang's type rules and range checks."""
    if raw is None:
        return SamplingParams()
    if isinstance(raw, SamplingParams):
        return raw
    if not isinstance(raw, dict):
        raise _Malformed(f"sampling_params must be an object, got {type(raw).__name__}")

    def num(key, kind, default):
        v = raw.get(key)
        if v is None:  # SGLang treats null as "use the default"
            return default
        ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            raise _Malformed(f"sampling_params.{key} must be a number, got {v!r}")
        return kind(v)

    def flag(key):
        v = raw.get(key)
        if v is None:
            return False
        if not isinstance(v, bool):
            raise _Malformed(f"sampling_params.{key} must be a boolean, got {v!r}")
        return v

    stop = raw.get("stop_token_ids") or []
    if not isinstance(stop, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop):
        raise _Malformed(f"sampling_params.stop_token_ids must be a list of ints, got {stop!r}")
    p = SamplingParams(
        max_new_tokens=num("max_new_tokens", int, None) if "max_new_tokens" in raw else 128,
        temperature=num("temperature", float, 1.0),
        top_p=num("top_p", float, 1.0),
        top_k=num("top_k", int, -1),
        stop_token_ids=tuple(stop),
        ignore_eos=flag("ignore_eos"),
        no_stop_trim=flag("no_stop_trim"),
        sampling_seed=num("sampling_seed", int, None),
    )
    # Same checks and wording as SGLang's SamplingParams.verify.
    if not math.isfinite(p.temperature) or p.temperature < 0.0:
        raise _BadRequest(f"temperature must be a non-negative finite number, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise _BadRequest(f"top_p must be in (0, 1], got {p.top_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise _BadRequest(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise _BadRequest(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    return p


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
    if finish.get("type") == "stop" and not no_stop_trim:
        ids = ids[:-1]
    return " ".join([f"t{t}" for t in ids])


def _id_array(prompt_ids: Any) -> array:
    """The prompt as a C array of int64 (type-checks every element at C speed)."""
    if isinstance(prompt_ids, array) and prompt_ids.typecode == "q":
        return prompt_ids
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise _Malformed("input_ids must be a list of ints or a list of lists of ints")
    try:
        return array("q", prompt_ids)
    except (TypeError, OverflowError):
        raise _Malformed("input_ids must be a list of ints or a list of lists of ints") from None


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

    budget = max(0, cfg.max_req_len - n - 1)  # the scheduler's clamp of max_new_tokens
    limit = budget if p.max_new_tokens is None else min(p.max_new_tokens, budget)

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
    elif natural < limit:
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
        finish = {"type": "stop", "matched": stop_id}
    else:
        finish = {"type": "length", "length": length}
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
    dropped_connections: int = 0  # closed by drop_next
    rejected: int = 0  # 400 answers (bad input, reject_if)
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

    __slots__ = ("rid", "prompt_len", "out", "arrived", "queued_at", "started", "handle", "future", "state")

    def __init__(self, rid: str, prompt_len: int, out: SimOutput, arrived: float, future: asyncio.Future):
        self.rid, self.prompt_len, self.out = rid, prompt_len, out
        self.arrived, self.future = arrived, future
        self.queued_at = self.started = 0.0
        self.handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self.state = "new"  # new -> delay (slow) -> queued -> running -> done


def _json_bytes(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _error_body(status: int, message: str) -> dict:
    """SGLang's two error shapes: ValueError 400s vs HTTPException-style others."""
    if status == 400:
        return {"error": {"message": message}}
    kind = str(status)
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def _malformed_body(message: str) -> dict:
    return {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400}


class SimServer:
    """A simulated SGLang server on 127.0.0.1; see the module docstring.

    Every public method is safe to call from any thread (it runs on the server's event loop).
    Test usage::

        with SimServer(max_running=4, decode_s_per_token=0.01) as srv:
            httpx.post(srv.url + "/generate", json={"input_ids": [5, 6], ...})
            srv.fail_next(2)            # the next 2 /generate answer 503
            srv.drop_next(1)            # the next /generate gets its connection closed, no answer
            srv.slow(0.5)               # every /generate waits 0.5 s before it is scheduled
            srv.set_starting(True)      # /health and /health_generate answer 503
            srv.down(); srv.up()        # outage: refuse connections, drop in-flight; restart
            srv.reject_if(lambda ids: 7 in ids)   # 400 for matching prompts
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
        **config_fields: Any,
    ):
        self.config = dataclasses.replace(config or SimConfig(), **config_fields)
        self.host, self.port = host, port
        self.log_level = log_level
        self.stats = SimStats()
        # Fault injection state (touched only on the event loop once started).
        self._starting = starting
        self._fail_left, self._fail_status, self._fail_message, self._fail_path = 0, 503, "", "/generate"
        self._drop_left, self._drop_reset, self._drop_path = 0, False, "/generate"
        self._slow_s = 0.0
        self._reject: Callable[[list[int]], Any] | None = None
        self._down: str | None = None  # None | "refuse" | "503"
        # Engine state (event loop only).
        self._running: set[_Seq] = set()
        self._waiting: deque[_Seq] = deque()
        self._live: set[_Seq] = set()  # every unfinished sequence (delay, queued, running)
        self._last_touch = 0.0
        # Serving state.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._uv: uvicorn.Server | None = None
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
            self._asgi, host=self.host, port=self.port, lifespan="off", http="h11", ws="none",
            interface="asgi3", proxy_headers=False, server_header=False, date_header=False,
            log_config=None, log_level=self.log_level, access_log=False,
            timeout_keep_alive=120,  # idle keep-alive closes race with client reuse: keep them long
            timeout_graceful_shutdown=1,
        )
        uv = uvicorn.Server(config)
        self._uv = uv
        self._uv_task = asyncio.create_task(self._serve_life(uv, sock))
        deadline = time.monotonic() + 30
        while not uv.started:  # bounded poll: uvicorn has no startup event to await
            if self._uv_task.done():
                self._uv_task.result()  # raises what went wrong
                raise RuntimeError("sim server exited during startup")
            if time.monotonic() > deadline:
                raise RuntimeError("sim server did not start within 30 s")
            await asyncio.sleep(0.005)

    async def _serve_life(self, uv: uvicorn.Server, sock: socket.socket) -> None:
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
        try:
            for server in getattr(uv, "servers", []):
                server.close()  # no new connections from here on
            self._drop_connections()
            await asyncio.sleep(0)  # let connection_lost run: the handlers see a disconnect
            self._drop_all_sequences("Server shutting down")
            uv.should_exit = uv.force_exit = True
            await asyncio.wait_for(task, timeout=10)
        finally:
            self._uv = self._uv_task = None
            self._restarting = False

    def _drop_connections(self) -> None:
        if self._uv is None:
            return
        for conn in list(self._uv.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()

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

    def slow(self, seconds: float) -> None:
        """Hold every new /generate `seconds` before it is scheduled (0 to stop); counted in flight."""
        self._call(setattr, self, "_slow_s", max(0.0, float(seconds)))

    def set_starting(self, starting: bool) -> None:
        """While starting, /health and /health_generate answer 503 (generation is still served)."""
        self._call(setattr, self, "_starting", bool(starting))

    def reject_if(self, predicate: Callable[[list[int]], Any] | None) -> None:
        """400 for prompts where predicate(prompt_ids) is truthy (a str return is the message); None clears."""
        self._call(setattr, self, "_reject", predicate)

    def clear_faults(self) -> None:
        """Undo fail_next, drop_next, slow, reject_if and starting (not down: use up)."""

        def apply():
            self._fail_left = self._drop_left = 0
            self._slow_s, self._reject, self._starting = 0.0, None, False

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
        return self._call(self._abort, None, True)

    async def down_async(self, *, refuse: bool = True) -> None:
        if self._down is not None:
            return
        self._down = "refuse" if refuse else "503"
        if refuse:
            await self._stop_listening()
        else:
            self._drop_connections()
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
        reset (bool), slow (seconds), starting (bool), reject_token (int: 400 for prompts holding
        it; null clears), down (seconds of outage, or true: until up; refuse: bool, default true),
        up (true), clear (true), reset_stats (true). Must run on the server's event loop.
        """
        if spec.get("clear"):
            self.clear_faults()
        if "fail_next" in spec:
            self.fail_next(int(spec["fail_next"]), int(spec.get("status", 503)))
        if "drop_next" in spec:
            self.drop_next(int(spec["drop_next"]), reset=bool(spec.get("reset", False)))
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
            duration = cfg.prefill_s_per_token * seq.prompt_len + len(seq.out.output_ids) * cfg.decode_s_per_token
            seq.handle = loop.call_at(now + duration, self._complete, seq)
        self._gauges()

    def _complete(self, seq: _Seq) -> None:
        if seq.state != "running":
            return
        self.stats.completed += 1
        self.stats.served_tokens += len(seq.out.output_ids)
        self._finish(seq, seq.out.output_ids, seq.out.finish_reason)

    def _finish(self, seq: _Seq, ids: list[int], reason: dict) -> None:
        """Leave the engine and resolve the request's future with SGLang's response shape."""
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
        if not seq.future.done():
            seq.future.set_result({
                "text": _text(ids, reason, seq.out.no_stop_trim),
                "output_ids": ids,
                "meta_info": {
                    "id": seq.rid,
                    "finish_reason": reason,
                    "prompt_tokens": seq.prompt_len,
                    "completion_tokens": len(ids),
                    "cached_tokens": 0,
                    "reasoning_tokens": 0,
                    "e2e_latency": self._loop.time() - seq.arrived,
                },
            })
        self._schedule()
        self._gauges()

    def _abort_seq(self, seq: _Seq, message: str) -> None:
        """Finish `seq` with finish_reason abort and the tokens generated so far."""
        if seq.state == "done":
            return
        cfg, ids = self.config, seq.out.output_ids
        if seq.state == "running":
            elapsed = self._loop.time() - seq.started - cfg.prefill_s_per_token * seq.prompt_len
            done = len(ids) if cfg.decode_s_per_token == 0 else int(max(0.0, elapsed) / cfg.decode_s_per_token)
            if done >= len(ids):  # it had finished; the timer just has not fired yet
                self._complete(seq)
                return
            status = None
        else:
            done = 0
            message = "Abort in waiting queue" if message.startswith("Abort by") else message
            status = None
        self.stats.aborted += 1
        self.stats.aborted_tokens += done
        self._finish(seq, ids[:done], {"type": "abort", "message": message, "status_code": status})

    def _abort(self, rid: str | None, abort_all: bool = False) -> int:
        victims = [s for s in self._live if abort_all or s.rid == rid]
        for seq in victims:
            self._abort_seq(seq, "Abort by /abort_request")
        return len(victims)

    def _drop_all_sequences(self, message: str) -> None:
        for seq in list(self._live):
            self._abort_seq(seq, message)

    # -- HTTP (ASGI, event loop only) ------------------------------------------------------------

    async def _asgi(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        if path in ("/_fault", "/_stats"):
            await self._admin(path, method, receive, send)
            return
        if self._down is not None:  # the "503" outage mode (refuse mode has no listener)
            await _read_body(receive)
            await _send_json(send, 503, _error_body(503, "The server is down (simulated outage)."))
            return
        if self._fail_left > 0 and self._fail_path in (None, path):
            self._fail_left -= 1
            self.stats.injected_errors += 1
            if path == "/generate":
                self.stats.requests += 1
            await _read_body(receive)
            await _send_json(send, self._fail_status, _error_body(self._fail_status, self._fail_message))
            return
        if self._drop_left > 0 and self._drop_path in (None, path):
            self._drop_left -= 1
            self.stats.dropped_connections += 1
            if path == "/generate":
                self.stats.requests += 1
            await _read_body(receive)
            await _drop(receive, self._drop_reset)
            return
        if path == "/generate" and method in ("POST", "PUT"):
            await self._generate(receive, send)
        elif path == "/abort_request" and method == "POST":
            await self._abort_request(receive, send)
        elif path in ("/health", "/health_generate") and method == "GET":
            await _send_empty(send, 503 if self._starting else 200)
        elif path in ("/server_info", "/get_server_info") and method == "GET":
            await _send_json(send, 200, self._server_info())
        elif path in ("/model_info", "/get_model_info") and method == "GET":
            await _send_json(send, 200, self._model_info())
        elif path == "/flush_cache" and method in ("GET", "POST"):
            await _send_raw(send, 200, b"Cache flushed.\n", b"text/plain; charset=utf-8")
        else:
            await _send_json(send, 404, {"detail": "Not Found"})

    async def _generate(self, receive: Callable, send: Callable) -> None:
        stats = self.stats
        stats.requests += 1
        stats.open_requests += 1
        if stats.open_requests > stats.max_open_requests:
            stats.max_open_requests = stats.open_requests
        try:
            arrived = self._loop.time()
            body = await _read_body(receive)
            try:
                single, seqs = self._parse(body, arrived)
            except _Malformed as exc:
                stats.rejected += 1
                await _send_json(send, 400, _malformed_body(str(exc)))
                return
            except _BadRequest as exc:
                stats.rejected += 1
                await _send_json(send, 400, _error_body(400, str(exc)))
                return
            self._admit(seqs)
            futures = [s.future for s in seqs]
            result = futures[0] if single else asyncio.gather(*futures)
            # SGLang aborts a request whose client went away: watch for the disconnect.
            watcher = asyncio.ensure_future(receive())
            done, _ = await asyncio.wait((result, watcher), return_when=asyncio.FIRST_COMPLETED)
            if result not in done:
                for seq in seqs:
                    self._abort_seq(seq, "Abort: the client disconnected")
                return
            watcher.cancel()
            await _send_json(send, 200, result.result())
        finally:
            stats = self.stats  # reset_stats may have replaced it meanwhile
            stats.open_requests = max(0, stats.open_requests - 1)

    def _parse(self, raw: bytes, arrived: float) -> tuple[bool, list[_Seq]]:
        try:
            body = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise _Malformed(f"JSON decode error: {exc}") from exc
        if not isinstance(body, dict):
            raise _Malformed("The request body must be a JSON object.")
        if body.get("stream"):
            raise _BadRequest("stream=True is not supported by the eagle3 sim server; use stream=false.")
        if body.get("text") is not None:
            raise _BadRequest("The sim server has no tokenizer: send input_ids, not text.")
        input_ids = body.get("input_ids")
        if input_ids is None:
            raise _BadRequest("Either text, input_ids or input_embeds should be provided.")
        if not isinstance(input_ids, list):
            raise _Malformed("input_ids must be a list of ints or a list of lists of ints")
        if input_ids == []:
            raise _BadRequest("input_ids cannot be empty.")
        single = not isinstance(input_ids[0], list)
        prompts = [_id_array(input_ids)] if single else [_id_array(p) for p in input_ids]

        n = len(prompts)
        params = body.get("sampling_params")
        if isinstance(params, list):
            if single or len(params) != n:
                raise _BadRequest(f"sampling_params has {len(params)} entries for a batch of {n}.")
        else:
            params = [params] * n  # one dict applies to every item, as in SGLang
        rid = body.get("rid")
        if rid is None:
            rids = [uuid.uuid4().hex for _ in range(n)]
        elif single and isinstance(rid, str):
            rids = [rid]
        elif not single and isinstance(rid, list) and all(isinstance(r, str) for r in rid):
            if len(rid) != n:
                raise _BadRequest(f"rid has {len(rid)} entries for a batch of {n}.")
            rids = list(rid)
        else:
            raise _Malformed("rid must be a string (single request) or a list of strings (batch)")

        cfg = self.config
        seqs = []
        for ids, raw_params, r in zip(prompts, params, rids):
            p = parse_sampling_params(raw_params)
            self._validate(ids, p)
            if self._reject is not None:
                verdict = self._reject(ids.tolist())
                if verdict:
                    raise _BadRequest(verdict if isinstance(verdict, str)
                                      else "The prompt was rejected by the sim server's reject_if rule.")
            out = simulate_output(ids, p, cfg)
            seqs.append(_Seq(r, len(ids), out, arrived, self._loop.create_future()))
        return single, seqs

    def _validate(self, ids: array, p: SamplingParams) -> None:
        """SGLang's input checks, in dev_server's order and words."""
        cfg = self.config
        n = len(ids)
        if n == 0:
            raise _BadRequest("input_ids cannot be empty.")
        if max(ids) >= cfg.vocab_size:
            raise _BadRequest(f"The input_ids {ids.tolist()} contains values greater than the vocab size "
                              f"({cfg.vocab_size}).")
        if min(ids) < 0:
            raise _BadRequest(f"The input_ids {ids.tolist()} contains negative values.")
        ctx = cfg.context_length
        if n >= ctx:
            raise _BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if p.max_new_tokens is not None and n + p.max_new_tokens > ctx:
            raise _BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n + p.max_new_tokens} tokens: {n} tokens from the input "
                f"messages and {p.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        if n >= cfg.max_req_input_len:
            raise _BadRequest(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({cfg.max_req_input_len} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )

    async def _abort_request(self, receive: Callable, send: Callable) -> None:
        try:
            body = json.loads(await _read_body(receive) or b"{}")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            await _send_json(send, 400, _malformed_body(f"JSON decode error: {exc}"))
            return
        if not isinstance(body, dict):
            await _send_json(send, 400, _malformed_body("The request body must be a JSON object."))
            return
        self._abort(body.get("rid"), bool(body.get("abort_all")))
        await _send_empty(send, 200)

    def _server_info(self) -> dict[str, Any]:
        cfg = self.config
        return {
            "model_path": cfg.model_path,
            "tokenizer_path": cfg.model_path,
            "served_model_name": cfg.model_path,
            "context_length": cfg.context_length,
            "max_running_requests": cfg.max_running,
            "max_total_num_tokens": cfg.max_running * cfg.context_length,
            "max_req_input_len": cfg.max_req_input_len,
            "max_req_len": cfg.max_req_len,
            "vocab_size": cfg.vocab_size,
            "dtype": "simulated",
            "device": "none",
            "skip_tokenizer_init": True,
            "allow_auto_truncate": False,
            "version": VERSION,
            "internal_states": [{"num_running_reqs": len(self._running),
                                 "num_waiting_reqs": len(self._live) - len(self._running)}],
        }

    def _model_info(self) -> dict[str, Any]:
        return {
            "model_path": self.config.model_path,
            "tokenizer_path": self.config.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "simulated",
            "architectures": ["SimulatedForCausalLM"],
        }

    async def _admin(self, path: str, method: str, receive: Callable, send: Callable) -> None:
        raw = await _read_body(receive)
        if path == "/_stats" and method == "GET":
            await _send_json(send, 200, self.snapshot().to_dict())
            return
        if path == "/_fault" and method == "POST":
            try:
                spec = json.loads(raw or b"{}")
                if not isinstance(spec, dict):
                    raise ValueError("the body must be a JSON object")
                state = self.apply_fault(spec)
            except (ValueError, TypeError) as exc:
                await _send_json(send, 400, _error_body(400, f"bad fault spec: {exc}"))
                return
            await _send_json(send, 200, state)
            return
        await _send_json(send, 405, {"detail": "Method Not Allowed"})


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


async def _send_raw(send: Callable, status: int, body: bytes, content_type: bytes) -> None:
    headers = [(b"content-type", content_type), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def _send_json(send: Callable, status: int, obj: Any) -> None:
    await _send_raw(send, status, _json_bytes(obj), b"application/json")


async def _send_empty(send: Callable, status: int) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-length", b"0")]})
    await send({"type": "http.response.body", "body": b""})


async def _drop(receive: Callable, reset: bool) -> None:
    """Close this request's TCP connection without a response.

    uvicorn's ASGI receive is a bound method of its request cycle, which holds the transport.
    After closing it, wait for uvicorn to see the disconnect, so it does not try a 500.
    """
    transport = getattr(getattr(receive, "__self__", None), "transport", None)
    if transport is None:  # another server implementation: an exception before the response
        raise ConnectionAbortedError("sim server: injected connection drop")
    if reset:
        sock = transport.get_extra_info("socket")
        if sock is not None:  # linger 0: close() sends RST instead of FIN
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        transport.abort()
    else:
        transport.close()
    await receive()  # returns http.disconnect once connection_lost has run


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
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    config = SimConfig(
        vocab_size=args.vocab_size, eos_token_id=args.eos_id, length_dist=args.length_dist,
        mean_len=args.mean_len, sigma=args.sigma, context_length=args.context_length,
        max_running=args.max_running, decode_s_per_token=args.decode_ms / 1e3,
        prefill_s_per_token=args.prefill_ms / 1e3, seed=args.seed,
    )
    server = SimServer(config, host=args.host, port=args.port, starting=args.starting, log_level=args.log_level)
    try:
        asyncio.run(server.serve_forever())
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
