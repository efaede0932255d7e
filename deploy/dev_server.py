"""SGLang-compatible dev server: SGLang's native HTTP protocol over a small HF causal LM on CPU.

Used by the embedded demo and the tests in place of a real SGLang server. It speaks the subset of
SGLang's native API the pipeline uses, with SGLang's request/response shapes:

- ``POST /generate`` -- ``text`` or ``input_ids`` (single or batch), ``sampling_params``
  (``max_new_tokens`` default 128, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1 = off),
  ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``, ``sampling_seed``),
  ``rid``. No chat template, no special tokens added to ``text``. ``stream=true`` is refused (400):
  streaming is not implemented. Response ``{"text", "output_ids", "meta_info": {"id",
  "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "reasoning_tokens",
  "e2e_latency"}}``; a batch returns a list in input order. ``output_ids`` keep a matched stop
  token; ``text`` drops it unless ``no_stop_trim`` (SGLang's ``DetokenizerManager.trim_matched_stop``).
- ``POST /abort_request`` ``{"rid": ...}`` or ``{"abort_all": true}`` -- in-flight requests finish
  with ``{"type": "abort", ...}`` and the tokens generated so far (HTTP 200, as in SGLang).
- ``GET /health``, ``GET /health_generate`` (1-token probe through the batcher),
  ``GET /server_info`` and ``GET /model_info`` (also under SGLang's older ``/get_*`` names).

Error bodies -- checked against SGLang's source (sgl-project/sglang, 2025-2026):

- Bad input that SGLang rejects with a ``ValueError`` (``GenerateReqInput`` normalisation,
  ``TokenizerManager._validate_one_request`` / ``_validate_input_ids_in_vocab``,
  ``SamplingParams.verify``, the scheduler's ``validate_input_length``): HTTP 400 with
  ``{"error": {"message": "..."}}`` -- SGLang's ``create_error_response``
  (``srt/server/utils.py``, earlier ``_create_error_response`` in ``entrypoints/http_server.py``).
  Length messages are SGLang's words, e.g. ``"The input (N tokens) is longer than the model's
  context length (M tokens)."``; ``prompt_tokens + max_new_tokens > context_length`` is an error
  too (``validate_total_tokens`` is on and ``--allow-auto-truncate`` off by default), and a
  prompt of ``max_req_input_len`` tokens or more is refused as SGLang's scheduler does.
- Malformed JSON or a field of the wrong JSON type (FastAPI's ``RequestValidationError`` in
  SGLang): HTTP 400 with ``{"object": "error", "message": "...", "type": "Bad Request",
  "param": null, "code": 400}`` -- SGLang's ``validation_exception_handler``.
- A failure inside the model: HTTP 500 ``{"object": "error", "message": ..., "type": "500",
  "param": null, "code": 500}`` (SGLang's ``HTTPException`` handler shape).

Deliberate differences: SGLang accepts ``text`` and ``input_ids`` together (text wins); this server
refuses both. ``cached_tokens`` is always 0 (no prefix cache). ``max_new_tokens: 0`` returns at
once with no tokens and finish ``length`` 0, without running the model.

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
import json
import logging
import math
import os
import secrets
import threading
import time
import uuid
from collections import deque
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

logger = logging.getLogger("eagle3.dev_server")

VERSION = "0.1.0-eagle3-dev"
_SAMPLING_EPS = 1e-6  # SGLang treats 0 <= temperature < 1e-6 as greedy
_HEALTH_CHECK_TIMEOUT_S = 20.0
_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "sampling_seed",
}
# SGLang sampling params this server does not implement, with the values that make them no-ops.
_NOOP_SAMPLING = {
    "stop": ([], ""), "stop_regex": ([], ""), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "n": (1,),
    "spaces_between_special_tokens": (True,), "logit_bias": ({},), "custom_params": ({},),
    "stream_interval": (), "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (),
}


class _BadRequest(ValueError):
    """Bad input SGLang reports as a ValueError: 400 ``{"error": {"message": ...}}``."""


class _Malformed(ValueError):
    """Input SGLang's FastAPI layer rejects (bad JSON, wrong types): 400 OpenAI-style body."""


def _error(message: str) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=400)


