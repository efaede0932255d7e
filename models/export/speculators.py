"""The speculators format (vLLM's `speculators` library) of an EAGLE-3 draft, mapped to and from our export.

A speculators EAGLE-3 directory, as speculators 0.9.0 saves it (src/speculators/models/eagle3/config.py
`Eagle3SpeculatorConfig`, core.py `Eagle3DraftModel`, convert/eagle/eagle3_converter.py) and vLLM 0.32 reads it
(vllm/transformers_utils/configs/speculators/{base,algos}.py, transformers_utils/config.py):

- config.json: `speculators_model_type: "eagle3"`, `architectures: ["Eagle3Speculator"]`, `transformer_layer_config`
  (a transformers LlamaConfig dict of the one layer: sizes, rms_norm_eps, RoPE, max_position_embeddings, and
  `vocab_size` = the target's; keys left out take LlamaConfig's defaults, as speculators' own validator rebuilds
  it), `draft_vocab_size`, `target_hidden_size`, `norm_before_residual`, `norm_before_fc`, `fc_norm`, `norm_output`,
  the top-level `eagle_aux_hidden_state_layer_ids` (vLLM's capture indices: i = the state entering target layer i),
  and `speculators_config: {algorithm, proposal_methods: [{proposal_type: greedy, speculative_tokens, ...}],
  default_proposal_method, verifier: {name_or_path, architectures}}`.
- vLLM detects the format by the `speculators_config` key; `vllm serve DRAFT` serves the verifier's name_or_path
  with the draft (`maybe_override_with_speculators`), the method eagle3 and `speculative_tokens` draft tokens.
  Its `update_eagle3` takes `norm_before_residual` as TRUE when the key is absent (speculators' own default is
  false, and it always writes the key): we read an absent key as vLLM serves it.
- model.safetensors: the layer as `layers.0.*` (our and SGLang's `midlayer.*`); `fc.weight`, `norm.weight`,
  `lm_head.weight`, `d2t`, `t2d`, `embed_tokens.weight` (optional), `input_norm.weight` (norm_before_fc),
  `fc_norm.{i}.weight` keep their names; `verifier_*` are never saved (core.py `_keys_to_ignore_on_save`).
- SGLang 0.5.23 does not read the format (no `speculators_config` anywhere in it): `eagle3 export --format sglang`
  writes our export from it.

Our aux ids are SGLang's (the output of 0-based layer a) = vLLM's capture index a + 1 (models/export/sglang.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from models.export.format import ARCHITECTURE, VLLM_AUX_KEY, vllm_aux_ids

SPECULATORS_KEY = "speculators_config"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
_LAYER, _OUR_LAYER = "layers.0.", "midlayer."
_FLAGS = ("norm_before_fc", "fc_norm", "norm_output")  # absent = false in vLLM's update_eagle3 and in speculators
# The layer's transformers keys that our export writes and the speculators layer config carries.
_LAYER_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "num_hidden_layers",
    "hidden_act",
    "rms_norm_eps",
    "max_position_embeddings",
    "vocab_size",
    "attention_bias",
    "mlp_bias",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


def is_speculators(cfg: Any) -> bool:
    """Whether a config.json dict is in the speculators format (vLLM's test: a `speculators_config` key)."""
    return isinstance(cfg, Mapping) and cfg.get(SPECULATORS_KEY) is not None


def from_speculators_name(name: str) -> str:
    """Our export's name of a speculators tensor (`layers.0.x` -> `midlayer.x`; the rest as is)."""
    return _OUR_LAYER + name.removeprefix(_LAYER) if name.startswith(_LAYER) else name


def to_speculators_name(name: str) -> str:
    """The speculators name of one of our export's tensors (`midlayer.x` -> `layers.0.x`)."""
    return _LAYER + name.removeprefix(_OUR_LAYER) if name.startswith(_OUR_LAYER) else name


def from_speculators_config(cfg: Mapping) -> dict[str, Any]:
    """Our export's config.json (models/export/eagle3.py `sglang_config`'s keys) of a speculators config.json.

    Raises ValueError, saying what to do, for what our draft cannot be: another algorithm, a non-Llama layer, no
    aux layer ids. The result is checked like any export (validate_export, validate_export_vllm).
    """
    from transformers import LlamaConfig

    kind = cfg.get("speculators_model_type")
    if kind != "eagle3":
        raise ValueError(f"speculators_model_type {kind!r}: only speculators' eagle3 drafts are EAGLE-3 drafts")
    layer = cfg.get("transformer_layer_config")
    if not isinstance(layer, Mapping):
        raise ValueError("speculators config.json has no transformer_layer_config object (the draft layer's shape)")
    model_type = layer.get("model_type", "llama")
    if model_type != "llama":
        raise ValueError(
            f"transformer_layer_config.model_type {model_type!r}: only Llama-layer drafts are read (vLLM also serves "
            "qwen3 layers, whose q/k norms this draft model does not have)"
        )
    ids = cfg.get(VLLM_AUX_KEY)
    if not (isinstance(ids, list) and ids and all(isinstance(i, int) and not isinstance(i, bool) for i in ids)):
        raise ValueError(
            f"{VLLM_AUX_KEY} {ids!r}: the draft does not say which target layers it reads; write them into its "
            "config.json as vLLM capture indices (speculators' default for L layers: [2, L//2, L-3])"
        )
    full = {**LlamaConfig(**{k: v for k, v in layer.items() if k != "model_type"}).to_dict(), **layer}
    rope = full.get("rope_parameters") or full.get("rope_scaling") or {}
    scaling = None if rope.get("rope_type", rope.get("type", "default")) == "default" else dict(rope)
    hidden = full["hidden_size"]
    out: dict[str, Any] = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        **{key: full.get(key) for key in _LAYER_KEYS},
        "rope_theta": full.get("rope_theta") or rope.get("rope_theta") or 10000.0,
        "rope_scaling": scaling,
        "draft_vocab_size": cfg.get("draft_vocab_size") or full["vocab_size"],
        "target_hidden_size": cfg.get("target_hidden_size") or hidden,
        "tie_word_embeddings": False,  # the draft's lm_head is its own tensor (speculators never ties it)
        "norm_before_residual": cfg.get("norm_before_residual", True),  # vLLM's reading of an absent key
        **{flag: cfg.get(flag, False) for flag in _FLAGS},
        "eagle_config": {VLLM_AUX_KEY: [i - 1 for i in ids], "use_aux_hidden_state": True},
        VLLM_AUX_KEY: list(ids),
    }
    dtype = full.get("torch_dtype") or full.get("dtype") or cfg.get("torch_dtype") or cfg.get("dtype")
    if dtype is not None:
        out["torch_dtype"] = str(dtype).removeprefix("torch.")
    return out


