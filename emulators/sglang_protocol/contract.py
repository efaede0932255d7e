"""SGLang's native HTTP protocol, as the dev server and the simulated server speak it.

One definition of the subset of SGLang's API the pipeline uses, for ``emulators/dev_server.py`` (a
real model) and ``emulators/sim/`` (a simulation); each server supplies only what differs
through `SGLangBackend`, and `create_sglang_app` gives both the same endpoints and rules.

Which SGLang: every rule here follows SGLang 0.5.23 (read in its wheel; files are named relative
to the ``sglang`` package). A server started with ``sglang_version="0.4"`` follows SGLang 0.4.x
(read in 0.4.10.post2) where the two differ -- `SGLangVersion` lists each difference with its source.
tests/emulators/test_sglang_contract.py checks every rule against both servers.

- ``POST /generate`` -- ``text`` or ``input_ids`` (single or batch), ``sampling_params``
  (``max_new_tokens`` default 128, ``temperature`` (0 = greedy), ``top_p``, ``top_k`` (-1 = off),
  ``stop_token_ids``, ``ignore_eos``, ``skip_special_tokens``, ``no_stop_trim``, ``sampling_seed``;
  one object for the batch or a list, one per item), ``rid`` (a string, or a list for a batch).
  ``stream=true`` is refused (400): streaming is not implemented. A batch returns a list in input order.
  A finished request is answered as srt/managers/tokenizer_manager.py ``_handle_batch_output``
  builds it: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
  "weight_version": "default", "num_retractions": 0, "reasoning_tokens", "completion_tokens",
  "cached_tokens", "weight_versions": [{"version": "default", "start": 0, "end": n}], "e2e_latency"}}``
  (plus ``spec_verify_ct``, the verify rounds, from a server decoding with a draft). ``finish_reason``
  is ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or an abort (below).
  ``output_ids`` keep a matched stop token; ``text`` drops it unless ``no_stop_trim``
  (``DetokenizerManager.trim_matched_stop``). A stop token is checked BEFORE the length cap
  (srt/managers/schedule_batch.py ``Req.update_finish_state``): a stop token that is the
  max_new_tokens-th token finishes ``stop``; speculative decoding that finds a stop beyond the cap
  finishes ``length`` at the cap (``_cap_finished_len_at_max_new_tokens``).
- Request ids: a /generate whose rid (or one rid of a batch, or a rid repeated inside the batch) the
  server still holds is refused, 400 ``Duplicate request ID detected: <rid>``
  (tokenizer_manager.py ``_init_req_state``, after the body is normalised and before any prompt
  is checked). A rid is held from then until its request's final output is processed; a prompt
  that fails its checks frees its batch's rids (``_release_req_states_on_failure``).
- Client disconnect: SGLang notices a client that went away only when its wait for the request's
  output times out, every ``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` = 4 s (srt/environ.py) counted
  from the request's start (tokenizer_manager.py ``_stream_one_response``); it then aborts the
  request (``abort_request(rid)``, prefix rule below). Until then the request runs and its rid is
  held. `results_or_abort` emulates that poll (``disconnect_poll_s``).
- ``POST /abort_request`` ``{"rid": ...}`` or ``{"abort_all": true}`` -- answered 200 with no body.
  tokenizer_manager.py ``abort_request`` ignores an empty rid without abort_all and a rid it does
  not hold exactly; srt/managers/scheduler.py ``abort_request`` then aborts every waiting and running
  request whose rid STARTS WITH the given rid (`abort_matcher`). A request aborted while still
  queued is answered (200) as tokenizer_manager.py ``_handle_abort_req`` builds it
  (`queued_abort_result`: no prompt_tokens); a running one finishes through the normal output path
  with ``FINISH_ABORT().to_json()`` = ``{"type": "abort", "message": "Aborted", "status_code": null,
  "err_type": null}`` and the tokens generated so far.
- API keys (``--api-key``, ``--admin-api-key``): srt/utils/auth.py ``decide_request_auth`` (`Auth`).
- ``GET /v1/loads``: the running and waiting counts (entrypoints/v1_loads.py), which /server_info does not have.
- ``GET /health``, ``GET /health_generate``, ``GET /server_info`` and ``GET /model_info`` (also
  under SGLang's older ``/get_*`` names), ``/flush_cache`` (entrypoints/http_server.py
  ``flush_cache``: 200 when the server is idle, else 400; a flush resets the scheduler's metrics).

Error bodies, checked against SGLang 0.5.23's source -- three 400 shapes:

- Bad input that SGLang rejects with a ``ValueError`` (``GenerateReqInput`` normalisation, the
  duplicate rid, ``TokenizerManager._validate_one_request`` / ``_validate_input_ids_in_vocab``,
  ``SamplingParams.verify``, the scheduler's ``validate_input_length``): HTTP 400 with
  ``{"error": {"message": "..."}}`` -- entrypoints/http_server.py ``_create_error_response``.
  Raise `BadRequest`. Length messages are SGLang's words, e.g. ``"The input (N tokens) is longer
  than the model's context length (M tokens)."``; ``prompt_tokens + max_new_tokens >
  context_length`` is an error too (``validate_total_tokens`` is on and ``--allow-auto-truncate``
  off by default), and a prompt of ``max_req_input_len`` tokens or more is refused as SGLang's
  scheduler does. With an EAGLE draft both tokenizer checks add the reserved tokens (`ModelLimits`).
- A body the ``GenerateReqInput`` dataclass parse admits but the API schema refuses
  (entrypoints/http_server.py ``generate_request`` -> entrypoints/api_contract.py
  ``generate_contract_error`` -> api/v1/api_types.py ``decode_GenerateRequest``): HTTP 400 with
  ``{"error": "<the schema's text>"}``, e.g. an unknown sampling param (``unknown field `foo`,
  expected one of ...``), a sampling param of the wrong JSON type (``invalid type: string "hot",
  expected f64``) or a JSON ``true`` among the input_ids (``invalid type: boolean `true`, expected
  i64``). Raise `ContractError` (`contract_error` finds it).
- Malformed JSON or a field the dataclass parse refuses (FastAPI's ``RequestValidationError``):
  HTTP 400 with ``{"object": "error", "message": "...", "type": "Bad Request", "param": null,
  "code": 400}`` -- http_server.py ``validation_exception_handler``. Raise `MalformedRequest`.
- Other statuses (a failure inside the model: 500, not serving: 503): ``{"object": "error",
  "message": ..., "type": "<status>", "param": null, "code": <status>}`` (SGLang's
  ``HTTPException`` handler shape). Raise `ServerError`. Auth refusals: 401 ``{"error": "Unauthorized"}``.

Deliberate differences from SGLang: ``text`` and ``input_ids`` together are refused (SGLang lets
text win); only the fields above are parsed (others are ignored, the schema gate included).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import secrets
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol, TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

T = TypeVar("T")

SAMPLING_EPS = 1e-6  # SGLang treats 0 <= temperature < 1e-6 as greedy
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request gives none
# srt/environ.py SGLANG_REQUEST_STATE_WAIT_TIMEOUT = EnvInt(4) (0.4.10: a literal timeout=4 in
# tokenizer_manager.py `_wait_one_response`): how often SGLang looks for a client that went away.
DISCONNECT_POLL_S = 4.0
# srt/arg_groups/fields/observability.py decode_log_interval = 40 (0.4.10: ServerArgs, also 40).
DECODE_LOG_INTERVAL = 40
WEIGHT_VERSION = "default"  # srt/arg_groups/fields/serving.py weight_version
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"  # srt/constants.py
SGLANG_VERSIONS = ("0.5", "0.4")

# The sampling params both servers implement.
_SAMPLING_KEYS = {
    "max_new_tokens",
    "temperature",
    "top_p",
    "top_k",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "no_stop_trim",
    "sampling_seed",
}
# SGLang sampling params not implemented here, with the values that make them no-ops.
_NOOP_SAMPLING = {
    "stop": ([], ""),
    "stop_regex": ([], ""),
    "min_p": (0, 0.0),
    "frequency_penalty": (0, 0.0),
    "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0),
    "min_new_tokens": (0,),
    "n": (1,),
    "spaces_between_special_tokens": (True,),
    "logit_bias": ({},),
    "custom_params": ({},),
    "stream_interval": (),
    "json_schema": (),
    "regex": (),
    "ebnf": (),
    "structural_tag": (),
}


# ---------------------------------------------------------------------------------------------
# Which SGLang
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class SGLangVersion:
    """The SGLang a server follows: "0.5" (0.5.23, the default) or "0.4" (0.4.x, read in 0.4.10.post2).

    Only the differences verified in both sources; everything else is 0.5.23's in both.
    """

    name: str = "0.5"

    def __post_init__(self):
        if self.name not in SGLANG_VERSIONS:
            raise ValueError(f"sglang_version must be one of {SGLANG_VERSIONS}, got {self.name!r}")

    @classmethod
    def of(cls, value: str | SGLangVersion) -> SGLangVersion:
        return value if isinstance(value, SGLangVersion) else cls(str(value))

    @property
    def is_04(self) -> bool:
        return self.name == "0.4"

    @property
    def stop_before_length(self) -> bool:
        """0.5.23 schedule_batch.py `update_finish_state` checks stop tokens first; 0.4.10 `check_finished` length."""
        return not self.is_04

    @property
    def refuses_duplicate_rids(self) -> bool:
        """0.5.23 `_init_req_state` refuses a held rid; 0.4.10 `_send_one_request` just overwrites rid_to_state[rid]."""
        return not self.is_04

    @property
    def contract_gate(self) -> bool:
        """0.5.23 http_server.py `generate_request` runs `generate_contract_error`; 0.4.10 has no such gate."""
        return not self.is_04

    @property
    def reserves_draft_tokens(self) -> bool:
        """0.5.23 `_validate_one_request` adds compute_num_reserved_tokens(); 0.4.10 adds nothing."""
        return not self.is_04

    @property
    def total_tokens_refused_at_context(self) -> bool:
        """0.4.10 refuses prompt + max_new_tokens >= context; 0.5.23 only > context."""
        return self.is_04

    @property
    def reads_eagle31_keys(self) -> bool:
        """0.5.23 srt/models/llama_eagle3.py builds `fc_norm` (config fc_norm or use_aux_norm) and, with
        `norm_output`, hands the next draft step the post-norm state; 0.4.10's reads neither key, and its
        `load_weights` drops the fc_norm.* tensors unread (no such parameter): an EAGLE-3.1 draft is served as
        EAGLE-3."""
        return not self.is_04

    @property
    def has_admin_api_key(self) -> bool:
        """--admin-api-key exists from 0.5 (utils/auth.py); 0.4.10 only --api-key (utils.py add_api_key_middleware)."""
        return not self.is_04


V05 = SGLangVersion("0.5")


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


class BadRequest(ValueError):
    """Bad input SGLang reports as a ValueError: 400 ``{"error": {"message": ...}}``."""


class ContractError(ValueError):
    """A body SGLang 0.5's API schema refuses (api_contract.py): 400 ``{"error": "<text>"}``."""


