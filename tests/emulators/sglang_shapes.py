"""What SGLang 0.5.23 answers, as the tests of both emulations (dev server, sim server) expect it."""

from __future__ import annotations

# meta_info's keys of a finished /generate, in SGLang's order (managers/tokenizer_manager.py _handle_batch_output)
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
    "e2e_latency",
]
