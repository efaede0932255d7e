"""Kimi-K2.5's config.json (tests/kimi_k25_config.json), for code that reads a target's shape from it.

Only the fields that code reads, with the values of docs/kimi-k25.md and REFERENCE.md (the MLA widths and YaRN are
DeepSeek-V3's, which Kimi-K2 keeps: moonshotai/Kimi-K2-Instruct-0905 config.json): a text config in the
DeepSeek-V3 style (MLA: kv_lora_rank), nested under `text_config` as the multimodal checkpoint has it. The MoE
fields (384 routed experts of width 2048, one shared, the first layer dense) and the compressed-tensors
`quantization_config` (int4, a scale per group of 32, attention, shared experts, dense MLPs and lm_head ignored)
are the published text config's, for the memory plan (tasks/capture/memory.py). The target itself is too large to
build here; this is what our readers see of it.
"""

from __future__ import annotations

import json
from pathlib import Path

CONFIG_JSON = Path(__file__).with_name("kimi_k25_config.json")


def kimi_k25_config() -> dict:
    """The config.json as a dict (a fresh copy each call)."""
    return json.loads(CONFIG_JSON.read_text())