def to_speculators_config(export: Mapping, *, verifier: str, verifier_architectures: list[str], num_steps: int) -> dict:
    """The speculators config.json of one of our exports' config.json: `vllm serve DIR` serves `verifier` with it,
    `num_steps` draft tokens per round (greedy proposals, as our eval decodes). An MLA draft has no speculators form
    (speculators 0.9.0 builds Llama and Qwen3 layers only): ValueError."""
    if export.get("architectures") != [ARCHITECTURE]:
        raise ValueError(
            f"architectures {export.get('architectures')}: the speculators format holds Llama-layer drafts only; "
            'serve this draft from its own export (vLLM: --speculative-config \'{"method": "eagle3", '
            '"model": DIR}\')'
        )
    layer = {key: export[key] for key in _LAYER_KEYS if export.get(key) is not None}
    layer.update(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        rope_theta=export["rope_theta"],
        rope_scaling=export.get("rope_scaling"),
        tie_word_embeddings=False,
        torch_dtype=export["torch_dtype"],
    )
    aux = export["eagle_config"][VLLM_AUX_KEY]
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": layer,
        "draft_vocab_size": export["draft_vocab_size"],
        "target_hidden_size": export["target_hidden_size"],
        "norm_before_residual": bool(export.get("norm_before_residual", False)),
        **{flag: bool(export.get(flag, False)) for flag in _FLAGS},
        VLLM_AUX_KEY: vllm_aux_ids(list(aux)),
        "torch_dtype": export["torch_dtype"],
        SPECULATORS_KEY: {
            "algorithm": "eagle3",
            "proposal_methods": [
                {
                    "proposal_type": "greedy",
                    "speculative_tokens": int(num_steps),
                    "verifier_accept_k": 1,
                    "accept_tolerance": 0.0,
                }
            ],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": verifier, "architectures": list(verifier_architectures)},
        },
    }
