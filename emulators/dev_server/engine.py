"""SGLang-compatible dev server: SGLang's native HTTP protocol over a small HF causal LM on CPU.

Used by the embedded demo and the tests in place of a real SGLang server. It speaks the subset of
SGLang's native API the pipeline uses -- endpoints, request rules, response and error shapes are
defined once in ``emulators/sglang_protocol.py`` (shared with the simulated server); this module is
the real model behind them:

- ``POST /generate`` takes ``text`` (tokenized with no chat template and no special tokens) or
  ``input_ids``. SGLang sampling params it does not implement (stop strings, penalties,
  grammars, ...) are refused (400) unless they have their no-op values.
- ``GET /health_generate`` is a 1-token probe through the batcher.

vLLM's hidden-state extraction (``--speculative-config`` / ``--kv-transfer-config``, vLLM's flags with
``extract_hidden_states`` and ``ExampleHiddenStatesConnector``): the server also answers vLLM's
``POST /v1/completions`` for token-id prompts and writes the connector's safetensors files, so the
capture's vLLM backend runs against the tiny target (``emulators/vllm_extract.py``).

SGLang behaviours it follows (SGLang 0.5.23 unless started with ``sglang_version="0.4"``; the rules
and their sources are in ``emulators/sglang_protocol.py``): a stop token before the length cap
(`Engine._append`, `Engine._speculate`); a held rid refused as a duplicate; a disconnected client
noticed only on the ``disconnect_poll_s`` poll (default SGLang's 4 s); /abort_request by rid prefix;
the queued-abort and running-abort answers; ``--api-key`` / ``--admin-api-key``; /flush_cache
refused (400) while requests are in flight, and resetting the speculative metrics when it succeeds.

Deliberate differences from SGLang: ``cached_tokens`` is always 0 (no prefix cache).
``max_new_tokens: 0`` returns at once with no tokens and finish ``length`` 0, without running
the model. A request aborted after it left the queue but before its prefill ran finishes as a
running abort with no tokens (SGLang runs that one prefill first).

Speculative decoding (``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
--speculative-num-steps S [--speculative-eagle-topk 1] [--speculative-num-draft-tokens S+1]``,
SGLang's flags): the server loads an EAGLE-3 draft exported by ``models/eagle3_export.py`` and
decodes every request with chain (top-1) speculative decoding -- the very function the in-process
eval uses, ``models.spec_eval.speculative_decode`` (greedy target, top-1 draft). ``meta_info`` then
carries SGLang's ``spec_verify_ct``: the request's verify rounds (target forwards after the
prefill); the first token comes from the prefill and belongs to no round, so a request that ends
there has 0. SGLang's acceptance length is ``completion_tokens / spec_verify_ct``; the per-round
mean the eval reports excludes that prefill token: ``(completion_tokens - 1) / spec_verify_ct``.
Like SGLang's EAGLE worker, the server reserves ``max(topk * steps, draft tokens)`` = S + 1 tokens
per request in its length checks (srt/managers/utils.py ``compute_num_reserved_tokens``), so a
prompt that fits the plain server can be refused by the one with the draft.

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
Greedy only: a request with temperature > 0 (and top_k != 1) is refused with 400 while a draft is
loaded (SGLang samples with a draft; this server does not). Only topk 1 and S+1 draft tokens exist.
Greedy speculative decoding returns exactly the tokens plain greedy decoding returns.
Throughput cost: with a draft, requests are not batched -- the worker runs one request's whole
speculative decode at a time (batch size 1), and /abort_request reaches a request only before it
starts.

Concurrency: the event loop never runs the model. One worker thread owns the model and does
iteration-level batching: up to ``max_batch_size`` active sequences, each with its own KV cache;
every decode step left-pads those caches into one batch and runs one forward for all of them;
new requests are prefilled between steps, finished and aborted ones leave between steps.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import inspect
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request

from emulators import sglang_protocol as sglang
from emulators import vllm_extract
from emulators.flag_values import flag_values
from emulators.sglang_protocol import SamplingParams
from models.spec_eval import speculative_decode
from models.target_loader import load_language_model

logger = logging.getLogger("eagle3.dev_server")

VERSION = "0.1.0-eagle3-dev"
_HEALTH_CHECK_TIMEOUT_S = 20.0

__all__ = ["SamplingParams", "Speculative", "VERSION", "create_app", "main", "serve"]


@dataclasses.dataclass(frozen=True)
class Speculative:
    """A draft to serve with, from SGLang's `--speculative-*` flags (checked by `from_flags`)."""

    draft_model_path: str
    num_steps: int

    @classmethod
    def from_flags(
        cls,
        *,
        draft_model_path: str | Path | None,
        algorithm: str | None = None,
        num_steps: int | None = None,
        eagle_topk: int | None = None,
        num_draft_tokens: int | None = None,
    ) -> Speculative | None:
        """None without a draft path; ValueError (SGLang's flag names) for what this server cannot do."""
        if draft_model_path is None:
            given = {
                "--speculative-algorithm": algorithm,
                "--speculative-num-steps": num_steps,
                "--speculative-eagle-topk": eagle_topk,
                "--speculative-num-draft-tokens": num_draft_tokens,
            }
            extra = [flag for flag, value in given.items() if value is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} given without --speculative-draft-model-path")
            return None
        if algorithm is not None and algorithm.upper() != "EAGLE3":
            raise ValueError(
                f"--speculative-algorithm must be EAGLE3 (the only draft this server runs), got {algorithm!r}"
            )
        if num_steps is None:
            raise ValueError("--speculative-num-steps is required with --speculative-draft-model-path")
        if num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {num_steps}")
        if eagle_topk is not None and eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk must be 1 (chain speculative decoding only), got {eagle_topk}")
        if num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 = {num_steps + 1} "
                f"with topk 1, got {num_draft_tokens}"
            )
        path = Path(draft_model_path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--speculative-draft-model-path {path}: no config.json (an EAGLE-3 export, models/eagle3_export.py)"
            )
        return cls(draft_model_path=str(path), num_steps=int(num_steps))

    @property
    def reserved_tokens(self) -> int:
        """What SGLang's tokenizer manager reserves per request for this draft (`compute_num_reserved_tokens`)."""
        return sglang.num_reserved_tokens(eagle_topk=1, num_steps=self.num_steps, num_draft_tokens=self.num_steps + 1)

    def server_args(self) -> dict[str, Any]:
        """SGLang's server-arg names and values, as /server_info reports them."""
        return {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": self.draft_model_path,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": self.num_steps + 1,
        }


