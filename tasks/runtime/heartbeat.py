"""A line at least every ~10 s while a step waits or works in silence: what it is doing, and for how long.

A stage that blocks on something it cannot see into (a server loading, ranks importing torch, an eval process
decoding prompts whose progress lines are only counted) would otherwise leave its log silent for minutes, and a user
cannot tell a slow step from a hung one. `Heartbeat` watches the task's log: whenever nothing was logged through it
for `every` seconds, it logs the current step's status, which the task keeps up to date (`doing`). A background
thread looks once a second; the decision (`due`) is plain code on an injectable clock, tested without waiting.

    with Heartbeat(logger.info) as beat:
        beat.doing("engine eval: waiting for the dev server's health check")   # "...: 20 s so far" every 10 s
        beat.doing(lambda s: f"spec-eval: {done}/{total} prompts, {s:.0f} s")  # the status, given the step's seconds
        beat.log("a line of the task's own")                                   # logged, and the silence restarts
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import TracebackType

EVERY_S = 10.0

Status = Callable[[float], str]  # the status line, given the seconds since the step began


class Heartbeat:
    """Log the current step's status whenever nothing was logged for `every` seconds (as a context: a thread)."""

    def __init__(
        self,
        log: Callable[[str], None],
        *,
        every: float = EVERY_S,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 1.0,
    ):
        self._log = log
        self.every = every
        self.clock = clock
        self.poll_s = poll_s
        self._status: Status | None = None
        self._since = self._last = clock()  # the step's start, the last line logged
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def doing(self, status: str | Status | None) -> None:
        """The step now under way: a phrase (logged as "PHRASE: N s so far") or a function of the step's seconds;
        None: nothing worth a line (a step that logs its own)."""
        if isinstance(status, str):
            phrase = status
            status = lambda seconds: f"{phrase}: {seconds:.0f} s so far"  # noqa: E731 - a status, like the caller's
        with self._lock:
            self._status = status
            self._since = self.clock()

    def log(self, line: str) -> None:
        """Log `line` (the task's own) and restart the silence."""
        self._log(line)
        self.note()

    def note(self) -> None:
        """Something was logged by other means: the silence restarts."""
        with self._lock:
            self._last = self.clock()

    def due(self) -> str | None:
        """The status line to log now (`every` seconds of silence under a step with a status), or None; a line returned
        counts as logged."""
        with self._lock:
            now = self.clock()
            if self._status is None or now - self._last < self.every:
                return None
            self._last = now
            return self._status(now - self._since)

    def beat(self) -> None:
        """Log the status line if one is due."""
        line = self.due()
        if line is not None:
            self._log(line)

    def _watch(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.beat()
            except Exception:  # noqa: BLE001 - a progress line is never the reason a stage fails
                pass

    def __enter__(self) -> Heartbeat:
        self.note()
        self._stop.clear()
        self._thread = threading.Thread(target=self._watch, name="heartbeat", daemon=True)
        self._thread.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