class MalformedRequest(ValueError):
    """Input SGLang's FastAPI layer rejects (bad JSON, wrong types): 400 OpenAI-style body."""


class ServerError(Exception):
    """A request the server cannot serve now (503) or that failed inside it (500)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


def value_error_body(message: str) -> dict[str, Any]:
    """SGLang's body for a ValueError (http_server.py `_create_error_response`): ``{"error": {"message": ...}}``."""
    return {"error": {"message": message}}


def contract_error_body(message: str) -> dict[str, Any]:
    """SGLang 0.5's body for a schema violation (http_server.py `generate_request`): ``{"error": "<text>"}``."""
    return {"error": message}


def http_error_body(message: str, status: int) -> dict[str, Any]:
    """SGLang's OpenAI-style body for validation errors (400) and HTTP exceptions (others)."""
    kind = "Bad Request" if status == 400 else str(status)
    return {"object": "error", "message": message, "type": kind, "param": None, "code": status}


def error_response(status: int, message: str) -> JSONResponse:
    """An error answer as SGLang words it for `status`: 400 is a ValueError, the rest HTTP errors."""
    body = value_error_body(message) if status == 400 else http_error_body(message, status)
    return JSONResponse(body, status_code=status)


# ---------------------------------------------------------------------------------------------
# The /generate contract gate (SGLang 0.5.23 api/v1/api_types.py, the Python twin of the Rust decoder)
# ---------------------------------------------------------------------------------------------


