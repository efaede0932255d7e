"""Export an `Eagle3Draft` as the directory SGLang serves with `--speculative-algorithm EAGLE3`.

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
- RoPE: `Eagle3Draft` trains with unscaled RoPE at `config.rope_theta`, so `rope_scaling` is null
  and rope_theta is the draft's own, never the target's (copying Kimi's YaRN scaling would rotate
  differently from training). max_position_embeddings is the target's, so long contexts fit.

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

import json
import shutil
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.common.atomic import replace_dir
from models.draft.eagle3 import AUX_FEATURES, Eagle3Config, Eagle3Draft
from models.export.format import ARCHITECTURE, CONFIG_FILE, EMBED, INPUT_NORM, VLLM_AUX_KEY, WEIGHTS_FILE, vllm_aux_ids  # noqa: F401  (names other modules import from here)
from models.export.speculators import (
    from_speculators_config,
    from_speculators_name,
    is_speculators,
    to_speculators_name,
)

VLLM_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")  # registry -> Eagle3LlamaForCausalLM

_Shape = Callable[[Mapping], tuple[int, ...]]
# name -> expected shape from the exported config.json (H hidden, Ht target hidden, hd head_dim).
SGLANG_REQUIRED_WEIGHTS: dict[str, _Shape] = {
    "fc.weight": lambda c: (c["hidden_size"], 3 * c["target_hidden_size"]),
    "midlayer.self_attn.q_proj.weight": lambda c: (c["num_attention_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.k_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.v_proj.weight": lambda c: (c["num_key_value_heads"] * c["head_dim"], 2 * c["hidden_size"]),
    "midlayer.self_attn.o_proj.weight": lambda c: (c["hidden_size"], c["num_attention_heads"] * c["head_dim"]),
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
# Only with config fc_norm: true (EAGLE-3.1): one RMSNorm per aux feature, [target_hidden_size] each.
FC_NORM_WEIGHTS: dict[str, _Shape] = {
    f"fc_norm.{i}.weight": lambda c: (c["target_hidden_size"],) for i in range(AUX_FEATURES)
}
VARIANT_KEYS = ("fc_norm", "norm_output")  # Eagle3Config fields = config.json keys both engines read
OTHER_TRAINERS_KEYS = ("norm_before_fc", "norm_before_residual")  # Eagle3Config fields we read, never train
_EMBED_SHAPE: _Shape = lambda c: (c["vocab_size"], c["hidden_size"])  # noqa: E731
_INT_KEYS = (
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
_ST_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}  # torch_dtype -> safetensors dtype


def export_dtype(cfg: Mapping) -> str | None:
    """The weights' dtype a config.json states: `torch_dtype` (ours, transformers 4), else `dtype` (the key
    transformers 5 writes, e.g. in a SpecForge export); both engines read either through transformers' config."""
    found = cfg.get("torch_dtype") or cfg.get("dtype")
    return found if isinstance(found, str) else None


def _text_config(target_config) -> dict:
    cfg = target_config.to_dict() if hasattr(target_config, "to_dict") else dict(target_config)
    return dict(cfg.get("text_config") or cfg)  # multimodal targets (Kimi-K2.5) nest the LM config


def sglang_config(config: Eagle3Config, target_config, dtype: torch.dtype) -> dict:
    """The config.json of the export (see the module docstring for each key)."""
    target = _text_config(target_config)
    check_aux_layers(config.aux_layers, target.get("num_hidden_layers"))
    for key, ours in (("vocab_size", config.vocab_size), ("hidden_size", config.target_hidden_size)):
        if key in target and int(target[key]) != ours:
            raise ValueError(f"target {key} {target[key]} != the draft's {ours}")
    if "max_position_embeddings" not in target:
        raise ValueError("target_config has no max_position_embeddings")
    out = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "num_hidden_layers": 1,
        "hidden_act": config.hidden_act,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_scaling": None,
        "max_position_embeddings": int(target["max_position_embeddings"]),
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "attention_bias": False,
        "mlp_bias": False,
        "torch_dtype": str(dtype).removeprefix("torch."),
        "norm_before_residual": config.norm_before_residual,
        "norm_before_fc": config.norm_before_fc,
        "fc_norm": config.fc_norm,
        "norm_output": config.norm_output,
        "eagle_config": {VLLM_AUX_KEY: list(config.aux_layers), "use_aux_hidden_state": True},  # SGLang
        VLLM_AUX_KEY: vllm_aux_ids(config.aux_layers),
    }
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if target.get(key) is not None:
            out[key] = target[key]
    return out


