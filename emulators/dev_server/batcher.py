"""The batcher: `Batcher`, continuous batching over per-sequence KV caches, run by one worker thread.

Concurrency: the event loop never runs the model. One worker thread owns the model and does
iteration-level batching: up to ``max_batch_size`` active sequences, each with its own KV cache;
every decode step left-pads those caches into one batch and runs one forward for all of them;
new requests are prefilled between steps, finished and aborted ones leave between steps. Finish
checks, aborts and answers follow SGLang 0.5.23 (0.4.x with ``sglang_version="0.4"``) as
emulators/sglang_protocol/ states them: a stop token before the length cap (`Batcher._append`,
`Batcher._speculate`), the queued-abort and running-abort answers, /flush_cache only when idle.

``avg_spec_accept_length`` in ``/server_info``'s ``internal_states`` follows SGLang 0.5.23's
scheduler_components/metrics_reporter.py: every verify round is one decode batch (batch size 1)
that adds its tokens to per-interval counters (accept tokens, forward count += batch size); every
``decode_log_interval`` (40) decode batches those are folded into lifetime totals, and the figure
is lifetime accept tokens / lifetime forward count (internal_state.py ``_average_accept_length``).
So it is absent until the first fold; it is NOT the mean over every round served (rounds since
the last fold are not in it), NOT a per-request mean, NOT the eval's per-round mean over a set of
prompts, and NOT limited to one client's requests: every request's rounds count (the
/health_generate probe's too, though its one token comes from the prefill and makes no round); a
successful ``/flush_cache`` (scheduler.py ``flush_cache`` -> ``metrics_reporter.reset_metrics``,
only when the server is idle) starts it over. ``decode_log_interval`` sets the interval (SGLang's
``--decode-log-interval``; 1 folds after every round, making it the mean over every round served).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from emulators.dev_server.sampling import sample
from emulators.dev_server.sequence import BatchSequence, cache_from_kv, kv_from_cache
from emulators.sglang_protocol.info import DECODE_LOG_INTERVAL
from emulators.sglang_protocol.results import (
    finish_abort,
    finish_length,
    finish_reason,
    generate_result,
    queued_abort_result,
    text_token_ids,
)
from emulators.sglang_protocol.versions import SGLangVersion
from models.eval.speculative_decoding import speculative_decode

logger = logging.getLogger("eagle3.dev_server")


class Batcher:
    """Continuous batching over per-sequence KV caches, run by one background thread."""

    def __init__(
        self,
        model,
        tokenizer,
        *,
        eos_ids: set[int],
        max_batch_size: int,
        draft=None,
        num_steps: int | None = None,
        sglang_version: str | SGLangVersion = "0.5",
        decode_log_interval: int = DECODE_LOG_INTERVAL,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.version = SGLangVersion.of(sglang_version)
        # With a draft every request is decoded alone and to its end by `_speculate`.
        self.draft, self.num_steps = draft, num_steps
        if draft is not None and (num_steps is None or num_steps < 1):
            raise ValueError(f"a draft needs num_steps >= 1, got {num_steps}")
        if decode_log_interval < 1:
            raise ValueError(f"decode_log_interval must be >= 1, got {decode_log_interval}")
        # SGLang 0.5.23 scheduler_components/metrics_reporter.py's speculative counters (under _cond):
        # per interval (spec_num_accept_tokens, spec_num_forward_ct), lifetime (spec_total_*), and
        # forward_ct_decode, the decode batches that time the folds.
        self.decode_log_interval = decode_log_interval
        self.spec_num_accept_tokens = self.spec_num_forward_ct = 0
        self.spec_total_num_accept_tokens = self.spec_total_num_forward_ct = 0
        self.forward_ct_decode = 0
        self.eos_ids = frozenset(eos_ids)
        # Encoding runs on the event loop, decoding here: don't let them share the Rust tokenizer at once.
        self.tokenizer_lock = threading.Lock()
        self.max_batch_size = max_batch_size
        # transformers 5 renamed the forward argument and output field `past_key_values` -> `cache`.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._waiting: deque[BatchSequence] = deque()
        self._admitted: list[BatchSequence] = []  # taken from the queue, prefill pending
        self._active: list[BatchSequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- called from the event loop ------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dev-server-batcher", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def submit(self, seqs: list[BatchSequence]) -> None:
        with self._cond:
            self._waiting.extend(seqs)
            self._cond.notify()

    def abort(self, match: Callable[[str], bool] | None = None, *, seqs=()) -> int:
        """Flag the waiting/active sequences whose rid `match`es (or in `seqs`); the worker finishes
        them before its next step: a queued one as SGLang's queued abort, the others as a running one."""
        wanted = set(seqs)
        n = 0
        with self._cond:
            for s in (*self._waiting, *self._admitted, *self._active):
                if not s.abort_requested and (s in wanted or (match is not None and match(s.rid))):
                    s.abort_requested, n = True, n + 1
            self._cond.notify()
        return n

    def flush_cache(self) -> bool:
        """scheduler.py `flush_cache` (0.5.23): only when idle, and then `metrics_reporter.reset_metrics()`."""
        with self._cond:
            if self._waiting or self._admitted or self._active:
                return False
            self.spec_num_accept_tokens = self.spec_num_forward_ct = 0
            self.spec_total_num_accept_tokens = self.spec_total_num_forward_ct = 0
            self.forward_ct_decode = 0
            return True

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
                # Aborted ones leave the queue first (scheduler.py abort_request pops them from the waiting
                # queue as the abort arrives: they never start). Then admit between steps, FIFO, up to the
                # batch limit; they stay visible to abort() in `_admitted` until their prefill has put them
                # in `_active`.
                aborted = [s for s in self._waiting if s.abort_requested]
                for s in aborted:
                    self._waiting.remove(s)
                while self._waiting and len(self._active) + len(self._admitted) < self.max_batch_size:
                    self._admitted.append(self._waiting.popleft())
                admitted = list(self._admitted)
            for s in aborted:  # scheduler.py abort_request, "abort method 1": popped from the waiting queue
                self._finish_queued(s)
            try:
                with torch.inference_mode():
                    for s in admitted:
                        if self.draft is not None:
                            self._speculate(s)
                        else:
                            self._prefill(s)
                    self._step()
            except Exception as exc:  # keep serving: fail what was running, not the server
                logger.exception("model step failed")
                with self._cond:
                    failed, self._active, self._admitted = [*self._active, *self._admitted], [], []
                for s in failed:
                    if not s.future.done():
                        s.loop.call_soon_threadsafe(_set_exception, s.future, exc)
        # Shutdown: nobody will run these any more.
        with self._cond:
            leftover = [*self._waiting, *self._admitted, *self._active]
            self._waiting.clear()
            self._active, self._admitted = [], []
        for s in leftover:
            self._finish(s, finish_abort("Server shutting down", 503))

    def _prefill(self, s: BatchSequence) -> None:
        """Run one admitted sequence's prompt and sample its first token; it then joins `_active`."""
        reason, logits = None, None
        if s.abort_requested:  # out of the queue already: a running request's abort (FINISH_ABORT)
            reason = finish_abort()
        elif s.max_new_tokens <= 0:
            reason = finish_length(0)
        else:
            # Alone, unpadded: a prompt's prefill is exactly what it would be without batching.
            out = self.model(input_ids=torch.tensor([s.prompt_ids], dtype=torch.long), use_cache=True, logits_to_keep=1)
            s.kv, logits = kv_from_cache(out[self._cache_arg]), out.logits[0, -1]
            seed = s.params.sampling_seed if s.params.sampling_seed is not None else secrets.randbits(63)
            s.generator = torch.Generator().manual_seed(seed)
        with self._cond:
            self._admitted.remove(s)
            if reason is None:
                self._active.append(s)
        if reason is not None:
            self._finish(s, reason)
        elif logits is None:
            raise RuntimeError(f"prefill of {s.rid!r} set no finish reason and no logits to sample from")
        else:
            self._append(s, logits)

    def _speculate(self, s: BatchSequence) -> None:
        """Decode one admitted (greedy) sequence to its end with the draft, as models/eval/speculative_decoding.py
        does."""
        reason: dict[str, Any] | None
        if s.abort_requested:
            reason = finish_abort()
        elif s.max_new_tokens <= 0:
            reason = finish_length(0)
        else:
            # SGLang's stop rule: eos ids and the request's stop_token_ids, neither under ignore_eos.
            stop = set() if s.params.ignore_eos else {*self.eos_ids, *s.params.stop_token_ids}
            if self.num_steps is None:
                raise RuntimeError("_speculate without num_steps: the Batcher has a draft but no num_steps")
            # speculative_decode cuts a round at the cap before it looks for a stop, so a stop accepted
            # beyond max_new_tokens never gets in: a length finish at the cap, as SGLang 0.5.23's
            # schedule_batch.py `_cap_finished_len_at_max_new_tokens` demotes it.
            out, rounds = speculative_decode(
                self.model,
                self.draft,
                s.prompt_ids,
                num_steps=self.num_steps,
                max_new_tokens=s.max_new_tokens,
                eos_token_ids=stop,
            )
            s.output_ids, s.spec_verify_ct = out, len(rounds)
            with self._cond:
                for r in rounds:
                    self._count_decode_batch(batch_size=1, accept_tokens=r.kept)
            # 0.5.23 `update_finish_state`: a stop token (even the max_new_tokens-th) before the length cap.
            reason = finish_reason(out, s.max_new_tokens, stop, self.version)
            if reason is None:
                raise RuntimeError("speculative_decode ended at neither a stop token nor max_new_tokens")
        with self._cond:
            self._admitted.remove(s)
        self._finish(s, reason)

    def _count_decode_batch(self, *, batch_size: int, accept_tokens: int) -> None:
        """One speculative decode batch, counted as SGLang 0.5.23 counts it (call under _cond).

        batch_result_processor.py: `update_spec_metrics(bs, num_accept_tokens=num_generated_tokens)`
        (spec_num_accept_tokens += tokens, spec_num_forward_ct += bs), then forward_ct_decode += 1 and
        metrics_reporter.py `report_decode_stats`: every decode_log_interval batches, the interval
        counters are folded into the lifetime ones and zeroed.
        """
        self.spec_num_accept_tokens += accept_tokens
        self.spec_num_forward_ct += batch_size
        self.forward_ct_decode = (self.forward_ct_decode + 1) % (1 << 30)
        if self.forward_ct_decode % self.decode_log_interval == 0:
            self.spec_total_num_accept_tokens += self.spec_num_accept_tokens
            self.spec_total_num_forward_ct += self.spec_num_forward_ct
            self.spec_num_accept_tokens = self.spec_num_forward_ct = 0

    @property
    def avg_spec_accept_length(self) -> float | None:
        """SGLang's figure (internal_state.py `_average_accept_length`): lifetime accept tokens / lifetime
        forward count, folded every decode_log_interval decode batches; None before the first fold."""
        with self._cond:
            if self.spec_total_num_forward_ct <= 0:
                return None
            return self.spec_total_num_accept_tokens / self.spec_total_num_forward_ct

    def _step(self) -> None:
        """One decode step: every active sequence feeds its last token through one forward."""
        with self._cond:
            aborted = [s for s in self._active if s.abort_requested]
            self._active = batch = [s for s in self._active if not s.abort_requested]
        for s in aborted:  # "abort method 3": to_finish = FINISH_ABORT(), out through the normal path
            self._finish(s, finish_abort())
        batch = list(batch)
        if not batch:
            return
        lens = [s.kv_len for s in batch]
        width = max(lens)
        # Left-pad each cache to the longest one. Padded slots are masked out; positions are
        # passed explicitly so RoPE sees each sequence's own offset, not the padded one.
        kv = [
            tuple(
                torch.cat([F.pad(s.prefilled_kv[layer][i], (0, 0, width - n, 0)) for s, n in zip(batch, lens)])
                for i in (0, 1)
            )
            for layer in range(len(batch[0].prefilled_kv))
        ]
        mask = torch.zeros(len(batch), width + 1, dtype=torch.long)
        for row, n in enumerate(lens):
            mask[row, width - n :] = 1
        out = self.model(
            input_ids=torch.tensor([[s.output_ids[-1]] for s in batch], dtype=torch.long),
            attention_mask=mask,
            position_ids=torch.tensor([[n] for n in lens], dtype=torch.long),
            use_cache=True,
            **{self._cache_arg: cache_from_kv(kv)},
        )
        new_kv = kv_from_cache(out[self._cache_arg])
        for row, (s, n) in enumerate(zip(batch, lens)):
            # Strip the padding again: slice this row's real positions (the n old ones + the new one).
            s.kv = [(k[row : row + 1, :, width - n :], v[row : row + 1, :, width - n :]) for k, v in new_kv]
            self._append(s, out.logits[row, -1])

    def _append(self, s: BatchSequence, logits: torch.Tensor) -> None:
        """Sample one token for `s`, then apply SGLang's finish checks in SGLang's order."""
        if s.generator is None:
            raise RuntimeError(f"sequence {s.rid!r} has no generator: it is sampled before its prefill")
        token = sample(logits.float(), s.params, s.generator)
        s.output_ids.append(token)
        p = s.params
        # ignore_eos also disables stop_token_ids, as in SGLang; 0.5.23 `update_finish_state` checks the
        # stop token before the length cap (0.4.x `check_finished`: the cap first).
        stop = () if p.ignore_eos else (*p.stop_token_ids, *self.eos_ids)
        reason = finish_reason(s.output_ids, s.max_new_tokens, stop, self.version)
        if reason is None:
            return
        with self._cond:
            if s in self._active:
                self._active.remove(s)
        self._finish(s, reason)

    def _finish(self, s: BatchSequence, reason: dict) -> None:
        s.finish_reason = reason
        s.kv = None
        ids = text_token_ids(s.output_ids, reason, s.params.no_stop_trim)
        with self.tokenizer_lock:
            text = self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens) if ids else ""
        result = generate_result(
            rid=s.rid,
            text=text,
            output_ids=list(s.output_ids),
            finish_reason=reason,
            prompt_tokens=len(s.prompt_ids),
            e2e_latency=time.perf_counter() - s.created,
            spec_verify_ct=(s.spec_verify_ct or 0) if self.draft is not None else None,
            version=self.version,
        )
        s.loop.call_soon_threadsafe(_set_result, s.future, result)

    def _finish_queued(self, s: BatchSequence) -> None:
        """A sequence aborted in the waiting queue: tokenizer_manager.py `_handle_abort_req`'s answer."""
        s.finish_reason = {"type": "abort", "message": "Abort in waiting queue"}
        result = queued_abort_result(rid=s.rid, e2e_latency=time.perf_counter() - s.created, version=self.version)
        s.loop.call_soon_threadsafe(_set_result, s.future, result)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)