def _openai_error(message: str, status: int) -> JSONResponse:
    kind = "Bad Request" if status == 400 else str(status)
    body = {"object": "error", "message": message, "type": kind, "param": None, "code": status}
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------------------------
# Request parsing (runs on the event loop; cheap)
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated with SGLang's rules and messages."""

    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < _SAMPLING_EPS or self.top_k == 1

    @classmethod
    def parse(cls, raw: Any) -> "SamplingParams":
        if raw is None:
            return cls()
        if not isinstance(raw, dict):
            raise _Malformed(f"sampling_params must be an object, got {type(raw).__name__}")
        # Other SGLang params (stop strings, penalties, grammars, ...) are not implemented here:
        # accepted only with their no-op values, since ignoring them would silently change outputs.
        unsupported = sorted(
            k for k, v in raw.items()
            if k not in _SAMPLING_KEYS and v is not None and not (k in _NOOP_SAMPLING and v in _NOOP_SAMPLING[k])
        )
        if unsupported:
            raise _BadRequest(f"sampling_params not supported by the dev server: {unsupported}")

        def num(key, kind, default):
            v = raw.get(key)
            if v is None:  # SGLang treats null as "use the default"
                return default
            ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
            if isinstance(v, bool) or not ok:
                raise _Malformed(f"sampling_params.{key} must be a number, got {v!r}")
            return kind(v)

        def flag(key, default):
            v = raw.get(key)
            if v is None:
                return default
            if not isinstance(v, bool):
                raise _Malformed(f"sampling_params.{key} must be a boolean, got {v!r}")
            return v

        stop = raw.get("stop_token_ids") or []
        if not isinstance(stop, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop):
            raise _Malformed(f"sampling_params.stop_token_ids must be a list of ints, got {stop!r}")
        p = cls(
            max_new_tokens=num("max_new_tokens", int, None) if "max_new_tokens" in raw else 128,
            temperature=num("temperature", float, 1.0),
            top_p=num("top_p", float, 1.0),
            top_k=num("top_k", int, -1),
            stop_token_ids=frozenset(stop),
            ignore_eos=flag("ignore_eos", False),
            skip_special_tokens=flag("skip_special_tokens", True),
            no_stop_trim=flag("no_stop_trim", False),
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


def _is_int_list(x: Any) -> bool:
    return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)


def _split_batch(body: dict) -> tuple[bool, list[str | list[int]], list[Any], list[str]]:
    """Normalise a /generate body into per-item prompts, sampling params and rids."""
    text, input_ids = body.get("text"), body.get("input_ids")
    if (text is None) == (input_ids is None):
        raise _BadRequest("Either text, input_ids or input_embeds should be provided.")
    if text is not None:
        if isinstance(text, str):
            single, prompts = True, [text]
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            single, prompts = False, list(text)
        else:
            raise _Malformed("text must be a string or a list of strings")
    else:
        if _is_int_list(input_ids) and input_ids:
            single, prompts = True, [input_ids]
        elif isinstance(input_ids, list) and input_ids and all(_is_int_list(s) for s in input_ids):
            single, prompts = False, list(input_ids)
        elif input_ids == []:
            raise _BadRequest("input_ids cannot be empty.")
        else:
            raise _Malformed("input_ids must be a list of ints or a list of lists of ints")
    n = len(prompts)
    if n == 0:
        raise _BadRequest("The batch is empty.")

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
    return single, prompts, params, rids


# ---------------------------------------------------------------------------------------------
# The engine: one worker thread owns the model
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(eq=False)
class _Sequence:
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

    @property
    def kv_len(self) -> int:
        return self.kv[0][0].shape[2]


def _kv_from_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def _cache_from_kv(kv: list[tuple[torch.Tensor, torch.Tensor]]):
    from transformers import DynamicCache

    if "ddp_cache_data" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(ddp_cache_data=kv)
    return DynamicCache.from_legacy_cache(tuple(kv))