def check_aux_layers(aux_layers: list[int], target_layers: int | None = None) -> None:
    """Raise ValueError unless `aux_layers` (ours: outputs of 0-based layers) mean the same in
    every engine: first id 1, increasing, and not the target's last layer (module docstring)."""
    aux = list(aux_layers)
    if not aux or aux[0] != 1:
        raise ValueError(
            f"aux_layers {aux}: the first aux layer must be 1. SGLang versions disagree on "
            "eagle_config.eagle_aux_hidden_state_layer_ids whose first id is not 1 (older ones add 1 "
            "to every id, newer ones only when the first id is 1), so the exported draft would be "
            "served with other hidden states than it was trained on; use default_aux_layers"
        )
    if any(b <= a for a, b in zip(aux, aux[1:])):
        raise ValueError(
            f"aux_layers {aux} must be increasing: SGLang and vLLM capture and "
            "concatenate the aux hidden states in layer order"
        )
    if target_layers is not None and aux[-1] >= int(target_layers) - 1:
        raise ValueError(
            f"aux_layers {aux}: layer {aux[-1]} is the last of the target's {target_layers} "
            "layers (or beyond); SGLang (and vLLM before PR #36063) captures only layer inputs, "
            "never the last output"
        )


def export_draft(
    draft: Eagle3Draft, out_dir: str | Path, *, target_config, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """Write `out_dir/{config.json, model.safetensors}` for SGLang, validated, atomically; return out_dir.

    `target_config`: the target's HF config (dict or PretrainedConfig) for max_position_embeddings
    and the vocab/hidden-size cross-checks. The files are assembled in a sibling temp dir, checked
    with `validate_export` (ValueError listing every problem) and renamed into place; an existing
    export at `out_dir` is replaced only once the new one is complete. A non-empty `out_dir` that
    is not an EAGLE-3 export is never replaced.
    """
    if str(dtype).removeprefix("torch.") not in _ST_DTYPES:
        raise ValueError(f"dtype must be one of torch.{'/'.join(_ST_DTYPES)}, got {dtype}")
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()) and not _is_export(out_dir):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not an EAGLE-3 export; refusing to replace it")
    config = sglang_config(draft.config, target_config, dtype)
    full_vocab = draft.config.draft_vocab_size == draft.config.vocab_size
    if full_vocab and torch.any(draft.d2t != 0):  # V strictly increasing ids in [0, V) are arange(V)
        raise ValueError("draft_vocab_size == vocab_size but d2t is not the identity (all zeros)")
    tensors = {}
    for name, t in draft.state_dict().items():
        if full_vocab and name in VOCAB_MAP:
            # vLLM 0.32 (vllm/model_executor/models/llama_eagle3.py) has no draft_id_to_target_id
            # at D == V and fails on a d2t; SGLang 0.5.23 (sglang/srt/models/llama_eagle3.py)
            # skips t2d always and, without d2t, uses draft ids as target ids (the identity).
            continue
        t = t.detach().to("cpu")
        tensors[name] = (
            t.to(torch.int64) if name == "d2t" else t.bool() if name == "t2d" else t.to(dtype)
        ).contiguous()

    from models.export.vllm import validate_export_vllm  # here: that module imports this one's names

    checks: tuple[tuple[str, Check], ...] = (("SGLang", validate_export), ("vLLM", validate_export_vllm))
    if draft.config.norm_before_residual:  # SGLang 0.5.23 cannot serve it (validate_export says why): vLLM only
        checks = checks[1:]
    return write_checked(out_dir, config, tensors, checks, failure="EAGLE-3 export is not loadable by")


Check = Callable[[Path], list[str]]


def write_checked(
    out_dir: Path, config: dict, tensors: dict[str, torch.Tensor], checks: tuple[tuple[str, Check], ...], failure: str
) -> Path:
    """config.json + model.safetensors assembled in a sibling temp dir, checked by each (reader, check), renamed into
    place; ValueError `failure READER:` + the problems of the first check that finds any (nothing replaced then)."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(tmp / WEIGHTS_FILE), metadata={"format": "pt"})
        for reader, check in checks:
            problems = check(tmp)
            if problems:
                raise ValueError(f"{failure} {reader}:\n  " + "\n  ".join(problems))
        tmp.chmod(0o755)  # mkdtemp makes 0700
        for p in tmp.iterdir():
            p.chmod(0o644)
        replace_dir(tmp, out_dir)  # files fsynced, then renamed: a reader sees the old export or the new one
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _is_export(path: Path) -> bool:
    try:
        return json.loads((path / CONFIG_FILE).read_text()).get("architectures") == [ARCHITECTURE]
    except (OSError, ValueError, AttributeError):
        return False


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
        cfg["torch_dtype"] = {v: k for k, v in _ST_DTYPES.items()}.get(meta["fc.weight"][1])
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
        return cfg, False
    try:
        return from_speculators_config(cfg), True
    except (ValueError, TypeError) as e:
        raise ValueError(f"{CONFIG_FILE} (speculators format): {e}") from e


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

    rules = {**SGLANG_REQUIRED_WEIGHTS, **(FC_NORM_WEIGHTS if cfg.get("fc_norm") else {})}
    if norm_before_fc(cfg):
        rules[INPUT_NORM] = lambda c: (AUX_FEATURES * c["target_hidden_size"],)
    rules[EMBED] = _EMBED_SHAPE
    if EMBED not in names and cfg["hidden_size"] != cfg["target_hidden_size"]:
        problems.append(
            f"missing {EMBED}: SGLang shares the target's embedding only when hidden_size == target_hidden_size"
        )
    float_dtype = _ST_DTYPES[str(export_dtype(cfg))]
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


def export_name(export: ExportFiles, name: str) -> str:
    """The file's name of our tensor `name` (a missing one: the name the format would give it)."""
    return export.names.get(name) or (to_speculators_name(name) if export.speculators else name)


