"""The simulated engine: SGLang's scheduler as a continuous-batching capacity model, with SGLang's abort rules.

Capacity model (continuous batching): at most ``max_running`` sequences run at once, the others
wait FIFO; a running sequence of L output tokens finishes ``prefill_s_per_token * len(prompt) +
L * decode_s_per_token`` seconds after it started, however many run together (a GPU below
saturation). Capacity is ``max_running / decode_s_per_token`` tokens/s. ``SimServer.stats``
counts served and aborted tokens, the busy-slot integral and the observed maxima.

Request ids and aborts follow SGLang 0.5.23 as emulators/sglang_protocol/rids.py and results.py state them, with their
sources: a rid is held from admission until its final output (tokenizer_manager.py ``rid_to_state``),
/abort_request aborts the waiting queue first, then the running (srt/managers/scheduler.py ``abort_request``),
a queued abort gets tokenizer_manager.py ``_handle_abort_req``'s answer, a running one ``FINISH_ABORT()`` with
the tokens generated so far.

`Scheduler` is the engine half of `SimServer` (server.py mixes it in); it runs on the server's event loop only.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from emulators.sglang_protocol.results import finish_abort, generate_result, queued_abort_result
from emulators.sglang_protocol.rids import HeldRids, abort_matcher
from emulators.sglang_protocol.versions import SGLangVersion
from emulators.sim.output import SimOutput, output_text

if TYPE_CHECKING:
    from emulators.sim.config import SimConfig
    from emulators.sim.stats import SimStats


class Seq:
    """One prompt inside the simulated engine."""

    __slots__ = (
        "rid",
        "prompt_len",
        "out",
        "arrived",
        "queued_at",
        "started",
        "handle",
        "future",
        "state",
        "doomed",
        "held",
    )

    def __init__(
        self,
        rid: str,
        prompt_len: int,
        out: SimOutput,
        arrived: float,
        future: asyncio.Future,
        doomed: bool = False,
        held: bool = False,
    ):
        self.rid, self.prompt_len, self.out = rid, prompt_len, out
        self.arrived, self.future = arrived, future
        self.doomed = doomed  # abort_if: the server aborts it when it starts running
        self.held = held  # hold_if: never scheduled; it ends only when aborted (a request, a disconnect, shutdown)
        self.queued_at = self.started = 0.0
        self.handle: asyncio.Handle | asyncio.TimerHandle | None = None
        self.state = "new"  # new -> delay (slow) -> queued -> running -> done


class Scheduler:
    """The simulated engine inside `SimServer`: sequences admitted, queued FIFO, run, then finished or aborted.

    Event loop only. It uses the server's `config`, `version`, `stats` and `_loop`, and `_slow_s` (faults.py).
    """

    # Set by SimServer.__init__ / SimServer._begin (server.py) and FaultInjection._init_faults (faults.py).
    config: SimConfig
    version: SGLangVersion
    stats: SimStats
    _loop: asyncio.AbstractEventLoop | None
    _slow_s: float

    def _init_engine(self) -> None:
        # Engine state (event loop only).
        self._running: set[Seq] = set()
        self._waiting: deque[Seq] = deque()
        self._live: set[Seq] = set()  # every unfinished sequence (delay, queued, running)
        self._held = HeldRids(self.version)  # SGLang's rid_to_state: claimed at admission, freed at the end
        self._last_touch = 0.0

    def _batch_loop(self) -> asyncio.AbstractEventLoop:
        """The server's event loop, which the engine runs on; none means the server is not started (a bug)."""
        loop = self._loop
        if loop is None:
            raise RuntimeError("the sim engine was used with no event loop: SimServer is not started")
        return loop

    def _touch(self) -> None:
        """Advance the busy integrals to now (call before the running set changes)."""
        now = self._batch_loop().time()
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

    def _admit(self, seqs: list[Seq]) -> None:
        """New sequences enter the server: held by hold_if() or slow(), else queued for a slot."""
        for seq in seqs:
            self._live.add(seq)
            self.stats.sequences += 1
        delay = self._slow_s
        for seq in seqs:
            if seq.held:
                seq.state = "delay"
            elif delay > 0:
                seq.state = "delay"
                seq.handle = self._batch_loop().call_later(delay, self._enqueue, seq)
            else:
                self._enqueue(seq)
        self._gauges()

    def _enqueue(self, seq: Seq) -> None:
        if seq.state == "done":
            return
        seq.handle = None
        if seq.out.finish_reason.get("length") == 0:  # max_new_tokens 0: nothing to run
            self._finish(seq, seq.out.output_ids, seq.out.finish_reason)
            return
        seq.state, seq.queued_at = "queued", self._batch_loop().time()
        if self._waiting or len(self._running) >= self.config.max_running:
            self.stats.queued_sequences += 1  # no free slot: it will wait
        self._waiting.append(seq)
        self._schedule()

    def _schedule(self) -> None:
        """Give free slots to waiting sequences, FIFO."""
        if not self._waiting or len(self._running) >= self.config.max_running:
            return
        self._touch()
        loop, cfg = self._batch_loop(), self.config
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

    def _complete(self, seq: Seq) -> None:
        if seq.state != "running":
            return
        self.stats.completed += 1
        self.stats.served_tokens += len(seq.out.output_ids)
        self._finish(seq, seq.out.output_ids, seq.out.finish_reason)

    def _finish(self, seq: Seq, ids: list[int], reason: dict, *, result: dict | None = None) -> None:
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
            seq.future.set_result(
                result
                or generate_result(
                    rid=seq.rid,
                    text=output_text(ids, reason, seq.out.no_stop_trim),
                    output_ids=ids,
                    finish_reason=reason,
                    prompt_tokens=seq.prompt_len,
                    e2e_latency=self._batch_loop().time() - seq.arrived,
                    version=self.version,
                )
            )
        self._schedule()
        self._gauges()

    def _abort_seq(self, seq: Seq, cause: str) -> bool:
        """Abort `seq` for `cause` ("request", "disconnect", "server" or "shutdown"); False if it had already finished.

        Still queued (or held by slow() or hold_if()): SGLang's queued-abort answer (queued_abort_result).
        Running: FINISH_ABORT() through the normal output path with the tokens generated so far.
        """
        if seq.state == "done":
            return False
        cfg, ids = self.config, seq.out.output_ids
        reason = finish_abort("Server shutting down" if cause == "shutdown" else None)
        if seq.state == "running":
            elapsed = self._batch_loop().time() - seq.started - cfg.prefill_s_per_token * seq.prompt_len
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
                result = queued_abort_result(
                    rid=seq.rid, e2e_latency=self._batch_loop().time() - seq.arrived, version=self.version
                )
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
        """/abort_request: every sequence whose rid starts with `rid`, if `rid` is held (rids.py `abort_matcher`)."""
        match = abort_matcher(rid, abort_all, self._held)
        if match is None:
            return 0
        # scheduler.py abort_request: the waiting queue first (those never start), then the running ones.
        victims = sorted((s for s in self._live if match(s.rid)), key=lambda s: s.state == "running")
        return sum(self._abort_seq(seq, cause) for seq in victims)

    def _drop_all_sequences(self, message: str) -> None:
        for seq in list(self._live):
            self._abort_seq(seq, "shutdown")