# ---------------------------------------------------------------------------------------------
# The engine: one worker thread owns the model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class EngineSequence:
    """One request's state inside the engine."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # after SGLang's clamp to the context
    created: float  # perf_counter at arrival, for e2e_latency
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    output_ids: list[int] = dataclasses.field(default_factory=list)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, kv_heads, len, head_dim]
    generator: torch.Generator | None = None
    abort_requested: bool = False
    finish_reason: dict | None = None
    spec_verify_ct: int | None = None  # verify rounds, with a draft

    @property
    def prefilled_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`kv`, which only a sequence that has had its prefill has."""
        if self.kv is None:
            raise RuntimeError(f"sequence {self.rid!r} has no KV cache: used before its prefill or after its finish")
        return self.kv

    @property
    def kv_len(self) -> int:
        return self.prefilled_kv[0][0].shape[2]


def _kv_from_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _cache_from_kv(kv: list[tuple[torch.Tensor, ...]]):  # per layer (keys, values)
    from transformers import DynamicCache

    if "ddp_cache_data" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(ddp_cache_data=kv)
    # Older transformers (before ddp_cache_data) only; transformers 5, whose stubs mypy reads, removed it.
    return DynamicCache.from_legacy_cache(tuple(kv))  # type: ignore[attr-defined]


