"""Sampling parameters: `SamplingParams`, parsed and checked with SGLang 0.5.23's defaults, types and words.

srt/sampling/sampling_params.py: ``max_new_tokens`` default 128, ``temperature`` (below ``_SAMPLING_EPS``
= 1e-6: greedy), ``top_p``, ``top_k`` (-1 = off), ``stop_token_ids``, ``ignore_eos``,
``skip_special_tokens``, ``no_stop_trim``, ``sampling_seed``, range-checked as ``SamplingParams.verify``
does. The params SGLang knows but these servers do not implement are ignored, or refused unless they
have their no-op values (`parse_sampling_params`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from emulators.sglang_protocol.errors import BadRequest, MalformedRequest

SAMPLING_EPS = 1e-6  # SGLang treats 0 <= temperature < 1e-6 as greedy
DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when a request gives none


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
