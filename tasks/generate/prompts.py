"""Prompt token ids and per-request sampling parameters for SGLang's /generate."""

from __future__ import annotations

import hashlib
from typing import Any


def chat_prompt_ids(tokenizer: Any, messages: list[dict[str, str]], tools: list[dict] | None = None) -> list[int]:
    """Render `messages` (and the row's tool definitions, `tools`) with the target's chat template plus the
    generation prompt, as token ids.

    SGLang's /generate applies no template, so this is where the prompt format is decided: by the
    target's own tokenizer, exactly as the model was trained to see it.
    """
    extra = {"tools": tools} if tools else {}
    encoded = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **extra
    )
    ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded  # transformers 4 returned a list
    return [int(i) for i in ids]


def default_stop_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's end-of-sequence id(s), the stop tokens when the config names none."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the target tokenizer has no eos token: set sampling.stop_token_ids in the config")
    return [int(e) for e in eos] if isinstance(eos, (list, tuple)) else [int(eos)]


def request_sampling_params(sampling: dict[str, Any], stop_token_ids: list[int]) -> dict[str, Any]:
    """SGLang `sampling_params` for one request from the configured sampling.

    Special tokens are kept and the stop token is not trimmed, so `output_ids` and `text` hold the
    exact sequence the target produced, end-of-turn token included (training needs it).
    """
    params = {k: v for k, v in sampling.items() if v is not None and k not in ("stop_token_ids", "seed")}
    params["stop_token_ids"] = list(stop_token_ids)
    params["skip_special_tokens"] = False
    params["no_stop_trim"] = True
    return params


def prompt_sampling_seed(seed: int, dataset: str, prompt_id: str) -> int:
    """SGLang `sampling_seed` for one prompt: a hash of (seed, dataset, prompt id), in [0, 2**31).

    A function of the prompt alone, so its response is the same whatever else is in flight; below
    2**31 because SGLang versions have held the seeds of a batch in an int32 tensor.
    """
    digest = hashlib.sha256(f"{seed}\0{dataset}\0{prompt_id}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF
