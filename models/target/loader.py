"""The target's language model as it is published: a causal LM, or the text model inside a multimodal wrapper.

Kimi-K2.5 is published as a `kimi_k25` checkpoint: a multimodal config whose `text_config` is DeepSeek-V3's and
weights named `language_model.model.*`, `language_model.lm_head.weight` beside a vision tower's.
transformers' AutoModelForCausalLM refuses such a config ("Unrecognized configuration class Kimi_K25Config"),
and the wrapper class (AutoModelForImageTextToText) would build the vision tower too. Capture, the online
train source and the in-process eval need the language model alone, so `load_language_model` builds the
causal LM of the text config and loads the wrapper's `language_model.*` tensors into it by name
(`from_pretrained(config=text_config, key_mapping=...)`): no converted copy is written, the vision tower is
never built, and under ZeRO-3 the weights are still created partitioned (HfDeepSpeedConfig acts inside
from_pretrained).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Any, cast

import torch

from models.target.weights import checkpoint_dir, find_tensor_name, weight_map

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EMBED = "model.embed_tokens.weight"  # the causal LM's input embedding, under any wrapper's prefix


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal config's text config, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_config(target_path: str, *, trust_remote_code: bool = False) -> Any:
    """The target's transformers config (the wrapper's, for a multimodal checkpoint)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target_path, trust_remote_code=trust_remote_code)


def wrapper_prefix(target_path: str) -> str:
    """The prefix of the language model's weights in the checkpoint ("" for a plain causal LM, "language_model."
    for Kimi-K2.5's), read from the tensor names (the index, or the single file's header)."""
    names = weight_map(checkpoint_dir(target_path))
    embed = find_tensor_name(names, "embed_tokens.weight")
    if embed is None or not embed.endswith(EMBED):
        raise ValueError(
            f"{target_path}: no language model embedding (*{EMBED}) among the checkpoint's tensors; "
            "is it a causal LM checkpoint?"
        )
    return embed[: -len(EMBED)]


def load_language_model(
    target_path: str, *, dtype: torch.dtype, trust_remote_code: bool = False, config: Any = None, **kwargs: Any
) -> PreTrainedModel:
    """The target's causal language model (transformers), from a plain or a multimodal (kimi_k25) checkpoint.

    `config`: the target's config when the caller has read it already. `kwargs` go to from_pretrained
    (`device_map`, ...).
    """
    from transformers import AutoModelForCausalLM

    config = config if config is not None else load_config(target_path, trust_remote_code=trust_remote_code)
    text = text_config(config)
    if text is config:
        return AutoModelForCausalLM.from_pretrained(
            target_path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    prefix = wrapper_prefix(target_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        target_path,
        config=text,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        key_mapping={f"^{re.escape(prefix)}": ""},
        output_loading_info=True,
        **kwargs,
    )
    model, info = cast(tuple[Any, dict], loaded)  # output_loading_info=True: (model, {"missing_keys", ...})
    if info.get("missing_keys"):  # transformers only warns: the model would run on random weights
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{target_path}: {len(missing)} weights of the language model are not in the checkpoint under "
            f"{prefix!r} (first: {missing[:3]}); is it a {type(config).__name__} checkpoint as published?"
        )
    return model