class Engine:
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
        sglang_version: str | sglang.SGLangVersion = "0.5",
        decode_log_interval: int = sglang.DECODE_LOG_INTERVAL,
    ):
        self.model, self.tokenizer = model, tokenizer
        self.version = sglang.SGLangVersion.of(sglang_version)
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
        self._waiting: deque[EngineSequence] = deque()
        self._admitted: list[EngineSequence] = []  # taken from the queue, prefill pending
        self._active: list[EngineSequence] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None

    # -- called from the event loop ------------------------------------------------------------

    def start(self) -> None:
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="dev-server-engine", daemon=True)
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

    def submit(self, seqs: list[EngineSequence]) -> None:
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
            self._finish(s, sglang.finish_abort("Server shutting down", 503))

    def _prefill(self, s: EngineSequence) -> None:
        """Run one admitted sequence's prompt and sample its first token; it then joins `_active`."""
        reason, logits = None, None
        if s.abort_requested:  # out of the queue already: a running request's abort (FINISH_ABORT)
            reason = sglang.finish_abort()
        elif s.max_new_tokens <= 0:
            reason = sglang.finish_length(0)
        else:
            # Alone, unpadded: a prompt's prefill is exactly what it would be without batching.
            out = self.model(input_ids=torch.tensor([s.prompt_ids], dtype=torch.long), use_cache=True, logits_to_keep=1)
            s.kv, logits = _kv_from_cache(out[self._cache_arg]), out.logits[0, -1]
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

    def _speculate(self, s: EngineSequence) -> None:
        """Decode one admitted (greedy) sequence to its end with the draft, as models/spec_eval.py does."""
        reason: dict[str, Any] | None
        if s.abort_requested:
            reason = sglang.finish_abort()
        elif s.max_new_tokens <= 0:
            reason = sglang.finish_length(0)
        else:
            # SGLang's stop rule: eos ids and the request's stop_token_ids, neither under ignore_eos.
            stop = set() if s.params.ignore_eos else {*self.eos_ids, *s.params.stop_token_ids}
            if self.num_steps is None:
                raise RuntimeError("_speculate without num_steps: the Engine has a draft but no num_steps")
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
            reason = sglang.finish_reason(out, s.max_new_tokens, stop, self.version)
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
            self._finish(s, sglang.finish_abort())
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
            **{self._cache_arg: _cache_from_kv(kv)},
        )
        new_kv = _kv_from_cache(out[self._cache_arg])
        for row, (s, n) in enumerate(zip(batch, lens)):
            # Strip the padding again: slice this row's real positions (the n old ones + the new one).
            s.kv = [(k[row : row + 1, :, width - n :], v[row : row + 1, :, width - n :]) for k, v in new_kv]
            self._append(s, out.logits[row, -1])

    def _append(self, s: EngineSequence, logits: torch.Tensor) -> None:
        """Sample one token for `s`, then apply SGLang's finish checks in SGLang's order."""
        if s.generator is None:
            raise RuntimeError(f"sequence {s.rid!r} has no generator: it is sampled before its prefill")
        token = _sample(logits.float(), s.params, s.generator)
        s.output_ids.append(token)
        p = s.params
        # ignore_eos also disables stop_token_ids, as in SGLang; 0.5.23 `update_finish_state` checks the
        # stop token before the length cap (0.4.x `check_finished`: the cap first).
        stop = () if p.ignore_eos else (*p.stop_token_ids, *self.eos_ids)
        reason = sglang.finish_reason(s.output_ids, s.max_new_tokens, stop, self.version)
        if reason is None:
            return
        with self._cond:
            if s in self._active:
                self._active.remove(s)
        self._finish(s, reason)

    def _finish(self, s: EngineSequence, reason: dict) -> None:
        s.finish_reason = reason
        s.kv = None
        ids = sglang.text_token_ids(s.output_ids, reason, s.params.no_stop_trim)
        with self.tokenizer_lock:
            text = self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens) if ids else ""
        result = sglang.generate_result(
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

    def _finish_queued(self, s: EngineSequence) -> None:
        """A sequence aborted in the waiting queue: tokenizer_manager.py `_handle_abort_req`'s answer."""
        s.finish_reason = {"type": "abort", "message": "Abort in waiting queue"}
        result = sglang.queued_abort_result(
            rid=s.rid, e2e_latency=time.perf_counter() - s.created, version=self.version
        )
        s.loop.call_soon_threadsafe(_set_result, s.future, result)


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)


def _sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """Greedy, or temperature + top-k + top-p sampling with the request's own generator."""
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) > p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


