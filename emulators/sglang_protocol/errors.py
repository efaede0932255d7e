"""SGLang's error bodies and the exceptions that produce them (`BadRequest`, ..., `error_response`).

Checked against SGLang 0.5.23's source -- three 400 shapes:

- Bad input that SGLang rejects with a ``ValueError`` (``GenerateReqInput`` normalisation, the
  duplicate rid, ``TokenizerManager._validate_one_request`` / ``_validate_input_ids_in_vocab``,
  ``SamplingParams.verify``, the scheduler's ``validate_input_length``): HTTP 400 with
  ``{"error": {"message": "..."}}`` -- entrypoints/http_server.py ``_create_error_response``.
  Raise `BadRequest`. Length messages are SGLang's words, e.g. ``"The input (N tokens) is longer
  than the model's context length (M tokens)."``; ``prompt_tokens + max_new_tokens >
  context_length`` is an error too (``validate_total_tokens`` is on and ``--allow-auto-truncate``
  off by default), and a prompt of ``max_req_input_len`` tokens or more is refused as SGLang's
  scheduler does. With an EAGLE draft both tokenizer checks add the reserved tokens (`ModelLimits`, limits.py).
- A body the ``GenerateReqInput`` dataclass parse admits but the API schema refuses
  (entrypoints/http_server.py ``generate_request`` -> entrypoints/api_contract.py
  ``generate_contract_error`` -> api/v1/api_types.py ``decode_GenerateRequest``): HTTP 400 with
  ``{"error": "<the schema's text>"}``, e.g. an unknown sampling param (``unknown field `foo`,
  expected one of ...``), a sampling param of the wrong JSON type (``invalid type: string "hot",
  expected f64``) or a JSON ``true`` among the input_ids (``invalid type: boolean `true`, expected
  i64``). Raise `ContractError` (`contract_error` in contract.py finds it).
- Malformed JSON or a field the dataclass parse refuses (FastAPI's ``RequestValidationError``):
  HTTP 400 with ``{"object": "error", "message": "...", "type": "Bad Request", "param": null,
  "code": 400}`` -- http_server.py ``validation_exception_handler``. Raise `MalformedRequest`.
- Other statuses (a failure inside the model: 500, not serving: 503): ``{"object": "error",
  "message": ..., "type": "<status>", "param": null, "code": <status>}`` (SGLang's
  ``HTTPException`` handler shape). Raise `ServerError`. Auth refusals: 401 ``{"error": "Unauthorized"}`` (auth.py).
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


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
