"""An `Eagle3Draft` written as the export directory both engines serve, and loaded back from one.

`export_draft` writes config.json and model.safetensors, checked by what SGLang and vLLM make of them
(models/export/sglang.py, whose docstring says what each key and tensor is for, and models/export/vllm.py);
`load_exported_draft` reads an export, ours or another trainer's in the speculators format, as an `Eagle3Draft`.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.common.atomic import replace_dir
from models.draft.config import MLA_KEYS, Eagle3Config
from models.draft.eagle3 import Eagle3Draft
from models.export.format import (
    ARCHITECTURE,
    CONFIG_FILE,
    EMBED,
    MLA_ARCHITECTURE,
    MLA_MODEL_TYPE,
    VLLM_AUX_KEY,
    WEIGHTS_FILE,
    vllm_aux_ids,
)
from models.export.rules import (
    INT_KEYS,
    MLA_INT_KEYS,
    ST_DTYPES,
    VARIANT_KEYS,
    VOCAB_MAP,
    export_dtype,
    is_mla,
    norm_before_fc,
    read_export,
)
from models.export.sglang import load_problems, validate_export
from models.export.vllm import validate_export_vllm


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
        "rope_scaling": config.rope_scaling,  # as trained: null (plain) or the target's YaRN
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
    if config.draft_arch == "mla":  # what SGLang's kimi_k25_eagle3.py and vLLM's deepseek_eagle3.py read instead
        del out["head_dim"], out["attention_bias"], out["mlp_bias"]
        out.update(
            architectures=[MLA_ARCHITECTURE],
            model_type=MLA_MODEL_TYPE,
            **{key: getattr(config, key) for key in MLA_KEYS},
        )
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
    if str(dtype).removeprefix("torch.") not in ST_DTYPES:
        raise ValueError(f"dtype must be one of torch.{'/'.join(ST_DTYPES)}, got {dtype}")
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
        return json.loads((path / CONFIG_FILE).read_text()).get("architectures") in ([ARCHITECTURE], [MLA_ARCHITECTURE])
    except (OSError, ValueError, AttributeError):
        return False


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
    mla = is_mla(cfg)
    mla_fields: dict[str, Any] = {}  # MLA: no head_dim or key/value heads in the file (DeepseekV2Config derives them)
    if mla:
        mla_fields = {
            "draft_arch": "mla",
            "num_key_value_heads": cfg["num_attention_heads"],
        }
    variant: dict[str, Any] = {key: bool(cfg.get(key, False)) for key in VARIANT_KEYS}
    config = Eagle3Config(
        **{k: cfg[k] for k in (MLA_INT_KEYS if mla else INT_KEYS)},
        **mla_fields,
        rope_scaling=cfg.get("rope_scaling"),
        rms_norm_eps=float(cfg["rms_norm_eps"]),
        rope_theta=float(cfg["rope_theta"]),
        aux_layers=list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        hidden_act=cfg["hidden_act"],
        **variant,
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