def _eos_ids(model, tokenizer) -> set[int]:
    """EOS ids the way SGLang collects them: config, generation config and tokenizer."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


class _DevBackend:
    """The model behind the SGLang endpoints (see sglang_protocol.SGLangBackend)."""

    def __init__(
        self,
        engine: Engine,
        model,
        tokenizer,
        limits: sglang.ModelLimits,
        *,
        model_path: str,
        served_model_name: str,
        max_batch_size: int,
        speculative: Speculative | None = None,
        disconnect_poll_s: float = sglang.DISCONNECT_POLL_S,
    ):
        self.engine, self.model, self.tokenizer, self.limits = engine, model, tokenizer, limits
        self.model_path, self.served_model_name = model_path, served_model_name
        self.max_batch_size = max_batch_size
        self.speculative = speculative
        self.version = engine.version
        self.disconnect_poll_s = disconnect_poll_s
        self.held = sglang.HeldRids(self.version)  # event loop only

    def sequence(self, prompt: str | list[int], raw_params: Any, rid: str, arrived: float) -> EngineSequence:
        """Tokenize and check one prompt (SGLang's checks and words): a sequence for the engine."""
        if isinstance(prompt, str):
            with self.engine.tokenizer_lock:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)  # no chat template, no BOS
        else:
            ids = list(prompt)
        params = self.limits.admit(ids, raw_params, unimplemented_by="dev server")
        if self.speculative is not None and not params.greedy:
            raise sglang.BadRequest(
                f"This dev server decodes speculatively (draft {self.speculative.draft_model_path}) with greedy "
                f"sampling only; got temperature={params.temperature}, top_k={params.top_k}. Send temperature 0, "
                "or start the server without --speculative-draft-model-path."
            )
        loop = asyncio.get_running_loop()
        return EngineSequence(
            rid=rid,
            prompt_ids=ids,
            params=params,
            max_new_tokens=self.limits.max_new_tokens(len(ids), params),
            created=arrived,
            loop=loop,
            future=loop.create_future(),
        )

    async def generate(self, request: Request) -> Any:
        arrived = time.perf_counter()
        if not self.engine.alive:  # app used without its lifespan, or shutting down
            raise sglang.ServerError(503, "The dev server's engine is not running.")
        try:
            req = sglang.parse_generate(await request.body(), server="dev server", version=self.version)
            # tokenizer_manager.py generate_request: normalise, `_init_req_state` (duplicate rids), then
            # tokenize and validate each prompt; a failure frees the batch's rids again.
            self.held.claim(req.rids)
            try:
                seqs = [
                    self.sequence(p, sp, r, arrived) for p, sp, r in zip(req.prompts, req.sampling_params, req.rids)
                ]
            except BaseException:
                for rid in req.rids:
                    self.held.release(rid)
                raise
        except (sglang.BadRequest, sglang.ContractError) as exc:
            logger.info("[dev_server] bad request: %s", exc)
            raise
        for s in seqs:  # held until its final output is processed (`_handle_batch_output` deletes it)
            # The default re-binds the loop variable; mypy can't infer such a lambda (python/mypy#15459).
            s.future.add_done_callback(lambda _f, rid=s.rid: self.held.release(rid))  # type: ignore[misc]
        self.engine.submit(seqs)
        try:
            results = await sglang.results_or_abort(
                request,
                asyncio.gather(*(s.future for s in seqs)),
                # The poll noticed the client is gone: abort_request(rid) for each (prefix rule included).
                lambda: [self.abort(s.rid, False) for s in seqs],
                poll_s=self.disconnect_poll_s,
            )
        except Exception as exc:
            raise sglang.ServerError(500, f"Generation failed: {exc!r}") from exc
        return results[0] if req.single else results

    def abort(self, rid: str, abort_all: bool) -> int:
        match = sglang.abort_matcher(rid, abort_all, self.held)
        return 0 if match is None else self.engine.abort(match)

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def healthy(self) -> bool:
        return self.engine.alive

    async def health_generate(self) -> bool:
        if not self.engine.alive:
            return False
        probe = self.sequence(
            [0], {"max_new_tokens": 1, "temperature": 0}, sglang.health_check_rid(), time.perf_counter()
        )
        self.engine.submit([probe])
        try:
            await asyncio.wait_for(probe.future, timeout=_HEALTH_CHECK_TIMEOUT_S)
        except Exception:  # includes the timeout
            self.engine.abort(seqs=[probe])
            return False
        return True

    def server_info(self) -> dict[str, Any]:
        return sglang.server_info(
            model_path=self.model_path,
            served_model_name=self.served_model_name,
            limits=self.limits,
            max_running=self.max_batch_size,
            dtype="float32",
            device="cpu",
            skip_tokenizer_init=False,
            version=VERSION,
            speculative=self.speculative.server_args() if self.speculative else None,
            avg_spec_accept_length=self.engine.avg_spec_accept_length if self.speculative else None,
        )

    def loads(self) -> dict[str, Any]:
        return sglang.loads(
            running=len(self.engine._active),
            waiting=len(self.engine._waiting),
            max_running=self.max_batch_size,
            version=VERSION,
        )

    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        return sglang.model_info(
            model_path=self.model_path,
            model_type=getattr(config, "model_type", None),
            architectures=getattr(config, "architectures", None),
        )


