"""What SGLang 0.5.23 answers, as the tests of both emulations (dev server, sim server) expect it."""

from __future__ import annotations

# meta_info's keys of a finished /generate, in SGLang's order (managers/tokenizer_manager.py _handle_batch_output,
# then _wait_one_response's response_sent_to_client_ts), as the real 0.5.23 answered on CPU (tests marked sglang)
FINISHED_META = [
    "id",
    "finish_reason",
    "prompt_tokens",
    "weight_version",
    "num_retractions",
    "reasoning_tokens",
    "completion_tokens",
    "cached_tokens",
    "weight_versions",
    "cached_tokens_details",
    "dp_rank",
    "e2e_latency",
    "response_sent_to_client_ts",
]
