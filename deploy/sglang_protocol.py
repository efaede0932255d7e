"""SGLang's native HTTP protocol, as the dev server and the simulated server speak it.

One definition of the subset of SGLang's API the pipeline uses, for ``deploy/dev_server.py`` (a
real model) and ``deploy/sim_server.py`` (a simulation); each server supplies only what differs
through `SGLangBackend`, and `create_sglang_app` gives both the same endpoints:

- ``POST /generate`` -- ``text`` or ``input_ids`` (single or batch), ``sampling_params``
  (``max_new_tokens`` default 128, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1 = off),
  ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``, ``sampling_seed``;
  one object for the batch or a list, one per item), ``rid`` (a string, or a list for a batch).
  ``stream=true`` is refused (400): streaming is not implemented. Response ``{"text",
  "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens", "completion_tokens",
  "cached_tokens", "reasoning_tokens", "e2e_latency"}}`` (plus ``spec_verify_ct``, the verify rounds,
  from a server decoding with a draft); a batch returns a list in input order.
  ``finish_reason`` is ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or
  ``{"type": "abort", "message": ..., "status_code": ...}``. ``output_ids`` keep a matched stop
  token; ``text`` drops it unless ``no_stop_trim`` (SGLang's ``DetokenizerManager.trim_matched_stop``).
- ``POST /abort_request`` ``{"rid": ...}`` or ``{"abort_all": true}`` -- in-flight requests finish
  with ``{"type": "abort", ...}`` and the tokens generated so far (HTTP 200, as in SGLang).
- ``GET /health``, ``GET /health_generate``, ``GET /server_info`` and ``GET /model_info`` (also
  under SGLang's older ``/get_*`` names), ``/flush_cache``.

Error bodies -- checked against SGLang's source (sgl-project/sglang, 2025-2026):

- Bad input that SGLang rejects with a ``ValueError`` (``GenerateReqInput`` normalisation,
  ``TokenizerManager._validate_one_request`` / ``_validate_input_ids_in_vocab``,
  ``SamplingParams.verify``, the scheduler's ``validate_input_length``): HTTP 400 with
  ``{"error": {"message": "..."}}`` -- SGLang's ``create_error_response``
  (``srt/server/utils.py``, earlier ``_create_error_response`` in ``entrypoints/http_server.py``).
  Raise `BadRequest`. Length messages are SGLang's words, e.g. ``"The input (N tokens) is longer
  than the model's context length (M tokens)."``; ``prompt_tokens + max_new_tokens >
  context_length`` is an error too (``validate_total_tokens`` is on and ``--allow-auto-truncate``
  off by default), and a prompt of ``max_req_input_len`` tokens or more is refused as SGLang's
  scheduler does.
- Malformed JSON or a field of the wrong JSON type (FastAPI's ``RequestValidationError`` in
  SGLang): HTTP 400 with ``{"object": "error", "message": "...", "type": "Bad Request",
  "param": null, "code": 400}`` -- SGLang's ``validation_exception_handler``. Raise `MalformedRequest`.
- Other statuses (a failure inside the model: 500, not serving: 503): ``{"object": "error",
  "message": ..., "type": "<status>", "param": null, "code": <status>}`` (SGLang's
  ``HTTPException`` handler shape). Raise `ServerError`.

Deliberate difference: SGLang accepts ``text`` and ``input_ids`` together (text wins); these servers
refuse both.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import uuid
from typing import Any, AsyncContextManager, Awaitable, Callable, Protocol, Sequence, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

T = TypeVar("T")

SAMPLING_EPS = 1e-6  # SGLang treats 0 <= temperature < 1e-6 as greedy
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request gives none

# The sampling params both servers implement.
_SAMPLING_KEYS = {
    "max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos",
    "skip_special_tokens", "no_stop_trim", "sampling_seed",
}
# SGLang sampling params not implemented here, with the values that make them no-ops.
_NOOP_SAMPLING = {
    "stop": ([], ""), "stop_regex": ([], ""), "min_p": (0, 0.0), "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0), "repetition_penalty": (1, 1.0), "min_new_tokens": (0,), "n": (1,),
    "spaces_between_special_tokens": (True,), "logit_bias": ({},), "custom_params": ({},),
    "stream_interval": (), "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (),
}


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class BadRequest(ValueError):
    """Bad input SGLang reports as a ValueError: 400 ``{"error": {"message": ...}}``."""


class MalformedRequest(ValueError):
    """Input SGLang's FastAPI layer rejects (bad JSON, wrong types): 400 OpenAI-style body."""