def norm_before_fc(cfg: Mapping) -> bool:
    """Whether a config asks for one RMSNorm over all aux features before fc: `eagle_config.norm_before_fc`, else the
    top-level key (both engines read it so: SGLang 0.5.23 and vLLM 0.32 llama_eagle3.py `LlamaModel.__init__`)."""
    eagle = cfg.get("eagle_config")
    nested = eagle.get("norm_before_fc") if isinstance(eagle, dict) else None
    return bool(nested if nested is not None else cfg.get("norm_before_fc", False))


def _config_problems(cfg: dict, *, sglang: bool = True) -> list[str]:
    p = []
    if cfg.get("architectures") != [ARCHITECTURE]:
        p.append(f"architectures {cfg.get('architectures')!r} != [{ARCHITECTURE!r}]")
    if cfg.get("model_type") != "llama":
        p.append(f"model_type {cfg.get('model_type')!r} != 'llama'")
    for key in _INT_KEYS:
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
    if cfg.get("rope_scaling") is not None:
        p.append("rope_scaling must be null: the draft is trained with unscaled RoPE")
    for key in ("rms_norm_eps", "rope_theta"):
        if not isinstance(cfg.get(key), (int, float)) or cfg[key] <= 0:
            p.append(f"config {key} must be a positive number, got {cfg.get(key)!r}")
    if export_dtype(cfg) not in _ST_DTYPES:
        stated = cfg.get("torch_dtype") or cfg.get("dtype")
        p.append(f"torch_dtype (or dtype) {stated!r} not one of {sorted(_ST_DTYPES)}")
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
        p.append(
            "norm_before_residual: SGLang 0.5.23 (srt/models/llama_eagle3.py LlamaDecoderLayer) always keeps the "
            "un-normalized hidden state as the residual, so it would serve this draft wrong; serve it with vLLM"
        )
    return p


def has_embedding(out_dir: str | Path) -> bool:
    """Whether an export holds its own embed_tokens (ours always do; another trainer's may not)."""
    with safe_open(str(Path(out_dir) / WEIGHTS_FILE), framework="pt") as f:
        return EMBED in f.keys()


def load_exported_draft(out_dir: str | Path, *, dtype: torch.dtype | None = None) -> Eagle3Draft:
    """The `Eagle3Draft` of an export, ours or speculators' (`load_problems` first), in `dtype` (default: the
    file's torch_dtype or dtype).

    An export without embed_tokens (allowed when hidden_size == target_hidden_size) leaves the
    embedding uninitialized: call `load_target_embedding` with the target's. An export without
    d2t/t2d (written so when draft_vocab_size == vocab_size) keeps `Eagle3Draft`'s identity vocab.
    """
    out_dir = Path(out_dir)
    problems = load_problems(out_dir)
    if problems:
        raise ValueError(f"{out_dir} is not a valid EAGLE-3 draft:\n  " + "\n  ".join(problems))
    export = read_export(out_dir)
    cfg = export.cfg
    config = Eagle3Config(
        **{k: cfg[k] for k in _INT_KEYS},
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg["rope_theta"]),
        aux_layers=list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        hidden_act=cfg["hidden_act"],
        **{key: bool(cfg.get(key, False)) for key in VARIANT_KEYS},
        norm_before_fc=norm_before_fc(cfg),
        norm_before_residual=bool(cfg.get("norm_before_residual", False)),
    )
    draft = Eagle3Draft(config).to(dtype or getattr(torch, str(export_dtype(cfg))))
    with safe_open(str(out_dir / WEIGHTS_FILE), framework="pt") as f:
        state = {ours: f.get_tensor(name) for ours, name in export.names.items()}
    missing, _ = draft.load_state_dict(state, strict=False)  # unknown names were rejected by load_problems
    # load_problems let d2t/t2d be absent only at D == V, where Eagle3Draft.__init__'s buffers
    # (d2t zeros, t2d all true) are the identity map the engines assume too.
    optional = {EMBED, *VOCAB_MAP} if config.draft_vocab_size == config.vocab_size else {EMBED}
    if set(missing) - optional:
        raise ValueError(f"{out_dir}: missing tensors {sorted(set(missing) - optional)}")
    return draft