class _Engine:
    """Continuous batching over per-sequence KV caches, run by one background thread."""

    def __init__(self, model, tokenizer, *, eos_ids: set[int], max_batch_size: int):
        self.model, self.tokenizer = model, tokenizer
        self.eos_ids = frozenset(eos_ids)
        # Encoding runs on the event loop, decoding here: don't let them share the Rust tokenizer at once.
        self.tokenizer_lock = threading.Lock()
        self.max_batch_size = max_batch_size
        # transformers 5 renamed the forward argument and output field `past_key_values` -> `cache`.
        self._cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._waiting: deque[_Sequence] = deque()
        self._admitted: list[_Sequence] = []  # taken from the queue, prefill pending
        self._active: list[_Sequence] = []
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

    def submit(self, seqs: list[_Sequence]) -> None:
        with self._cond:
            self._waiting.extend(seqs)
            self._cond.notify()

    def abort(self, rid: str | None = None, *, abort_all: bool = False, seqs=()) -> int:
        """Flag matching waiting/active sequences; the worker finishes them before its next step."""
        wanted = set(seqs)
        n = 0
        with self._cond:
            for s in (*self._waiting, *self._admitted, *self._active):
                if abort_all or s.rid == rid or s in wanted:
                    s.abort_requested, n = True, n + 1
            self._cond.notify()
        return n

    # -- the worker thread -----------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and not self._waiting and not self._active:
                    self._cond.wait()
                if self._stopping:
                    break
                # Admit between steps, FIFO, up to the batch limit. They stay visible to abort()
                # in `_admitted` until their prefill has put them in `_active`.
                while self._waiting and len(self._active) + len(self._admitted) < self.max_batch_size:
                    self._admitted.append(self._waiting.popleft())
                admitted = list(self._admitted)
                aborted = [s for s in self._waiting if s.abort_requested]
                for s in aborted:
                    self._waiting.remove(s)
            for s in aborted:
                self._finish(s, {"type": "abort", "message": "Abort in waiting queue", "status_code": None})
            try:
                with torch.inference_mode():
                    for s in admitted:
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
            self._finish(s, {"type": "abort", "message": "Server shutting down", "status_code": 503})

    def _prefill(self, s: _Sequence) -> None:
        """Run one admitted sequence's prompt and sample its first token; it then joins `_active`."""
        reason, logits = None, None
        if s.abort_requested:
            reason = {"type": "abort", "message": "Abort before prefill", "status_code": None}
        elif s.max_new_tokens <= 0:
            reason = {"type": "length", "length": 0}
        else:
            # Alone, unpadded: a prompt's prefill is exactly what it would be without batching.
            out = self.model(input_ids=torch.tensor([s.prompt_ids], dtype=torch.long), use_cache=True,
                             logits_to_keep=1)
            s.kv, logits = _kv_from_cache(out[self._cache_arg]), out.logits[0, -1]
            seed = s.params.sampling_seed if s.params.sampling_seed is not None else secrets.randbits(63)
            s.generator = torch.Generator().manual_seed(seed)
        with self._cond:
            self._admitted.remove(s)
            if reason is None:
                self._active.append(s)
        if reason is not None:
            self._finish(s, reason)
        else:
            self._append(s, logits)

    def _step(self) -> None:
        """One decode step: every active sequence feeds its last token through one forward."""
        with self._cond:
            aborted = [s for s in self._active if s.abort_requested]
            self._active = batch = [s for s in self._active if not s.abort_requested]
        for s in aborted:
            self._finish(s, {"type": "abort", "message": "Abort by /abort_request", "status_code": None})
        batch = list(batch)
        if not batch:
            return
        lens = [s.kv_len for s in batch]
        width = max(lens)
        # Left-pad each cache to the longest one. Padded slots are masked out; positions are
        # passed explicitly so RoPE sees each sequence's own offset, not the padded one.
        kv = [
            tuple(torch.cat([F.pad(s.kv[layer][i], (0, 0, width - n, 0)) for s, n in zip(batch, lens)])
                  for i in (0, 1))
            for layer in range(len(batch[0].kv))
        ]
        mask = torch.zeros(len(batch), width + 1, dtype=torch.long)
        for row, n in enumerate(lens):
            mask[row, width - n:] = 1
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
            s.kv = [(k[row:row + 1, :, width - n:], v[row:row + 1, :, width - n:]) for k, v in new_kv]
            self._append(s, out.logits[row, -1])

    def _append(self, s: _Sequence, logits: torch.Tensor) -> None:
        """Sample one token for `s`, then apply SGLang's finish checks in SGLang's order."""
        token = _sample(logits.float(), s.params, s.generator)
        s.output_ids.append(token)
        p = s.params
        if len(s.output_ids) >= s.max_new_tokens:
            reason = {"type": "length", "length": s.max_new_tokens}
        elif not p.ignore_eos and (token in p.stop_token_ids or token in self.eos_ids):
            reason = {"type": "stop", "matched": token}  # ignore_eos also disables stop_token_ids, as in SGLang
        else:
            return
        with self._cond:
            if s in self._active:
                self._active.remove(s)
        self._finish(s, reason)

    def _finish(self, s: _Sequence, reason: dict) -> None:
        s.finish_reason = reason
        s.kv = None
        ids = s.output_ids
        if reason["type"] == "stop" and not s.params.no_stop_trim:
            ids = ids[:-1]  # text without the matched stop token; output_ids keep it
        with self.tokenizer_lock:
            text = self.tokenizer.decode(ids, skip_special_tokens=s.params.skip_special_tokens) if ids else ""
        result = {
            "text": text,
            "output_ids": list(s.output_ids),
            "meta_info": {
                "id": s.rid,
                "finish_reason": reason,
                "prompt_tokens": len(s.prompt_ids),
                "completion_tokens": len(s.output_ids),
                "cached_tokens": 0,
                "reasoning_tokens": 0,
                "e2e_latency": time.perf_counter() - s.created,
            },
        }
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


