"""Request bodies: a /generate body split into items (`parse_generate`), an /abort_request body (`parse_abort`).

- ``POST /generate`` -- ``text`` or ``input_ids`` (single or batch), ``sampling_params``
  (sampling.py; one object for the batch or a list, one per item), ``rid`` (a string, or a list
  for a batch). ``stream=true`` is refused (400): streaming is not implemented. A batch is answered
  with a list in input order. Parsed in SGLang 0.5.23's order: the ``GenerateReqInput`` dataclass
  parse (FastAPI, pydantic; input_ids by srt/utils/field_validators.py), then the contract gate
  (contract.py), then ``GenerateReqInput``'s normalisation (ValueErrors).
- ``POST /abort_request`` ``{"rid": ...}`` or ``{"abort_all": true}`` (io_struct.py ``AbortReq``);
  which requests it reaches: rids.py.

Deliberate differences from SGLang: ``text`` and ``input_ids`` together are refused (SGLang lets
text win); only the fields above are parsed (others are ignored, the schema gate included).
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any

from emulators.sglang_protocol.contract import contract_error
from emulators.sglang_protocol.errors import BadRequest, ContractError, MalformedRequest
from emulators.sglang_protocol.versions import V05, SGLangVersion


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