def _unexpected(v: Any) -> str:
    """api_types.py `_unexpected`: serde's display of the value found."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    if isinstance(v, list):
        return "sequence"
    if isinstance(v, dict):
        return "map"
    return type(v).__name__


def _invalid(v: Any, expected: str) -> ContractError:
    return ContractError(f"invalid type: {_unexpected(v)}, expected {expected}")


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _expect(ok: bool, v: Any, expected: str) -> None:
    if not ok:
        raise _invalid(v, expected)


def _i64(v: Any) -> None:
    _expect(_is_int(v), v, "i64")


def _f64(v: Any) -> None:
    _expect(isinstance(v, (int, float)) and not isinstance(v, bool), v, "f64")


def _bool(v: Any) -> None:
    _expect(isinstance(v, bool), v, "a boolean")


def _str(v: Any) -> None:
    _expect(isinstance(v, str), v, "a string")


def _seq(v: Any) -> list:
    _expect(isinstance(v, list), v, "a sequence")
    return v


def _str_list(v: Any) -> None:  # decode_StringList
    for e in _seq(v):
        _str(e)


def _str_or_list(v: Any) -> None:  # decode_StringOrList
    if isinstance(v, list):
        _str_list(v)
    else:
        _expect(isinstance(v, str), v, "a value or an array of values for StringOrList")


def _i64_list(v: Any) -> None:  # decode_Int64List / decode_TokenIds
    for e in _seq(v):
        _i64(e)


def _f64_map(v: Any) -> None:  # logit_bias
    _expect(isinstance(v, dict), v, "a map")
    for e in v.values():
        _f64(e)


def _unknown_field(key: str, fields: tuple[str, ...]) -> ContractError:
    """api_types.py `_unknown_field`: serde's `unknown_field` text."""
    if len(fields) == 1:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}`")
    if len(fields) == 2:
        return ContractError(f"unknown field `{key}`, expected `{fields[0]}` or `{fields[1]}`")
    return ContractError(f"unknown field `{key}`, expected one of {', '.join(f'`{f}`' for f in fields)}")


def _struct(value: Any, name: str, schema: Mapping[str, Callable[[Any], None]]) -> None:
    """A struct whose unknown keys are rejected; null values are the defaults (decode_<name>)."""
    _expect(isinstance(value, dict), value, f"struct {name}")
    for key, x in value.items():
        check = schema.get(key)
        if check is None:
            raise _unknown_field(key, tuple(schema))
        if x is not None:
            check(x)


_WATERMARK = {"enabled": _bool, "key": _str, "context_window": _i64}
# decode_SamplingParams, in _FIELDS_SamplingParams order (the order of the unknown-field message).
_SAMPLING_SCHEMA: dict[str, Callable[[Any], None]] = {
    "max_new_tokens": _i64,
    "stop": _str_or_list,
    "stop_token_ids": _i64_list,
    "stop_regex": _str_or_list,
    "temperature": _f64,
    "top_p": _f64,
    "top_k": _i64,
    "min_p": _f64,
    "frequency_penalty": _f64,
    "presence_penalty": _f64,
    "repetition_penalty": _f64,
    "min_new_tokens": _i64,
    "n": _i64,
    "json_schema": _str,
    "regex": _str,
    "ebnf": _str,
    "structural_tag": _str,
    "ignore_eos": _bool,
    "skip_special_tokens": _bool,
    "spaces_between_special_tokens": _bool,
    "no_stop_trim": _bool,
    "stream_interval": _i64,
    "logit_bias": _f64_map,
    "sampling_seed": _i64,
    "custom_params": lambda x: None,
    "beam_width": _i64,
    "watermark": lambda x: _struct(x, "WatermarkRequestConfig", _WATERMARK),
    "choice": _str_list,
}


def _sampling_params_or_list(v: Any) -> None:  # decode_SamplingParamsOrList
    if isinstance(v, list):
        for e in v:
            _struct(e, "SamplingParams", _SAMPLING_SCHEMA)
    else:
        _expect(isinstance(v, dict), v, "a value or an array of values for SamplingParamsOrList")
        _struct(v, "SamplingParams", _SAMPLING_SCHEMA)


def _token_ids_or_list(v: Any) -> None:  # decode_TokenIdsOrList
    _expect(isinstance(v, list), v, "a value or an array of values for TokenIdsOrList")
    # [] and [scalar, ...] are one flat list; anything else is a batch.
    if not v or (isinstance(v[0], (int, float)) and not isinstance(v[0], bool)):
        _i64_list(v)
    else:
        for row in _seq(v):
            _i64_list(row)


# The GenerateRequest fields these servers read (decode_GenerateRequest checks them in body order).
_GENERATE_SCHEMA: dict[str, Callable[[Any], None]] = {
    "rid": _str_or_list,
    "text": _str_or_list,
    "input_ids": _token_ids_or_list,
    "stream": _bool,
    "sampling_params": _sampling_params_or_list,
}


def contract_error(body: dict[str, Any]) -> str | None:
    """SGLang 0.5.23's schema verdict on a parsed /generate body: the violation's text, or None.

    entrypoints/api_contract.py `generate_contract_error` -> api_types.py `decode_GenerateRequest`,
    for the fields in `_GENERATE_SCHEMA` (GenerateRequest ignores unknown top-level keys; its other
    fields are not read here).
    """
    try:
        for key, x in body.items():
            check = _GENERATE_SCHEMA.get(key)
            if check is not None and x is not None:
                check(x)
    except ContractError as exc:
        return str(exc)
    return None


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
    values, since for a real model ignoring them would silently change the outputs. Over HTTP the
    0.5 contract gate has refused wrong types and unknown keys before this runs (`contract_error`);
    a 0.4 server refuses them here as malformed.
    """
    if raw is None:
        return SamplingParams()
    if isinstance(raw, SamplingParams):
        return raw
    if not isinstance(raw, dict):
        raise MalformedRequest(f"sampling_params must be an object, got {type(raw).__name__}")
    if unimplemented_by is not None:
        unsupported = sorted(
            k
            for k, v in raw.items()
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


def num_reserved_tokens(*, eagle_topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """srt/managers/utils.py `compute_num_reserved_tokens` for an EAGLE draft: max(topk * steps, draft tokens).

    EAGLE stores its draft tokens in the request's output slots, so the tokenizer's length checks
    reserve them per request (no draft: 0).
    """
    return max(eagle_topk * num_steps, num_draft_tokens)


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """The model's vocabulary and context, and SGLang's limits derived from them.

    `reserved_tokens`: what the tokenizer manager reserves per request on top of the prompt
    (`num_reserved_tokens` with an EAGLE draft, else 0); `sglang_version` picks 0.4.x's checks.
    """

    vocab_size: int
    context_length: int
    reserved_tokens: int = 0
    sglang_version: SGLangVersion = V05

    def __post_init__(self):
        object.__setattr__(self, "sglang_version", SGLangVersion.of(self.sglang_version))
        if self.reserved_tokens < 0:
            raise ValueError(f"reserved_tokens must be >= 0, got {self.reserved_tokens}")

    @property
    def max_req_len(self) -> int:
        """SGLang's scheduler (tp_worker.py): a request (prompt + output) holds at most context - 1 tokens."""
        return self.context_length - 1

    @property
    def max_req_input_len(self) -> int:
        """SGLang's scheduler refuses prompts of max_req_len - 5 tokens or more."""
        return self.max_req_len - 5

    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The scheduler's clamp of max_new_tokens to the context left (scheduler.py `init_req_max_new_tokens`)."""
        budget = max(0, self.max_req_len - prompt_len - 1)
        return budget if params.max_new_tokens is None else min(params.max_new_tokens, budget)

    def check_ids(self, ids: Sequence[int]) -> None:
        """SGLang's checks of the prompt ids themselves (empty, out of the vocabulary)."""
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        if max(ids) >= self.vocab_size:
            raise BadRequest(
                f"The input_ids {list(ids)} contains values greater than the vocab size ({self.vocab_size})."
            )
        if min(ids) < 0:
            raise BadRequest(f"The input_ids {list(ids)} contains negative values.")

    def check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        """TokenizerManager._validate_one_request (0.5.23, lines ~1333-78), then the scheduler's validate_input_length.

        0.5.23 counts the prompt plus the reserved tokens in both tokenizer checks and refuses a total
        over the context; 0.4.10 reserves nothing and refuses a total of the context or more.
        """
        v = self.sglang_version
        n, ctx = prompt_len + (self.reserved_tokens if v.reserves_draft_tokens else 0), self.context_length
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if params.max_new_tokens is not None:
            total = n + params.max_new_tokens
            if total >= ctx if v.total_tokens_refused_at_context else total > ctx:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                    f"You requested a total of {total} tokens: {n} tokens from the input "
                    f"messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
                    "of tokens in the input messages or the completion to fit within the limit."
                )
        if prompt_len >= self.max_req_input_len:
            raise BadRequest(
                f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )

    def admit(self, ids: Sequence[int], raw_params: Any, *, unimplemented_by: str | None = None) -> SamplingParams:
        """All of SGLang's checks of one prompt, in SGLang's order; returns its sampling params."""
        self.check_ids(ids)
        params = parse_sampling_params(raw_params, unimplemented_by=unimplemented_by)
        self.check_lengths(len(ids), params)
        return params


def finish_reason(
    output_ids: Sequence[int], max_new_tokens: int, stop_ids: Iterable[int], version: SGLangVersion = V05
) -> dict[str, Any] | None:
    """The finish of a sequence whose last token was just added (None: it goes on).

    `stop_ids`: the eos ids and the request's stop_token_ids, empty under ignore_eos. 0.5.23
    schedule_batch.py `update_finish_state` checks the stop token first, so a stop token that is the
    max_new_tokens-th token finishes "stop"; 0.4.10 `check_finished` checks the length first.
    """
    stopped = bool(output_ids) and output_ids[-1] in set(stop_ids)
    at_cap = len(output_ids) >= max_new_tokens
    if stopped and (version.stop_before_length or not at_cap):
        return finish_stop(output_ids[-1])
    if at_cap:
        return finish_length(max_new_tokens)
    return None


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


def _is_id_list(x: Any, *, lax: bool) -> bool:
    """A flat list of token ids. lax: as SGLang 0.5's C-loop validator (srt/utils/field_validators.py
    `validate_list_i64_1d`, an array("q")), which lets a JSON true through for the contract gate
    to refuse; strict (0.4 here): type(x) is int only. map/set keep long prompts cheap."""
    if type(x) is not list:
        return False
    return set(map(type, x)) <= ({int, bool} if lax else {int})


_PYDANTIC_BOOL_STRINGS = {"0", "1", "true", "false", "t", "f", "yes", "no", "y", "n", "on", "off"}


def _pydantic_bool(v: Any) -> bool:
    """What pydantic's lax bool admits (GenerateReqInput.stream: bool)."""
    return (
        isinstance(v, bool)
        or (type(v) is int and v in (0, 1))
        or (isinstance(v, str) and v.lower() in _PYDANTIC_BOOL_STRINGS)
    )


def parse_generate(
    raw: bytes, *, server: str, accepts_text: bool = True, version: SGLangVersion = V05
) -> GenerateRequest:
    """Normalise a /generate body into per-item prompts, params and rids, in SGLang's order.

    First the dataclass parse (MalformedRequest), then (0.5) the contract gate (ContractError),
    then GenerateReqInput's normalisation (BadRequest). `server` names the server in refusals
    ("dev server"); without a tokenizer (`accepts_text` False) a ``text`` prompt is refused.
    """
    body = parse_json_object(raw)
    lax = version.contract_gate
    text, input_ids, rid = body.get("text"), body.get("input_ids"), body.get("rid")
    params, stream = body.get("sampling_params"), body.get("stream")
    # 1. GenerateReqInput as FastAPI parses it (pydantic; input_ids by field_validators.py).
    if not (
        text is None or isinstance(text, str) or (isinstance(text, list) and all(isinstance(t, str) for t in text))
    ):
        raise MalformedRequest("text must be a string or a list of strings")
    if input_ids is not None and not (
        input_ids == []
        or _is_id_list(input_ids, lax=lax)
        or (isinstance(input_ids, list) and all(_is_id_list(s, lax=lax) for s in input_ids))
    ):
        raise MalformedRequest("input_ids must be a list of ints or a list of lists of ints")
    if not (rid is None or isinstance(rid, str) or (isinstance(rid, list) and all(isinstance(r, str) for r in rid))):
        raise MalformedRequest("rid must be a string (single request) or a list of strings (batch)")
    if not (
        params is None
        or isinstance(params, dict)
        or (isinstance(params, list) and all(isinstance(p, dict) for p in params))
    ):
        raise MalformedRequest("sampling_params must be an object or a list of objects")
    if stream is not None and not (_pydantic_bool(stream) if lax else isinstance(stream, bool)):
        raise MalformedRequest("stream must be a boolean")
    # 2. The API schema (0.5 only).
    if version.contract_gate:
        violation = contract_error(body)
        if violation is not None:
            raise ContractError(violation)
    # 3. Normalisation (ValueErrors).
    if stream:
        raise BadRequest(f"stream=True is not supported by the eagle3 {server}; use stream=false.")
    if text is not None and not accepts_text:
        raise BadRequest(f"The {server} has no tokenizer: send input_ids, not text.")
    if (text is None) == (input_ids is None):
        raise BadRequest("Either text, input_ids or input_embeds should be provided.")
    prompts: list[str | list[int]]
    if text is not None:
        single, prompts = isinstance(text, str), [text] if isinstance(text, str) else list(text)
    elif input_ids is None:
        raise RuntimeError("neither text nor input_ids, yet the exactly-one check above let the body through")
    elif input_ids == []:
        raise BadRequest("input_ids cannot be empty.")
    elif not isinstance(input_ids[0], list):
        single, prompts = True, [input_ids]
    else:
        single, prompts = False, list(input_ids)
    n = len(prompts)
    if n == 0:
        raise BadRequest("The batch is empty.")

    if isinstance(params, list):
        if single or len(params) != n:
            raise BadRequest(f"sampling_params has {len(params)} entries for a batch of {n}.")
    else:
        params = [params] * n  # one dict applies to every item, as in SGLang

    if rid is None:
        rids = [uuid.uuid4().hex for _ in range(n)]
    elif single and isinstance(rid, str):
        rids = [rid]
    elif not single and isinstance(rid, list):
        if len(rid) != n:
            raise BadRequest(f"rid has {len(rid)} entries for a batch of {n}.")
        rids = list(rid)
    else:
        raise MalformedRequest("rid must be a string (single request) or a list of strings (batch)")
    return GenerateRequest(single, prompts, params, rids)


def parse_abort(raw: bytes) -> tuple[str, bool]:
    """An /abort_request body: (rid, abort_all); a missing rid is "" (io_struct.py AbortReq.__post_init__)."""
    body = parse_json_object(raw or b"{}")
    rid, abort_all = body.get("rid"), body.get("abort_all", False)
    if rid is not None and not isinstance(rid, str):
        raise MalformedRequest("rid must be a string")
    if not isinstance(abort_all, bool):
        raise MalformedRequest("abort_all must be a boolean")
    return rid or "", abort_all


# ---------------------------------------------------------------------------------------------
# Request ids and aborts
# ---------------------------------------------------------------------------------------------


class HeldRids:
    """The rids a server holds: SGLang's TokenizerManager.rid_to_state (event-loop only).

    A 0.5 server refuses a held rid (`claim`); a 0.4 one admits it again (counted, so an abort of
    that rid still finds it held).
    """

    def __init__(self, version: SGLangVersion = V05):
        self.version = version
        self._held: Counter[str] = Counter()

    def claim(self, rids: Sequence[str]) -> None:
        """0.5.23: BadRequest for a rid repeated inside the batch (managers/io_struct.py `GenerateReqInput`'s
        batch check, first, as the real server answered) or a held one (tokenizer_manager.py `_init_req_state`);
        else hold all."""
        if self.version.refuses_duplicate_rids:
            repeated = [rid for rid, n in Counter(rids).items() if n > 1]
            if repeated:
                raise BadRequest(f"Duplicate request IDs detected within the request: {repeated}")
            for rid in rids:
                if rid in self._held:
                    raise BadRequest(f"Duplicate request ID detected: {rid}")
        self._held.update(rids)

    def release(self, rid: str) -> None:
        """The request's final output was processed (or it never got to the scheduler)."""
        if self._held[rid] <= 1:
            self._held.pop(rid, None)
        else:
            self._held[rid] -= 1

    def __contains__(self, rid: str) -> bool:
        return rid in self._held

    def __len__(self) -> int:
        return sum(self._held.values())


def abort_matcher(rid: str, abort_all: bool, held: HeldRids | Callable[[str], bool]) -> Callable[[str], bool] | None:
    """Which requests an /abort_request reaches; None: it is ignored.

    tokenizer_manager.py `abort_request` (0.5.23; 0.4.10 the same in effect): an empty rid without
    abort_all is ignored, and so is a rid the server does not hold exactly (one tokenizer worker);
    scheduler.py `abort_request` then aborts every waiting and running request whose rid starts
    with the given one (abort_all: every request).
    """
    if abort_all:
        return lambda _rid: True
    if not rid or not (rid in held if isinstance(held, HeldRids) else held(rid)):
        return None
    return lambda other: other.startswith(rid)


def health_check_rid() -> str:
    """http_server.py `health_generate`'s probe rid (0.5.23: the prefix and a uuid)."""
    return f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def finish_stop(token: int) -> dict[str, Any]:
    """schedule_batch.py FINISH_MATCHED_TOKEN.to_json()."""
    return {"type": "stop", "matched": token}


def finish_length(n: int) -> dict[str, Any]:
    """schedule_batch.py FINISH_LENGTH.to_json()."""
    return {"type": "length", "length": n}


def finish_abort(
    message: str | None = None, status_code: int | None = None, err_type: str | None = None
) -> dict[str, Any]:
    """schedule_batch.py FINISH_ABORT(...).to_json() (the same in 0.4.10): a running request's abort."""
    return {"type": "abort", "message": message or "Aborted", "status_code": status_code, "err_type": err_type}


def text_token_ids(output_ids: list[int], finish_reason: dict[str, Any], no_stop_trim: bool) -> list[int]:
    """The ids ``text`` is decoded from: a matched stop token is trimmed unless no_stop_trim."""
    if finish_reason.get("type") == "stop" and not no_stop_trim:
        return output_ids[:-1]
    return output_ids


def _weight_versions(n: int) -> list[dict[str, Any]]:
    """utils/weight_versions.py compute_weight_version_spans + add_weight_versions_to_meta_info; no weight updates."""
    return [{"version": WEIGHT_VERSION, "start": 0, "end": n}]


def generate_result(
    *,
    rid: str,
    text: str | None,
    output_ids: list[int],
    finish_reason: dict[str, Any],
    prompt_tokens: int,
    e2e_latency: float,
    spec_verify_ct: int | None = None,
    version: SGLangVersion = V05,
) -> dict[str, Any]:
    """One finished /generate answer in SGLang's shape (no prefix cache, no reasoning parser, weights never updated).

    0.5.23: tokenizer_manager.py `_handle_batch_output` (meta_info in its key order), then
    `_wait_one_response` adds response_sent_to_client_ts; as the real 0.5.23 answered on CPU (tests marked
    sglang), cached_tokens_details and dp_rank are there as null. `text` None: no "text" key, as a server
    started with --skip-tokenizer-init answers (BatchTokenIDOutput). 0.4.10 sends
    only id, finish_reason, prompt_tokens, completion_tokens, cached_tokens (+ spec_verify_ct) and
    e2e_latency; it also sends no output_ids when its tokenizer is on -- kept here (deliberately:
    the pipeline reads them). `spec_verify_ct` (a server with a draft): the request's verify rounds.
    """
    n = len(output_ids)
    if version.is_04:
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "completion_tokens": n,
            "cached_tokens": 0,
        }
        if spec_verify_ct is not None:
            meta["spec_verify_ct"] = spec_verify_ct
        meta["e2e_latency"] = e2e_latency
    else:
        meta = {
            "id": rid,
            "finish_reason": finish_reason,
            "prompt_tokens": prompt_tokens,
            "weight_version": WEIGHT_VERSION,
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_versions": _weight_versions(n),
            "cached_tokens_details": None,
            "dp_rank": None,
            "e2e_latency": e2e_latency,
        }
        if spec_verify_ct is not None:
            meta["spec_verify_ct"] = spec_verify_ct
        meta["response_sent_to_client_ts"] = time.time()
    head = {} if text is None else {"text": text}
    return {**head, "output_ids": output_ids, "meta_info": meta}


def queued_abort_result(*, rid: str, e2e_latency: float, version: SGLangVersion = V05) -> dict[str, Any]:
    """The answer to a request aborted while still queued: tokenizer_manager.py `_handle_abort_req`.

    0.5.23 (the scheduler's abort echo `_make_abort_req` carries weight version spans):
    ``{"text": "", "output_ids": [], "meta_info": {"id", "finish_reason": {"type": "abort",
    "message": "Abort in waiting queue"}, "weight_version", "e2e_latency", "weight_versions",
    "completion_tokens": 0}}`` -- no prompt_tokens. 0.4.10: ``{"text": "", "meta_info": {"id",
    "finish_reason": {"type": "abort", "message": "Abort before prefill"}, "prompt_tokens": 0,
    "completion_tokens": 0}}`` -- no output_ids.
    """
    if version.is_04:
        return {
            "text": "",
            "meta_info": {
                "id": rid,
                "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                "prompt_tokens": 0,
                "completion_tokens": 0,
            },
        }
    return {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": rid,
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": WEIGHT_VERSION,
            "e2e_latency": e2e_latency,
            "weight_versions": _weight_versions(0),
            "completion_tokens": 0,
            "response_sent_to_client_ts": time.time(),
        },
    }


def server_info(
    *,
    model_path: str,
    served_model_name: str,
    limits: ModelLimits,
    max_running: int,
    dtype: str,
    device: str,
    skip_tokenizer_init: bool,
    version: str,
    speculative: dict[str, Any] | None = None,
    avg_spec_accept_length: float | None = None,
) -> dict[str, Any]:
    """The /server_info fields the pipeline and the tests read, in SGLang's names.

    `speculative`: SGLang's `speculative_*` server args of a server with a draft (merged in);
    `avg_spec_accept_length` goes into internal_states as SGLang's scheduler reports it
    (scheduler_components/internal_state.py `_add_speculative`: absent while None).
    """
    state: dict[str, Any] = {}  # no queue counts here: the real 0.5.23 has them in /v1/loads only (`loads`)
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


def loads(*, running: int, waiting: int, max_running: int, version: str) -> dict[str, Any]:
    """The /v1/loads body, the fields the tests read (entrypoints/v1_loads.py `get_loads`; one DP rank):
    where SGLang 0.5.23 reports how many requests run and wait (not /server_info, as the real server showed)."""
    return {
        "version": version,
        "loads": [
            {
                "dp_rank": 0,
                "num_running_reqs": running,
                "num_waiting_reqs": waiting,
                "max_running_requests": max_running,
            }
        ],
    }


def model_info(*, model_path: str, model_type: str | None, architectures: list[str] | None) -> dict[str, Any]:
    """The /model_info body of a generation model."""
    return {
        "model_path": model_path,
        "tokenizer_path": model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": WEIGHT_VERSION,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": model_type,
        "architectures": architectures,
    }


# ---------------------------------------------------------------------------------------------
# API keys
# ---------------------------------------------------------------------------------------------

# entrypoints/http_server.py: the endpoints marked @auth_level(AuthLevel.ADMIN_OPTIONAL) that these servers have.
ADMIN_OPTIONAL_PATHS = frozenset({"/abort_request", "/flush_cache"})


@dataclasses.dataclass(frozen=True)
class Auth:
    """``--api-key`` / ``--admin-api-key`` and who they let in (`decide`)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    version: SGLangVersion = V05

    def __post_init__(self):
        if self.admin_api_key and not self.version.has_admin_api_key:
            raise ValueError(
                "--admin-api-key does not exist in SGLang 0.4.x (only --api-key): drop it or use sglang_version 0.5"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def decide(self, method: str, path: str, authorization: str | None) -> int | None:
        """None to let the request in, else the refusal's status.

        0.5.23 utils/auth.py `decide_request_auth`: OPTIONS and /health*, /ready*, /metrics* always
        open; an ADMIN_OPTIONAL endpoint takes the admin key when one is set, else the api key, else
        anything; a NORMAL one takes the api key when set, else anything (admin key only: open).
        A bearer token, scheme case-insensitive, compared in constant time. 0.4.10 utils.py
        `add_api_key_middleware`: every path but /health* and /metrics* needs exactly
        ``Bearer <api_key>``.
        """
        if method == "OPTIONS":
            return None
        if self.version.is_04:
            if not self.api_key or path.startswith(("/health", "/metrics")):
                return None
            return None if authorization == f"Bearer {self.api_key}" else 401
        if path.startswith(("/health", "/ready", "/metrics")):
            return None
        key: str | None
        if path in ADMIN_OPTIONAL_PATHS and self.admin_api_key:
            key = self.admin_api_key
        else:
            key = self.api_key
        if not key:
            return None
        return None if _bearer_matches(authorization, key) else 401


def _bearer_matches(authorization: str | None, expected: str) -> bool:
    """utils/auth.py `_check_bearer_token`."""
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], expected)


class _AuthMiddleware:
    """ASGI middleware (as utils/auth.py's, so disconnects still reach the app): refuse what `Auth.decide` refuses."""

    def __init__(self, app: Callable, auth: Auth, open_paths: frozenset[str], on_refused: Callable[[], Any] | None):
        self.app, self.auth, self.open_paths, self.on_refused = app, auth, open_paths, on_refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.open_paths:
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization")
            status = self.auth.decide(
                scope["method"], scope["path"], None if authorization is None else authorization.decode("latin-1")
            )
            if status is not None:
                if self.on_refused is not None:
                    self.on_refused()
                body = {"error": "Unauthorized" if status == 401 else "Forbidden"}
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)


# ---------------------------------------------------------------------------------------------
# Command-line flags
# ---------------------------------------------------------------------------------------------


def add_server_flags(
    ap: argparse.ArgumentParser, *, sglang_version: str = "0.5", disconnect_poll_s: float = DISCONNECT_POLL_S
) -> None:
    """The SGLang flags both servers' CLIs take: --api-key, --admin-api-key, --sglang-version, --disconnect-poll-s.

    `sglang_version` and `disconnect_poll_s` are the defaults of the last two.
    """
    ap.add_argument("--api-key", default=None, help="SGLang's --api-key: required on every endpoint but /health*")
    ap.add_argument(
        "--admin-api-key",
        default=None,
        help="SGLang's --admin-api-key: the only key /abort_request and /flush_cache take",
    )
    ap.add_argument(
        "--sglang-version",
        default=sglang_version,
        choices=list(SGLANG_VERSIONS),
        help="follow SGLang 0.5.23 (default) or 0.4.x where they differ",
    )
    ap.add_argument(
        "--disconnect-poll-s",
        type=float,
        default=disconnect_poll_s,
        help="how often a disconnected client is noticed (SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT)",
    )


# ---------------------------------------------------------------------------------------------
# The app
# ---------------------------------------------------------------------------------------------


async def results_or_abort(
    request: Request, results: Awaitable[T], abort: Callable[[], Any], *, poll_s: float = DISCONNECT_POLL_S
) -> T:
    """Await `results`, noticing a client that went away only as SGLang does: on a poll every `poll_s`.

    tokenizer_manager.py `_stream_one_response` (0.5.23): the wait for the output times out every
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT seconds from the request's start; only then is
    `request.is_disconnected()` asked, and a gone client's request aborted (abort()). Until that
    tick the request keeps running and its rid stays held. After abort() the (aborted) results are
    still awaited, so the rids are freed when the requests really end. poll_s <= 0 notices at once.
    The request body must have been read: the next ASGI message is then the disconnect.
    """
    results = asyncio.ensure_future(results)
    watcher = asyncio.ensure_future(request.receive())
    try:
        if poll_s <= 0:
            done, _ = await asyncio.wait((results, watcher), return_when=asyncio.FIRST_COMPLETED)
            if results not in done:
                abort()
            return await results
        while True:
            done, _ = await asyncio.wait((results,), timeout=poll_s)
            if done:
                return results.result()
            if watcher.done():  # is_disconnected() at this tick
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

    def abort(self, rid: str, abort_all: bool) -> int:
        """An /abort_request: abort what `abort_matcher` says; how many sequences."""

    def flush_cache(self) -> bool:
        """/flush_cache: True (and the scheduler metrics reset) when idle, False while requests are in flight."""

    def healthy(self) -> bool:
        """The answer to /health."""

    async def health_generate(self) -> bool:
        """The answer to /health_generate (SGLang runs a 1-token generation)."""

    def server_info(self) -> dict[str, Any]:
        """The /server_info body (see `server_info`)."""

    def model_info(self) -> dict[str, Any]:
        """The /model_info body (see `model_info`)."""

    def loads(self) -> dict[str, Any]:
        """The /v1/loads body (see `loads`)."""


def create_sglang_app(
    backend: SGLangBackend,
    *,
    title: str,
    version: str,
    sglang_version: SGLangVersion = V05,
    auth: Auth | None = None,
    open_paths: Iterable[str] = (),
    on_auth_refused: Callable[[], Any] | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """A FastAPI app with SGLang's endpoints, error bodies and API-key rules over `backend`.

    `auth`: the keys (`Auth`); `open_paths` are exempt from them (the sim server's admin paths);
    `on_auth_refused` is called for each 401/403.
    """
    app = FastAPI(title=title, version=version, lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest):
        return JSONResponse(value_error_body(str(exc)), status_code=400)

    @app.exception_handler(ContractError)
    async def contract(_request: Request, exc: ContractError):
        return JSONResponse(contract_error_body(str(exc)), status_code=400)

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

    @app.get("/v1/loads")
    async def get_loads():
        return JSONResponse(backend.loads())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # http_server.py `flush_cache`: 0.5.23 answers a refused flush with FlushCacheReqOutput.message
        # or "Flush cache failed.\n"; 0.4.10 with the success text and 400.
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        if backend.flush_cache():
            return Response(text, status_code=200)
        return Response(text if sglang_version.is_04 else "Flush cache failed.\n", status_code=400)

    if auth is not None and auth.enabled:
        app.add_middleware(_AuthMiddleware, auth=auth, open_paths=frozenset(open_paths), on_refused=on_auth_refused)
    return app


__all__ = [
    "ADMIN_OPTIONAL_PATHS",
    "Auth",
    "BadRequest",
    "ContractError",
    "DECODE_LOG_INTERVAL",
    "DEFAULT_MAX_NEW_TOKENS",
    "DISCONNECT_POLL_S",
    "GenerateRequest",
    "HeldRids",
    "MalformedRequest",
    "ModelLimits",
    "SAMPLING_EPS",
    "SGLANG_VERSIONS",
    "SGLangBackend",
    "SGLangVersion",
    "SamplingParams",
    "ServerError",
    "V05",
    "abort_matcher",
    "add_server_flags",
    "contract_error",
    "contract_error_body",
    "create_sglang_app",
    "error_response",
    "finish_abort",
    "finish_length",
    "finish_reason",
    "finish_stop",
    "generate_result",
    "health_check_rid",
    "http_error_body",
    "loads",
    "model_info",
    "num_reserved_tokens",
    "parse_abort",
    "parse_generate",
    "parse_json_object",
    "parse_sampling_params",
    "queued_abort_result",
    "results_or_abort",
    "server_info",
    "text_token_ids",
    "value_error_body",
]