def create_app(
    model_dir: str | Path,
    *,
    context_length: int | None = None,
    max_batch_size: int = 16,
    model_name: str | None = None,
    num_threads: int | None = None,
) -> FastAPI:
    """Load the tokenizer and model (float32, eval) and build the FastAPI app.

    `num_threads` sets torch's process-wide intra-op threads; None leaves them as they are
    (`serve` picks a value for a dedicated process).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(model_dir)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(torch.float32).eval()
    max_positions = int(model.config.max_position_embeddings)
    context_len = int(context_length or max_positions)
    if not 8 <= context_len <= max_positions:
        raise ValueError(f"context_length must be in [8, {max_positions}] for {model_dir}, got {context_len}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    vocab_size = int(model.config.vocab_size)
    # SGLang's scheduler limits (no KV pool limit here): max_req_len = context - 1, the
    # scheduler refuses prompts of max_req_len - 5 tokens or more and clamps max_new_tokens.
    max_req_len = context_len - 1
    max_req_input_len = max_req_len - 5
    engine = _Engine(model, tokenizer, eos_ids=_eos_ids(model, tokenizer), max_batch_size=max_batch_size)
    info = {
        "model_path": str(model_dir),
        "tokenizer_path": str(model_dir),
        "served_model_name": model_name or str(model_dir),
        "context_length": context_len,
        "max_running_requests": max_batch_size,
        "max_total_num_tokens": max_batch_size * context_len,
        "max_req_input_len": max_req_input_len,
        "max_req_len": max_req_len,
        "vocab_size": vocab_size,
        "dtype": "float32",
        "device": "cpu",
        "skip_tokenizer_init": False,
        "allow_auto_truncate": False,
        "version": VERSION,
    }

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine.stop)

    app = FastAPI(title="eagle3 SGLang-compatible dev server", version=VERSION, lifespan=lifespan)
    app.state.engine, app.state.info = engine, info

    def to_sequence(prompt, raw_params, rid, loop, arrived) -> _Sequence:
        if isinstance(prompt, str):
            with engine.tokenizer_lock:
                ids = tokenizer.encode(prompt, add_special_tokens=False)  # no chat template, no BOS
        else:
            ids = list(prompt)
        if not ids:
            raise _BadRequest("input_ids cannot be empty.")
        if any(t >= vocab_size for t in ids):
            raise _BadRequest(f"The input_ids {ids} contains values greater than the vocab size ({vocab_size}).")
        if any(t < 0 for t in ids):
            raise _BadRequest(f"The input_ids {ids} contains negative values.")
        params = SamplingParams.parse(raw_params)
        # TokenizerManager._validate_one_request, then the scheduler's validate_input_length.
        n = len(ids)
        if n >= context_len:
            raise _BadRequest(
                f"The input ({n} tokens) is longer than the model's context length ({context_len} tokens)."
            )
        if params.max_new_tokens is not None and n + params.max_new_tokens > context_len:
            raise _BadRequest(
                f"Requested token count exceeds the model's maximum context length of {context_len} tokens. "
                f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input "
                f"messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        if n >= max_req_input_len:
            raise _BadRequest(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({max_req_input_len} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )
        budget = max_req_len - n - 1  # the scheduler's clamp of max_new_tokens
        limit = budget if params.max_new_tokens is None else min(params.max_new_tokens, budget)
        return _Sequence(rid=rid, prompt_ids=ids, params=params, max_new_tokens=limit, created=arrived,
                         loop=loop, future=loop.create_future())

    async def run(seqs: list[_Sequence], request: Request | None) -> list[dict]:
        engine.submit(seqs)
        futures = [s.future for s in seqs]
        try:
            while True:
                _, pending = await asyncio.wait(futures, timeout=1.0)
                if not pending:
                    break
                # SGLang aborts requests whose client went away; so do we, to free the batch.
                if request is not None and await request.is_disconnected():
                    engine.abort(seqs=seqs)
        except asyncio.CancelledError:
            engine.abort(seqs=seqs)
            raise
        return [f.result() for f in futures]

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        arrived = time.perf_counter()
        if not engine.alive:  # app used without its lifespan, or shutting down
            return _openai_error("The dev server's engine is not running.", 503)
        try:
            try:
                body = json.loads(await request.body())
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise _Malformed(f"JSON decode error: {exc}") from exc
            if not isinstance(body, dict):
                raise _Malformed("The request body must be a JSON object.")
            if body.get("stream"):
                raise _BadRequest("stream=True is not supported by the eagle3 dev server; use stream=false.")
            single, prompts, params, rids = _split_batch(body)
            loop = asyncio.get_running_loop()
            seqs = [to_sequence(p, sp, r, loop, arrived) for p, sp, r in zip(prompts, params, rids)]
        except _Malformed as exc:
            return _openai_error(str(exc), 400)
        except _BadRequest as exc:
            logger.info("[dev_server] bad request: %s", exc)
            return _error(str(exc))
        try:
            results = await run(seqs, request)
        except Exception as exc:
            return _openai_error(f"Generation failed: {exc!r}", 500)
        return JSONResponse(results[0] if single else results)

    @app.post("/abort_request")
    async def abort_request(request: Request):
        try:
            body = json.loads(await request.body() or b"{}")
        except json.JSONDecodeError as exc:
            return _openai_error(f"JSON decode error: {exc}", 400)
        if not isinstance(body, dict):
            return _openai_error("The request body must be a JSON object.", 400)
        engine.abort(body.get("rid"), abort_all=bool(body.get("abort_all")))
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/health_generate")
    async def health_generate():
        if not engine.alive:
            return Response(status_code=503)
        loop = asyncio.get_running_loop()
        probe = to_sequence([0], {"max_new_tokens": 1, "temperature": 0}, f"HEALTH_CHECK_{time.time()}",
                            loop, time.perf_counter())
        try:
            await asyncio.wait_for(run([probe], None), timeout=_HEALTH_CHECK_TIMEOUT_S)
        except Exception:  # includes the timeout
            engine.abort(seqs=[probe])
            return Response(status_code=503)
        return Response(status_code=200)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def server_info():
        return {**info, "internal_states": [{"num_running_reqs": len(engine._active),
                                             "num_waiting_reqs": len(engine._waiting)}]}

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def model_info():
        return {
            "model_path": info["model_path"],
            "tokenizer_path": info["tokenizer_path"],
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(model.config, "model_type", None),
            "architectures": getattr(model.config, "architectures", None),
        }

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return Response("Cache flushed.\n", status_code=200)  # nothing cached between requests

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


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m deploy.dev_server --model DIR [--host] [--port] ...``."""
    ap = argparse.ArgumentParser(prog="python -m deploy.dev_server", description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="HF model directory (weights + tokenizer)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings")
    ap.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--model-name", default=None, help="served model name (default: the model path)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper())
    serve(args.model, args.host, args.port, log_level=args.log_level, num_threads=args.num_threads,
          context_length=args.context_length, max_batch_size=args.max_batch_size, model_name=args.model_name)


if __name__ == "__main__":
    main()