def load_served_draft(draft_dir: str | Path, target, version: sglang.SGLangVersion = sglang.V05):
    """The exported draft in float32, checked against the target; SGLang's embedding rule (create_app).

    As SGLang `version` serves it: 0.4 reads no EAGLE-3.1 keys (`SGLangVersion.reads_eagle31_keys`), so
    its draft has no fc_norm and feeds each step the pre-norm state, whatever the export says. No version
    reads the speculators format (no `speculators_config` in sglang 0.5.23) or `norm_before_residual`
    (srt/models/llama_eagle3.py `LlamaDecoderLayer.forward` keeps the raw hidden state as the residual).
    """
    from models.eagle3_export import load_exported_draft, read_export_config

    if read_export_config(Path(draft_dir))[1]:
        raise ValueError(
            f"--speculative-draft-model-path {draft_dir}: a speculators-format draft, which SGLang does not read "
            "(eagle3 export CONFIG --draft DIR --format sglang writes one it reads)"
        )
    draft = load_exported_draft(draft_dir, dtype=torch.float32).eval()
    draft.midlayer.norm_before_residual = draft.config.norm_before_residual = False  # as SGLang serves it
    if not version.reads_eagle31_keys:
        draft.fc_norm = None
        draft.config.fc_norm = draft.config.norm_output = False
    cfg, tcfg = draft.config, target.config
    if cfg.vocab_size != tcfg.vocab_size or cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(
            f"draft {draft_dir} (vocab {cfg.vocab_size}, target hidden {cfg.target_hidden_size}) does not "
            f"fit the target (vocab {tcfg.vocab_size}, hidden {tcfg.hidden_size})"
        )
    if max(cfg.aux_layers) >= tcfg.num_hidden_layers:
        raise ValueError(
            f"draft {draft_dir}: aux layers {cfg.aux_layers} beyond the target's {tcfg.num_hidden_layers} layers"
        )
    if cfg.hidden_size == tcfg.hidden_size:  # SGLang's EAGLEWorker: set_embed(target embedding)
        draft.load_target_embedding(target.get_input_embeddings().weight.detach().float())
    return draft


