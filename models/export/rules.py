"""What SGLang's and vLLM's checks of an export share: the tensor rules, and its files read in our form.

models/export/sglang.py (`validate_export`, `load_problems`) and models/export/vllm.py (`validate_export_vllm`)
both read an export through `read_export` and check it against these rules; neither imports the other.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

from safetensors import safe_open

from models.draft.config import AUX_FEATURES, MLA_KEYS
from models.export.format import CONFIG_FILE, WEIGHTS_FILE
from models.export.speculators import (
    from_speculators_config,
    from_speculators_name,
    is_speculators,
    to_speculators_name,
)

VLLM_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # registry -> Eagle3LlamaForCausalLM
MLA_ARCHITECTURES = ("Eagle3DeepseekV2ForCausalLM", "Eagle3DeepseekV3ForCausalLM")  # vLLM's two names of its MLA draft

Shape = Callable[[Mapping], tuple[int, ...]]
# name -> expected shape from the exported config.json (H hidden, Ht target hidden, hd head_dim): the Llama-style
# draft's attention, ...
LLAMA_ATTENTION_WEIGHTS: dict[str, Shape] = {
    "midlayer.self_attn.q_proj.weight": lambda c: (c["num_attention_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.k_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.v_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
}
# ... the MLA draft's (models/draft/mla.py: q_lora_rank, kv_lora_rank, qk_nope/qk_rope/v head dims; 2H input) ...
MLA_ATTENTION_WEIGHTS: dict[str, Shape] = {
    "midlayer.self_attn.q_a_proj.weight": lambda c: (c["q_lora_rank"], 2 * c["hidden_size"]),
    "midlayer.self_attn.q_a_layernorm.weight": lambda c: (c["q_lora_rank"],),
    "midlayer.self_attn.q_b_proj.weight": lambda c: (
        c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["qk_rope_head_dim"]),
        c["q_lora_rank"],
    ),
    "midlayer.self_attn.kv_a_proj_with_mqa.weight": lambda c: (
        c["kv_lora_rank"] + c["qk_rope_head_dim"],
        2 * c["hidden_size"],
    ),
    "midlayer.self_attn.kv_a_layernorm.weight": lambda c: (c["kv_lora_rank"],),
    "midlayer.self_attn.kv_b_proj.weight": lambda c: (
        c["num_attention_heads"] * (c["qk_nope_head_dim"] + c["v_head_dim"]),
        c["kv_lora_rank"],
    ),
    "midlayer.self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["v_head_dim"]),
}
# ... and what both share.
SHARED_WEIGHTS: dict[str, Shape] = {
    "fc.weight": lambda c: (c["hidden_size"], 3 * c["target_hidden_size"]),
    "midlayer.mlp.gate_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "midlayer.mlp.up_proj.weight": lambda c: (c["intermediate_size"], c["hidden_size"]),
    "midlayer.mlp.down_proj.weight": lambda c: (c["hidden_size"], c["intermediate_size"]),
    "midlayer.hidden_norm.weight": lambda c: (c["hidden_size"],),
    "midlayer.input_layernorm.weight": lambda c: (c["hidden_size"],),
    "midlayer.post_attention_layernorm.weight": lambda c: (c["hidden_size"],),
    "norm.weight": lambda c: (c["hidden_size"],),
    "lm_head.weight": lambda c: (c["draft_vocab_size"], c["hidden_size"]),
    "d2t": lambda c: (c["draft_vocab_size"],),
    "t2d": lambda c: (c["vocab_size"],),
}
# Only when draft_vocab_size < vocab_size: at D == V the map is the identity, which both engines
# assume without them, and vLLM refuses a d2t (module docstring).
VOCAB_MAP = ("d2t", "t2d")


def is_mla(cfg: Mapping) -> bool:
    """Whether an export's config.json is an MLA draft's (architecture Eagle3DeepseekV2/V3ForCausalLM)."""
    return any(a in MLA_ARCHITECTURES for a in cfg.get("architectures") or ())


def required_weights(cfg: Mapping) -> dict[str, Shape]:
    """Every tensor an export of this config must hold (our names; embed_tokens, fc_norm and input_norm apart)."""
    return {**(MLA_ATTENTION_WEIGHTS if is_mla(cfg) else LLAMA_ATTENTION_WEIGHTS), **SHARED_WEIGHTS}


# Only with config fc_norm: true (EAGLE-3.1): one RMSNorm per aux feature, [target_hidden_size] each.
FC_NORM_WEIGHTS: dict[str, Shape] = {
    f"fc_norm.{i}.weight": lambda c: (c["target_hidden_size"],) for i in range(AUX_FEATURES)
}
VARIANT_KEYS = ("fc_norm", "norm_output")  # Eagle3Config fields = config.json keys both engines read
OTHER_TRAINERS_KEYS = ("norm_before_fc", "norm_before_residual")  # Eagle3Config fields we read, never train
INT_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
    "draft_vocab_size",
    "target_hidden_size",
)
# An MLA draft's config.json: its MLA widths instead of head_dim and num_key_value_heads (DeepseekV2Config derives both)
MLA_INT_KEYS = (*(k for k in INT_KEYS if k not in ("head_dim", "num_key_value_heads")), *MLA_KEYS)
ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # torch_dtype -> safetensors dtype


def export_dtype(cfg: Mapping) -> str | None:
    """The weights' dtype a config.json states: `torch_dtype` (ours, transformers 4), else `dtype` (the key
    transformers 5 writes, e.g. in a SpecForge export); both engines read either through transformers' config."""
    found = cfg.get("torch_dtype") or cfg.get("dtype")
    return found if isinstance(found, str) else None


