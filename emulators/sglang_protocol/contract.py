"""The /generate contract gate: what SGLang 0.5.23's API schema refuses in a parsed body (`contract_error`).

entrypoints/http_server.py ``generate_request`` -> entrypoints/api_contract.py ``generate_contract_error``
-> api/v1/api_types.py ``decode_GenerateRequest``, the Python twin of the Rust decoder, with serde's
words (``unknown field `foo`, expected one of ...``, ``invalid type: string "hot", expected f64``):
raised as `ContractError`, answered 400 ``{"error": "<text>"}`` (errors.py). SGLang 0.4.x has no such
gate (`SGLangVersion.contract_gate`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from emulators.sglang_protocol.errors import ContractError


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