def create_app(
    model_dir: str | Path,
    *,
    context_length: int | None = None,
    max_batch_size: int = 16,
    model_name: str | None = None,
    num_threads: int | None = None,
    speculative: Speculative | None = None,
    extraction: vllm_extract.Extraction | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    disconnect_poll_s: float = sglang.DISCONNECT_POLL_S,
    sglang_version: str = "0.5",
    decode_log_interval: int = sglang.DECODE_LOG_INTERVAL,
) -> FastAPI:
    """Load the tokenizer and model (float32, eval) and build the FastAPI app.

    `speculative`: serve with that EAGLE-3 draft (module docstring), loaded in float32 as the
    eval loads it (`load_exported_draft`); like SGLang, a draft whose hidden size is the target's
    takes the target's input embedding.

    `api_key` / `admin_api_key`: SGLang's ``--api-key`` / ``--admin-api-key`` (sglang_protocol.Auth).
    `disconnect_poll_s`: how often a disconnected client is looked for (SGLang's
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s; <= 0: at once). `sglang_version`: "0.5" (SGLang 0.5.23)
    or "0.4" (0.4.x where they differ, sglang_protocol.SGLangVersion). `decode_log_interval`: decode
    batches per fold of avg_spec_accept_length (SGLang's ``--decode-log-interval``, 40).

    `extraction`: also serve vLLM's hidden-state extraction (emulators/vllm_extract.py).

    `num_threads` sets torch's process-wide intra-op threads; None leaves them as they are
    (`serve` picks a value for a dedicated process).
    """
    from transformers import AutoTokenizer

    version = sglang.SGLangVersion.of(sglang_version)
    auth = sglang.Auth(api_key=api_key, admin_api_key=admin_api_key, version=version)  # checked before any loading
    model_dir = Path(model_dir)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = load_language_model(str(model_dir), dtype=torch.float32).eval()  # a kimi_k25 wrapper's text model too
    max_positions = int(model.config.max_position_embeddings)
    context_len = int(context_length or max_positions)
    if not 8 <= context_len <= max_positions:
        raise ValueError(f"context_length must be in [8, {max_positions}] for {model_dir}, got {context_len}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    # No KV pool limit here: SGLang's scheduler limits follow from the context alone.
    limits = sglang.ModelLimits(
        vocab_size=int(model.config.vocab_size),
        context_length=context_len,
        reserved_tokens=speculative.reserved_tokens if speculative else 0,
        sglang_version=version,
    )
    draft = None
    if speculative is not None:
        draft = load_served_draft(speculative.draft_model_path, model, version)
    engine = Engine(
        model,
        tokenizer,
        eos_ids=_eos_ids(model, tokenizer),
        max_batch_size=max_batch_size,
        draft=draft,
        num_steps=speculative.num_steps if speculative else None,
        sglang_version=version,
        decode_log_interval=decode_log_interval,
    )
    backend = _DevBackend(
        engine,
        model,
        tokenizer,
        limits,
        model_path=str(model_dir),
        served_model_name=model_name or str(model_dir),
        max_batch_size=max_batch_size,
        speculative=speculative,
        disconnect_poll_s=disconnect_poll_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = sglang.create_sglang_app(
        backend,
        title="eagle3 SGLang-compatible dev server",
        version=VERSION,
        sglang_version=version,
        auth=auth,
        lifespan=lifespan,
    )
    app.state.engine = engine
    if extraction is not None:
        app.include_router(
            vllm_extract.router(
                vllm_extract.Extractor(
                    model,
                    tokenizer,
                    extraction,
                    context_length=context_len,
                    served_model_name=model_name or str(model_dir),
                )
            )
        )
    return app


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    log_level: str = "info",
    num_threads: int | None = None,
    **kw,
) -> None:
    """Run the dev server with uvicorn until interrupted (blocking)."""
    import uvicorn

    if num_threads is None:
        # A dedicated process: leave one core to the HTTP event loop; small models gain
        # little from more than a few intra-op threads.
        num_threads = max(1, min(4, (os.cpu_count() or 2) - 1))
    app = create_app(model_dir, num_threads=num_threads, **kw)
    uvicorn.run(app, host=host, port=port, log_level=log_level)


def main(argv: list[str] | None = None, prog: str = "python -m emulators.dev_server") -> None:
    """CLI: ``python -m emulators.dev_server --model DIR [--host] [--port] ...`` (also `eagle3 serve-dev`)."""
    ap = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory (weights + tokenizer; `eagle3 tiny-target`)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings")
    ap.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--model-name", default=None, help="served model name (default: the model path)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--log-level", default="info")
    ap.add_argument("--speculative-algorithm", default=None, help="EAGLE3 (the only one; implied by a draft path)")
    ap.add_argument("--speculative-draft-model-path", default=None, help="an EAGLE-3 export (models/eagle3_export.py)")
    ap.add_argument("--speculative-num-steps", type=int, default=None, help="draft tokens proposed per round")
    ap.add_argument("--speculative-eagle-topk", type=int, default=None, help="must be 1 (chain)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="must be num-steps + 1")
    ap.add_argument(
        "--decode-log-interval",
        type=int,
        default=sglang.DECODE_LOG_INTERVAL,
        help="decode batches between folds of avg_spec_accept_length (SGLang's flag)",
    )
    ap.add_argument(
        "--speculative-config",
        "--speculative_config",
        default=None,
        help="vLLM's flag: JSON with method extract_hidden_states and the layer ids (emulators/vllm_extract.py)",
    )
    ap.add_argument(
        "--kv-transfer-config",
        "--kv_transfer_config",
        default=None,
        help="vLLM's flag: JSON with kv_connector ExampleHiddenStatesConnector and its shared_storage_path",
    )
    ap.add_argument(
        "--no-enable-chunked-prefill", action="store_true", help="accepted for vLLM's command line (no chunking here)"
    )
    sglang.add_server_flags(ap)
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"{args.model} has no config.json; build one with `eagle3 tiny-target {args.model}`")
    try:
        extraction = vllm_extract.Extraction.from_flags(args.speculative_config, args.kv_transfer_config)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        speculative = Speculative.from_flags(**flag_values(args, Speculative.from_flags, prefix="speculative_"))
    except ValueError as exc:
        ap.error(str(exc))
    if args.admin_api_key and args.sglang_version == "0.4":
        ap.error("--admin-api-key does not exist in SGLang 0.4.x (only --api-key)")
    logging.basicConfig(level=args.log_level.upper())
    serve(**flag_values(args, serve, create_app, model_dir=args.model, speculative=speculative, extraction=extraction))


if __name__ == "__main__":
    main()
