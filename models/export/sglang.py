"""What SGLang does with an export (models/export/eagle3.py), mirrored: `validate_export`.

The directory holds `config.json` and `model.safetensors`. What SGLang does with them (read in
sgl-project/sglang python/sglang/srt/models/llama_eagle3.py, sglang/srt/models/llama.py,
sglang/srt/speculative/eagle_worker.py, sglang/srt/model_executor/model_runner.py):

- `LlamaForCausalLMEagle3.load_weights`: a name containing "d2t" becomes
  `hot_token_id = d2t + arange(D)` (draft index -> target id); "t2d" is skipped; without d2t
  `hot_token_id` stays None and the draft's top-k indices are used as target ids as they are
  (sglang 0.5.23 sglang/srt/models/llama_eagle3.py `load_weights`, speculative/eagle_worker_v2.py
  `init_lm_head` / `draft_forward`): right when D == V, silently wrong when D < V; q/k/v_proj are
  fused into qkv_proj and gate/up_proj into gate_up_proj; any other name is looked up as is or as
  `model.{name}` and SILENTLY DROPPED when neither exists (the parameter keeps its random init).
  Hence `validate_export` rejects every name outside `SGLANG_REQUIRED_WEIGHTS` + embed_tokens.
- `embed_tokens.weight` is loaded when present. `EAGLEWorker.init_lm_head` then calls
  `set_embed(target embedding)`, which `LlamaForCausalLM.set_embed` skips when
  `target_hidden_size != hidden_size`: there the file's copy is the only embedding (missing ->
  uninitialized). We always write it (it is the frozen target embedding): right in both cases, at
  a cost of V*H (Kimi: 163840 x 7168 = 2.3 GB in bf16). Required by `validate_export` only when
  the two sizes differ.
- config: `draft_vocab_size: null` makes SGLang take the target's full lm_head and
  `tie_word_embeddings: true` makes lm_head = embed_tokens, so both are written explicitly;
  `fc` is Linear(3 * target_hidden_size, hidden_size); the layer is SGLang's Llama attention/MLP
  (head_dim, heads, kv heads, rms_norm_eps, rope_theta, rope_scaling, max_position_embeddings
  for the RoPE cache; LlamaMLP raises unless hidden_act == "silu"); num_hidden_layers 1 (more
  would add `BasicDecoderLayer`s).
- EAGLE-3.1 (`Eagle3Config.fc_norm`, `norm_output`): config keys `fc_norm` and `norm_output`, both
  written (false for EAGLE-3, which both engines also assume when they are absent), and with fc_norm
  the tensors `fc_norm.{0,1,2}.weight` [target_hidden_size]: SGLang 0.5.23 builds `self.fc_norm`
  from `fc_norm` (or its legacy `use_aux_norm`, whose weights it renames from `aux_norm_low/mid/
  high`) and looks `fc_norm.i.weight` up as `model.fc_norm.i.weight`; `norm_output` makes the draft
  return its post-norm state as the one the next step reads. Neither key exists in older engines,
  which would serve a 3.1 draft as EAGLE-3 without a word. `use_aux_norm` is refused (vLLM does not read it).
- Other trainers' options (speculators' training defaults), which we read and never train:
  `norm_before_fc` (one RMSNorm over the whole concatenation, weight `input_norm.weight`
  [3 * target_hidden_size]; SGLang 0.5.23 reads `eagle_config.norm_before_fc`, else the top-level key)
  and `norm_before_residual` (the layer's residual is hidden_norm(h)): vLLM reads it, SGLang 0.5.23's
  layer ignores it, so `validate_export` refuses it and `load_problems` (what our eval loads) does not.
  Other trainers' drafts in the speculators format are read through models/export/speculators.py.
- The MLA draft (`Eagle3Config.draft_arch: mla`, models/draft/mla.py): `architectures
  ["Eagle3DeepseekV2ForCausalLM"]`, SGLang 0.5.23's srt/models/kimi_k25_eagle3.py (its `EntryClass`), `model_type
  deepseek_v2`, the target's MLA widths (q_lora_rank required: the class raises without it), no head_dim; weights
  `midlayer.self_attn.{q_a_proj, q_a_layernorm, q_b_proj, kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj}`
  (its load_weights fuses q_a_proj with kv_a_proj_with_mqa, maps `layers.0.` to `midlayer.`, skips unknown names
  with a warning); `fc_norm`/`norm_output` read, `norm_before_residual` and `norm_before_fc` not (its
  Eagle3MLADecoderLayer keeps the raw residual and has no input_norm); `rope_scaling` is the rope it was trained
  with: the target's YaRN, or null.
- RoPE: `rope_scaling` is the rope the draft was trained with: null (plain RoPE at `rope_theta`), or the target's
  YaRN (`train.draft_rope: target` on a YaRN target such as Kimi). SGLang 0.5.23's LlamaDecoderLayer (llama.py)
  and vLLM 0.32's (llama.py) build it with get_rope, i.e. `YaRNScalingRotaryEmbedding`; models/draft/rope.py
  applies it the same way, and a rope_scaling whose keys the two engines read differently is refused.
  max_position_embeddings is the target's, so long contexts fit.

The same directory is what vLLM serves: models/export/vllm.py mirrors its loader (`validate_export_vllm`).

Aux layer ids, one convention per engine. Ours (`Eagle3Config.aux_layers`, models/capture/job.py):
id a = the OUTPUT of 0-based decoder layer a = transformers' `hidden_states[a + 1]`.
- vLLM: `_get_eagle3_aux_layers_from_config` takes the TOP-LEVEL `eagle_aux_hidden_state_layer_ids`
  first (falling back to `eagle_config`'s, unshifted) and `LlamaModel.forward` appends the INPUT
  of layer idx (`hidden_states + residual` before calling layer idx): capture index, 0 = the
  embedding output. Ours a -> vLLM a + 1. Written top level: `[a + 1 for a in aux_layers]`.
- SGLang: `ModelRunner` reads `eagle_config.eagle_aux_hidden_state_layer_ids` and
  `set_eagle3_layers_to_capture` turns id j into capture index j + 1 (llama.py: "for the ith
  layer, it takes the output of the (i-1)th layer"), i.e. id j = output of layer j = ours. Newer
  SGLang versions (sgl-project/sglang PR #25454, merged 2026-05-16) add the 1 only when the FIRST
  id is 1 and use the ids as capture indices (vLLM's convention) otherwise. The two versions agree
  exactly when the first id is 1, so the export
  writes `eagle_config.eagle_aux_hidden_state_layer_ids = aux_layers` and refuses `aux_layers[0] != 1`
  (`default_aux_layers` gives [1, L//2 - 1, L - 4]; Kimi: ours/SGLang [1, 29, 57], vLLM [2, 30, 58]).
- both engines capture in layer order and concatenate in that order, and SGLang's Llama-style
  loop (like vLLM's before vllm-project/vllm PR #36063, which added capture index L) never reaches
  the last layer's output: the export refuses aux layers that are not increasing or that include
  layer L - 1 of the target.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open

from models.draft.config import AUX_FEATURES
from models.draft.rope import rope_scaling_problems
from models.export.format import (
    ARCHITECTURE,
    CONFIG_FILE,
    EMBED,
    INPUT_NORM,
    MLA_ARCHITECTURE,
    MLA_MODEL_TYPE,
    WEIGHTS_FILE,
)
from models.export.rules import (
    FC_NORM_WEIGHTS,
    INT_KEYS,
    MLA_INT_KEYS,
    OTHER_TRAINERS_KEYS,
    ST_DTYPES,
    VARIANT_KEYS,
    VOCAB_MAP,
    Shape,
    export_dtype,
    export_name,
    is_mla,
    norm_before_fc,
    read_export,
    read_export_config,
    required_weights,
)

_EMBED_SHAPE: Shape = lambda c: (c["vocab_size"], c["hidden_size"])  # noqa: E731


def validate_export(out_dir: str | Path) -> list[str]:
    """Problems that would make SGLang fail, or silently serve something else; [] when fine.

    Checks config.json keys, every required tensor (name, shape, dtype), no unknown names, and
    d2t/t2d: draft ids = arange(D) + d2t strictly increasing inside the vocab, t2d marking exactly them.
    d2t/t2d are optional when draft_vocab_size == vocab_size (SGLang then maps draft id i to target
    id i, the only possible map); `validate_export_vllm` refuses d2t there. A speculators-format
    draft is refused: SGLang 0.5.23 does not read that format.
    """
    return _problems(out_dir, sglang=True)


def load_problems(out_dir: str | Path) -> list[str]:
    """What stops `load_exported_draft` from loading a draft exactly as trained; [] when fine.

    `validate_export`'s checks less SGLang's own limits (the first aux id 1, norm_before_residual, its format),
    for our exports and for other trainers' drafts, in the speculators format too.
    """
    return _problems(out_dir, sglang=False)


def _problems(out_dir: str | Path, *, sglang: bool) -> list[str]:
    out_dir = Path(out_dir)
    try:
        cfg, speculators = read_export_config(out_dir)
    except ValueError as e:
        return [str(e)]
    if sglang and speculators:
        return [
            f"{CONFIG_FILE}: the speculators format (a speculators_config key), which SGLang 0.5.23 does not read; "
            f"write our export from it: eagle3 export CONFIG --draft {out_dir} --format sglang --out DIR"
        ]
    problems = _config_problems(cfg, sglang=sglang)
    if problems:
        return problems  # shapes cannot be derived from a broken config
    try:
        export = read_export(out_dir)
    except ValueError as e:
        return [str(e)]
    cfg, names, meta = export.cfg, set(export.meta), export.meta

    rules = {**required_weights(cfg), **(FC_NORM_WEIGHTS if cfg.get("fc_norm") else {})}
    if norm_before_fc(cfg):
        rules[INPUT_NORM] = lambda c: (AUX_FEATURES * c["target_hidden_size"],)
    rules[EMBED] = _EMBED_SHAPE
    if EMBED not in names and cfg["hidden_size"] != cfg["target_hidden_size"]:
        problems.append(
            f"missing {EMBED}: SGLang shares the target's embedding only when hidden_size == target_hidden_size"
        )
    float_dtype = ST_DTYPES[str(export_dtype(cfg))]
    optional = {EMBED, *VOCAB_MAP} if cfg["draft_vocab_size"] == cfg["vocab_size"] else {EMBED}
    for name, rule in rules.items():
        if name not in names:
            if name not in optional:
                problems.append(f"missing tensor {export_name(export, name)}")
            continue
        shape, dt = meta[name]
        if shape != rule(cfg):
            problems.append(f"{export_name(export, name)}: shape {list(shape)} != expected {list(rule(cfg))}")
        want = "I64" if name == "d2t" else "BOOL" if name == "t2d" else float_dtype
        if dt != want:
            problems.append(f"{export_name(export, name)}: dtype {dt} != {want}")
    skipped = "SGLang would silently skip it" if sglang else "the draft model has no such tensor"
    problems += [f"unknown tensor {export.names[n]}: {skipped}" for n in sorted(names - set(rules))]
    if "d2t" in names and not any(n.startswith(("d2t", "t2d")) for n in problems):
        with safe_open(str(out_dir / WEIGHTS_FILE), framework="pt") as f:
            d2t = f.get_tensor(export.names["d2t"])
            t2d = f.get_tensor(export.names["t2d"]) if "t2d" in names else None
        ids = torch.arange(d2t.shape[0], dtype=torch.int64) + d2t.to(torch.int64)
        if ids.numel() and (ids.min() < 0 or ids.max() >= cfg["vocab_size"] or not torch.all(ids[1:] > ids[:-1])):
            problems.append("d2t: draft ids (arange + d2t) are not strictly increasing ids inside the vocab")
        elif t2d is not None:
            expected = torch.zeros(t2d.shape[0], dtype=torch.bool)
            expected[ids] = True
            if not torch.equal(expected, t2d.bool()):
                problems.append("t2d does not mark exactly the target ids of d2t")
    return problems


def _config_problems(cfg: dict, *, sglang: bool = True) -> list[str]:
    p = []
    mla = is_mla(cfg)
    if cfg.get("architectures") not in ([ARCHITECTURE], [MLA_ARCHITECTURE]):
        p.append(
            f"architectures {cfg.get('architectures')!r}: neither [{ARCHITECTURE!r}] (the Llama-style draft) nor "
            f"[{MLA_ARCHITECTURE!r}] (the MLA draft)"
        )
    model_type = MLA_MODEL_TYPE if mla else "llama"
    if cfg.get("model_type") != model_type:
        p.append(f"model_type {cfg.get('model_type')!r} != {model_type!r}")
    for key in MLA_INT_KEYS if mla else INT_KEYS:
        v = cfg.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            p.append(f"config {key} must be a positive int, got {v!r}")
    if not p and cfg["draft_vocab_size"] > cfg["vocab_size"]:
        p.append(f"draft_vocab_size {cfg['draft_vocab_size']} > vocab_size {cfg['vocab_size']}")
    if cfg.get("num_hidden_layers") != 1:
        p.append(f"num_hidden_layers {cfg.get('num_hidden_layers')!r} != 1")
    if cfg.get("tie_word_embeddings") is not False:
        p.append("tie_word_embeddings must be false (true makes SGLang use embed_tokens as lm_head)")
    if cfg.get("hidden_act") != "silu":
        p.append(f"hidden_act {cfg.get('hidden_act')!r}: SGLang's LlamaMLP supports only 'silu'")
    p += _rope_problems(cfg.get("rope_scaling"))
    if mla:
        if norm_before_fc(cfg):
            p.append(
                "norm_before_fc: neither engine's MLA draft has an input_norm (SGLang 0.5.23 kimi_k25_eagle3.py, "
                "vLLM 0.32 deepseek_eagle3.py)"
            )
    for key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            p.append(f"config {key} must be a positive number, got {cfg.get(key)!r}")
    if export_dtype(cfg) not in ST_DTYPES:
        stated = cfg.get("torch_dtype") or cfg.get("dtype")
        p.append(f"torch_dtype (or dtype) {stated!r} not one of {sorted(ST_DTYPES)}")
    eagle = cfg.get("eagle_config")
    ids = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
    if not (
        isinstance(ids, list)
        and len(ids) == 3
        and len(set(ids)) == 3
        and all(isinstance(i, int) and i >= 0 for i in ids)
    ):
        p.append(f"eagle_config.eagle_aux_hidden_state_layer_ids must be 3 distinct layer ids, got {ids!r}")
    elif sglang and ids[0] != 1:
        p.append(
            f"eagle_config.eagle_aux_hidden_state_layer_ids {ids}: first id must be 1 "
            "(SGLang versions read other lists differently)"
        )
    if not isinstance(eagle, dict) or eagle.get("use_aux_hidden_state") is not True:
        p.append("eagle_config.use_aux_hidden_state must be true")
    for key in (*VARIANT_KEYS, *OTHER_TRAINERS_KEYS):
        if not isinstance(cfg.get(key, False), bool):
            p.append(f"config {key} must be true or false, got {cfg[key]!r}")
    if cfg.get("use_aux_norm"):
        p.append("use_aux_norm: SGLang's legacy name of fc_norm; vLLM does not read it (write fc_norm)")
    if norm_before_fc(cfg) and cfg.get("fc_norm"):
        p.append("norm_before_fc and fc_norm are both set: one RMSNorm over all aux features, or one per feature")
    if sglang and cfg.get("norm_before_residual"):
        layer = "kimi_k25_eagle3.py Eagle3MLADecoderLayer" if mla else "llama_eagle3.py LlamaDecoderLayer"
        p.append(
            f"norm_before_residual: SGLang 0.5.23 (srt/models/{layer}) always keeps the "
            "un-normalized hidden state as the residual, so it would serve this draft wrong; serve it with vLLM"
        )
    return p


def _rope_problems(scaling: object) -> list[str]:
    """rope_scaling: null (plain rope) or YaRN with keys both engines read alike (models/draft/rope.py)."""
    if scaling is not None and not isinstance(scaling, dict):
        return [f"rope_scaling must be null or an object, got {scaling!r}"]
    return rope_scaling_problems(scaling)
