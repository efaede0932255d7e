"""Finish reasons and the answers to finished requests, in SGLang 0.5.23's shapes (0.4.x's where they differ).

A finished request is answered as srt/managers/tokenizer_manager.py ``_handle_batch_output``
builds it: ``{"text", "output_ids", "meta_info": {"id", "finish_reason", "prompt_tokens",
"weight_version": "default", "num_retractions": 0, "reasoning_tokens", "completion_tokens",
"cached_tokens", "weight_versions": [{"version": "default", "start": 0, "end": n}], "e2e_latency"}}``
(plus ``spec_verify_ct``, the verify rounds, from a server decoding with a draft) -- `generate_result`.
``finish_reason`` is ``{"type": "stop", "matched": id}``, ``{"type": "length", "length": n}`` or an
abort. ``output_ids`` keep a matched stop token; ``text`` drops it unless ``no_stop_trim``
(``DetokenizerManager.trim_matched_stop``). A stop token is checked BEFORE the length cap
(srt/managers/schedule_batch.py ``Req.update_finish_state``): a stop token that is the
max_new_tokens-th token finishes ``stop``; speculative decoding that finds a stop beyond the cap
finishes ``length`` at the cap (``_cap_finished_len_at_max_new_tokens``).

A request aborted while still queued is answered (200) as tokenizer_manager.py ``_handle_abort_req``
builds it (`queued_abort_result`: no prompt_tokens); a running one finishes through the normal output
path with ``FINISH_ABORT().to_json()`` = ``{"type": "abort", "message": "Aborted", "status_code": null,
"err_type": null}`` and the tokens generated so far.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from emulators.sglang_protocol.versions import V05, SGLangVersion

WEIGHT_VERSION = "default"  # srt/arg_groups/fields/serving.py weight_version


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