class ServerError(Exception):
    """A request the server cannot serve now (503) or that failed inside it (500)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def value_error_body(message: str) -> dict[str, Any]:
    """SGLang's body for a ValueError: ``{"error": {"message": ...}}``."""
    return {"error": {"message": message}}


def http_error_body(message: str, status: int) -> dict[str, Any]:
    """SGLang's OpenAI-style body for validation errors (400) and HTTP exceptions (others)."""
    kind = "Bad Request" if status == 400 else str(status)
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def error_response(status: int, message: str) -> JSONResponse:
    """An error answer as SGLang words it for `status`: 400 is a ValueError, the rest HTTP errors."""
    body = value_error_body(message) if status == 400 else http_error_body(message, status)
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------------------------
# Sampling parameters and per-prompt checks
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated with SGLang's rules and messages."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None = up to the context
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()  # in request order: the first is the simulation's stop token
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS or self.top_k == 1


def parse_sampling_params(raw: Any, *, unimplemented_by: str | None = None) -> SamplingParams:
    """Parse a request's ``sampling_params`` with SGLang's type rules and range checks.

    `raw` is the JSON value (None: the defaults; a `SamplingParams` passes through). SGLang params
    outside `SamplingParams` (stop strings, penalties, grammars, ...) are ignored, unless
    `unimplemented_by` names the server: then they are refused (400) except with their no-op
    values, since for a real model ignoring them would silently change the outputs.
    """
    if raw is None:
        return SamplingParams()
    if isinstance(raw, SamplingParams):
        return raw
    if not isinstance(raw, dict):
        raise MalformedRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    if unimplemented_by is not None:
        unsupported = sorted(
            k for k, v in raw.items()
            if k not in _SAMPLING_KEYS and v is not None and not (k in _NOOP_SAMPLING and v in _NOOP_SAMPLING[k])
        )
        if unsupported:
            raise BadRequest(f"sampling_params not supported by the {unimplemented_by}: {unsupported}")

    def num(key, kind, default):
        v = raw.get(key)
        if v is None:  # SGLang treats null as "use the default"
            return default
        ok = isinstance(v, int) if kind is int else isinstance(v, (int, float))
        if isinstance(v, bool) or not ok:
            raise MalformedRequest(f"sampling_params.{key} must be a number, got {v!r}")
        return kind(v)

    def flag(key, default):
        v = raw.get(key)
        if v is None:
            return default
        if not isinstance(v, bool):
            raise MalformedRequest(f"sampling_params.{key} must be a boolean, got {v!r}")
        return v

    stop = raw.get("stop_token_ids") or []
    if not isinstance(stop, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in stop):
        raise MalformedRequest(f"sampling_params.stop_token_ids must be a list of ints, got {stop!r}")
    d = SamplingParams()
    p = SamplingParams(
        # An explicit null means "up to the context", unlike a missing key.
        max_new_tokens=num("max_new_tokens", int, None) if "max_new_tokens" in raw else d.max_new_tokens,
        temperature=num("temperature", float, d.temperature),
        top_p=num("top_p", float, d.top_p),
        top_k=num("top_k", int, d.top_k),
        stop_token_ids=tuple(stop),
        ignore_eos=flag("ignore_eos", d.ignore_eos),
        skip_special_tokens=flag("skip_special_tokens", d.skip_special_tokens),
        no_stop_trim=flag("no_stop_trim", d.no_stop_trim),
        sampling_seed=num("sampling_seed", int, d.sampling_seed),
    )
    # Same checks and wording as SGLang's SamplingParams.verify.
    if not math.isfinite(p.temperature) or p.temperature < 0.0:
        raise BadRequest(f"temperature must be a non-negative finite number, got {p.temperature}.")
    if not 0.0 < p.top_p <= 1.0:
        raise BadRequest(f"top_p must be in (0, 1], got {p.top_p}.")
    if p.top_k < 1 and p.top_k != -1:
        raise BadRequest(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
    if p.max_new_tokens is not None and p.max_new_tokens < 0:
        raise BadRequest(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    return p


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """The model's vocabulary and context, and SGLang's scheduler limits derived from them."""

    vocab_size: int
    context_length: int

    @property
    def max_req_len(self) -> int:
        """SGLang's scheduler: a request (prompt + output) holds at most context - 1 tokens."""
        return self.context_length - 1

    @property
    def max_req_input_len(self) -> int:
        """SGLang's scheduler refuses prompts of max_req_len - 5 tokens or more."""
        return self.max_req_len - 5

    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The scheduler's clamp of max_new_tokens to what the context leaves."""
        budget = max(0, self.max_req_len - prompt_len - 1)
        return budget if params.max_new_tokens is None else min(params.max_new_tokens, budget)

    def check_ids(self, ids: Sequence[int]) -> None:
        """SGLang's checks of the prompt ids themselves (empty, out of the vocabulary)."""
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        if max(ids) >= self.vocab_size:
            raise BadRequest(f"The input_ids {list(ids)} contains values greater than the vocab size "
                             f"({self.vocab_size}).")
        if min(ids) < 0:
            raise BadRequest(f"The input_ids {list(ids)} contains negative values.")

    def check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        """TokenizerManager._validate_one_request, then the scheduler's validate_input_length."""
        n, ctx = prompt_len, self.context_length
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if params.max_new_tokens is not None and n + params.max_new_tokens > ctx:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                f"You requested a total of {n + params.max_new_tokens} tokens: {n} tokens from the input "
                f"messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
                "of tokens in the input messages or the completion to fit within the limit."
            )
        if n >= self.max_req_input_len:
            raise BadRequest(
                f"Input length ({n} tokens) exceeds the maximum allowed length ({self.max_req_input_len} tokens). "
                "Use a shorter input or enable --allow-auto-truncate."
            )

    def admit(self, ids: Sequence[int], raw_params: Any, *, unimplemented_by: str | None = None) -> SamplingParams:
        """All of SGLang's checks of one prompt, in SGLang's order; returns its sampling params."""
        self.check_ids(ids)
        params = parse_sampling_params(raw_params, unimplemented_by=unimplemented_by)
        self.check_lengths(len(ids), params)
        return params


# ---------------------------------------------------------------------------------------------
# Request bodies
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenerateRequest:
    """A /generate body split into items: prompt i is sent with sampling_params[i] as rids[i]."""

    single: bool  # a single request is answered with an object, a batch with a list
    prompts: list[str | list[int]]  # text, or token ids (ints, checked)
    sampling_params: list[Any]  # raw JSON per item: each server parses it in its checks' order
    rids: list[str]


def parse_json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object (MalformedRequest otherwise)."""
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise MalformedRequest(f"JSON decode error: {exc}") from exc
    if not isinstance(body, dict):
        raise MalformedRequest("The request body must be a JSON object.")
    return body


def _is_id_list(x: Any) -> bool:
    # type(), not isinstance: a JSON true is not a token id. map/set keep long prompts cheap.
    return type(x) is list and set(map(type, x)) <= {int}


def parse_generate(raw: bytes, *, server: str, accepts_text: bool = True) -> GenerateRequest:
    """Normalise a /generate body (GenerateReqInput's rules) into per-item prompts, params and rids.

    `server` names the server in refusals ("dev server"); without a tokenizer (`accepts_text`
    False) a ``text`` prompt is refused.
    """
    body = parse_json_object(raw)
    if body.get("stream"):
        raise BadRequest(f"stream=True is not supported by the eagle3 {server}; use stream=false.")
    text, input_ids = body.get("text"), body.get("input_ids")
    if text is not None and not accepts_text:
        raise BadRequest(f"The {server} has no tokenizer: send input_ids, not text.")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    prompts: list[str | list[int]]
    if text is not None:
        if isinstance(text, str):
            single, prompts = True, [text]
        elif isinstance(text, list) and all(isinstance(t, str) for t in text):
            single, prompts = False, list(text)
        else:
            raise MalformedRequest("text must be a string or a list of strings")
    else:
        if _is_id_list(input_ids) and input_ids:
            single, prompts = True, [input_ids]
        elif isinstance(input_ids, list) and input_ids and all(_is_id_list(s) for s in input_ids):
            single, prompts = False, list(input_ids)
        elif input_ids == []:
            raise BadRequest("input_ids cannot be empty.")
        else:
            raise MalformedRequest("input_ids must be a list of ints or a list of lists of ints")
    n = len(prompts)
    if n == 0:
        raise BadRequest("The batch is empty.")

    params = body.get("sampling_params")
    if isinstance(params, list):
        if single or len(params) != n:
            raise BadRequest(f"sampling_params has {len(params)} entries for a batch of {n}.")
    else:
        params = [params] * n  # one dict applies to every item, as in SGLang

    rid = body.get("rid")
    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif single and isinstance(rid, str):
        rids = [rid]
    elif not single and isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != n:
            raise BadRequest(f"rid has {len(rid)} entries for a batch of {n}.")
        rids = list(rid)
    else:
        raise MalformedRequest("rid must be a string (single request) or a list of strings (batch)")
    return GenerateRequest(single, prompts, params, rids)


def parse_abort(raw: bytes) -> tuple[str | None, bool]:
    """An /abort_request body: (rid, abort_all)."""
    body = parse_json_object(raw or b"{}")
    return body.get("rid"), bool(body.get("abort_all"))


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def finish_stop(token: int) -> dict[str, Any]:
    return {"type": "stop", "matched": token}


def finish_length(n: int) -> dict[str, Any]:
    return {"type": "length", "length": n}


def finish_abort(message: str, status_code: int | None = None) -> dict[str, Any]:
    return {"type": "abort", "message": message, "status_code": status_code}


def text_token_ids(output_ids: list[int], finish_reason: dict[str, Any], no_stop_trim: bool) -> list[int]:
    """The ids ``text`` is decoded from: a matched stop token is trimmed unless no_stop_trim."""
    if finish_reason.get("type") == "stop" and not no_stop_trim:
        return output_ids[:-1]
    return output_ids


def generate_result(
    *, rid: str, text: str, output_ids: list[int], finish_reason: dict[str, Any], prompt_tokens: int,
    e2e_latency: float, spec_verify_ct: int | None = None,
) -> dict[str, Any]:
    """One /generate answer in SGLang's shape (no prefix cache, no reasoning parser).

    `spec_verify_ct` (a server with a draft): the request's verify rounds, SGLang's meta_info field.
    """
    result = {
        "text": text,
        "output_ids": output_ids,
        "meta_info": {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": len(output_ids),
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "e2e_latency": e2e_latency,
        },
    }
    if spec_verify_ct is not None:
        result["meta_info"]["spec_verify_ct"] = spec_verify_ct
    return result


def server_info(
    *, model_path: str, served_model_name: str, limits: ModelLimits, max_running: int, dtype: str, device: str,
    skip_tokenizer_init: bool, version: str, running: int, waiting: int,
    speculative: dict[str, Any] | None = None, avg_spec_accept_length: float | None = None,
) -> dict[str, Any]:
    """The /server_info fields the pipeline and the tests read, in SGLang's names.

    `speculative`: SGLang's `speculative_*` server args of a server with a draft (merged in);
    `avg_spec_accept_length` goes into internal_states as SGLang's scheduler reports it.
    """
    state: dict[str, Any] = {"num_running_reqs": running, "num_waiting_reqs": waiting}
    if avg_spec_accept_length is not None:
        state["avg_spec_accept_length"] = avg_spec_accept_length
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "served_model_name": served_model_name,
        "context_length": limits.context_length,
        "max_running_requests": max_running,
        "max_total_num_tokens": max_running * limits.context_length,
        "max_req_input_len": limits.max_req_input_len,
        "max_req_len": limits.max_req_len,
        "vocab_size": limits.vocab_size,
        "dtype": dtype,
        "device": device,
        "skip_tokenizer_init": skip_tokenizer_init,
        "allow_auto_truncate": False,
        "version": version,
        "internal_states": [state],
        **(speculative or {}),
    }


def model_info(*, model_path: str, model_type: str | None, architectures: list[str] | None) -> dict[str, Any]:
    """The /model_info body of a generation model."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": architectures,
    }


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


async def results_or_abort(request: Request, results: Awaitable[T], abort: Callable[[], Any]) -> T:
    """Await `results`; if the client goes away first, abort() (SGLang frees the batch) and still await.

    The request body must have been read: the next ASGI message is then the disconnect.
    """
    results = asyncio.ensure_future(results)
    watcher = asyncio.ensure_future(request.receive())
    try:
        done, _ = await asyncio.wait((results, watcher), return_when=asyncio.FIRST_COMPLETED)
        if results not in done:
            abort()
        return await results
    except asyncio.CancelledError:  # the server is going away: don't leave the work running
        abort()
        raise
    finally:
        watcher.cancel()


class SGLangBackend(Protocol):
    """What a server behind `create_sglang_app` supplies: the model (or its simulation)."""

    async def generate(self, request: Request) -> Any:
        """Serve a /generate request (its body unread); the JSON answer (raise the errors above)."""

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """Abort the matching in-flight requests; how many."""

    def healthy(self) -> bool:
        """The answer to /health."""

    async def health_generate(self) -> bool:
        """The answer to /health_generate (SGLang runs a 1-token generation)."""

    def server_info(self) -> dict[str, Any]:
        """The /server_info body (see `server_info`)."""

    def model_info(self) -> dict[str, Any]:
        """The /model_info body (see `model_info`)."""


def create_sglang_app(
    backend: SGLangBackend, *, title: str, version: str,
    lifespan: Callable[[FastAPI], AsyncContextManager[None]] | None = None,
) -> FastAPI:
    """A FastAPI app with SGLang's endpoints and error bodies over `backend`."""
    app = FastAPI(title=title, version=version, lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest):
        return JSONResponse(value_error_body(str(exc)), status_code=400)

    @app.exception_handler(MalformedRequest)
    async def malformed(_request: Request, exc: MalformedRequest):
        return JSONResponse(http_error_body(str(exc), 400), status_code=400)

    @app.exception_handler(ServerError)
    async def server_error(_request: Request, exc: ServerError):
        return JSONResponse(http_error_body(str(exc), exc.status), status_code=exc.status)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        return JSONResponse(await backend.generate(request))

    @app.post("/abort_request")
    async def abort_request(request: Request):
        backend.abort(*parse_abort(await request.body()))
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if backend.healthy() else 503)

    @app.get("/health_generate")
    async def health_generate():
        return Response(status_code=200 if await backend.health_generate() else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return JSONResponse(backend.server_info())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return JSONResponse(backend.model_info())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        return Response("Cache flushed.\n", status_code=200)  # nothing is cached between requests

    return app


__all__ = [
    "BadRequest", "DEFAULT_MAX_NEW_TOKENS", "GenerateRequest", "MalformedRequest", "ModelLimits", "SAMPLING_EPS",
    "SGLangBackend", "SamplingParams", "ServerError", "create_sglang_app", "error_response", "finish_abort",
    "finish_length", "finish_stop", "generate_result", "http_error_body", "model_info", "parse_abort",
    "parse_generate", "parse_json_object", "parse_sampling_params", "results_or_abort", "server_info",
    "text_token_ids", "value_error_body",
]
