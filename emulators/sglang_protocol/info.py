"""The bodies of /server_info, /v1/loads and /model_info, in SGLang 0.5.23's names, once for both servers.

The dev server and the simulated server (emulators/dev_server/backend.py, emulators/sim/backend.py) each
pass in what they are; the fields and their layout are here. ``GET /v1/loads``: the running and waiting
counts (entrypoints/v1_loads.py), which /server_info does not have.
"""

from __future__ import annotations

from typing import Any

from emulators.sglang_protocol.limits import ModelLimits
from emulators.sglang_protocol.results import WEIGHT_VERSION

# srt/arg_groups/fields/observability.py decode_log_interval = 40 (0.4.10: ServerArgs, also 40).
# The decode batches between folds of avg_spec_accept_length, which /server_info reports (`server_info`).
DECODE_LOG_INTERVAL = 40


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