class ExportFiles(NamedTuple):
    """An export read for checking: its config in our form, its tensors under our names, where they are."""

    cfg: dict
    speculators: bool  # the files are in the speculators format (models/export/speculators.py)
    meta: dict[str, tuple[tuple[int, ...], str]]  # our name -> (shape, safetensors dtype such as "BF16")
    names: dict[str, str]  # our name -> the name in the file


def read_export(out_dir: str | Path) -> ExportFiles:
    """config.json and the safetensors header of an export, ours or speculators' (renamed to ours).

    Raises ValueError naming the file for what cannot be read at all.
    """
    out_dir = Path(out_dir)
    cfg, speculators = read_export_config(out_dir)
    rename = from_speculators_name if speculators else (lambda n: n)
    try:
        with safe_open(str(out_dir / WEIGHTS_FILE), framework="pt") as f:
            names = {rename(n): n for n in f.keys()}
            meta = {ours: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for ours, n in names.items()}
    except Exception as e:  # safetensors raises its own error types for a bad file
        raise ValueError(f"{WEIGHTS_FILE}: cannot read: {e}") from e
    if speculators and export_dtype(cfg) is None and "fc.weight" in meta:  # no dtype stated: the weights' own
        cfg["torch_dtype"] = {v: k for k, v in ST_DTYPES.items()}.get(meta["fc.weight"][1])
    return ExportFiles(cfg, speculators, meta, names)


def read_export_config(out_dir: Path) -> tuple[dict, bool]:
    """(config.json in our form, whether the file is in the speculators format); ValueError naming what is wrong."""
    try:
        cfg = json.loads((out_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{CONFIG_FILE}: cannot read: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"{CONFIG_FILE}: not a JSON object")
    if not is_speculators(cfg):
        return with_rope_theta(cfg), False
    try:
        return from_speculators_config(cfg), True
    except (ValueError, TypeError) as e:
        raise ValueError(f"{CONFIG_FILE} (speculators format): {e}") from e


def with_rope_theta(cfg: dict) -> dict:
    """A config with transformers 5's `rope_parameters` ({"rope_theta", "rope_type", ...}: what `save_pretrained`
    writes, e.g. SpecForge's draft class) and no `rope_theta`, in our form: `rope_theta`, and `rope_scaling` null for
    plain rope (rope_type "default"), else the rest of rope_parameters. SGLang 0.5.23 reads rope_parameters first
    (srt/models/llama.py, llama_eagle3.py), vLLM through transformers' config: both serve such a draft."""
    rope = cfg.get("rope_parameters")
    if "rope_theta" in cfg or not isinstance(rope, dict):
        return cfg
    scaling = {k: v for k, v in rope.items() if k != "rope_theta"}
    plain = set(scaling) <= {"rope_type"} and scaling.get("rope_type", "default") == "default"
    return {**cfg, "rope_theta": rope.get("rope_theta"), "rope_scaling": None if plain else scaling}


def export_name(export: ExportFiles, name: str) -> str:
    """The file's name of our tensor `name` (a missing one: the name the format would give it)."""
    return export.names.get(name) or (to_speculators_name(name) if export.speculators else name)


def norm_before_fc(cfg: Mapping) -> bool:
    """Whether a config asks for one RMSNorm over all aux features before fc: `eagle_config.norm_before_fc`, else the
    top-level key (both engines read it so: SGLang 0.5.23 and vLLM 0.32 llama_eagle3.py `LlamaModel.__init__`)."""
    eagle = cfg.get("eagle_config")
    nested = eagle.get("norm_before_fc") if isinstance(eagle, dict) else None
    return bool(nested if nested is not None else cfg.get("norm_before_fc", False))
