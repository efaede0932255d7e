"""Doctor: an exported draft against the target and both engines' readings of its config.

The aux layer ids are where a draft is most easily served wrong without an error: SGLang reads
`eagle_config.eagle_aux_hidden_state_layer_ids` as outputs of 0-based layers (ours), vLLM the
top-level key as capture indices (input of layer i), so the two lists must differ by exactly one
and name the layers the draft was trained on (models/export/sglang.py's docstring has the engine
code). Shapes, names and the rest of what each loader reads are `validate_export` and
`validate_export_vllm`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from models.common.findings import Finding
from models.export.format import CONFIG_FILE, VLLM_AUX_KEY
from models.export.rules import read_export_config
from models.export.sglang import validate_export
from models.export.vllm import validate_export_vllm

NORM_FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")  # models/draft/eagle3.py reads each


def draft_findings(export_dir: Path, *, trained_layers: list[int], vocab_size: int, hidden_size: int) -> list[Finding]:
    """Findings for the export at `export_dir` (none there: one PASS saying so).

    `trained_layers`: the aux layers the capture and training use (ours: outputs of 0-based layers);
    `vocab_size`, `hidden_size`: the target's.
    """
    if not (export_dir / CONFIG_FILE).is_file():
        return [Finding("draft", "PASS", f"no export in {export_dir} yet (the train stage writes it)")]
    try:
        cfg, _ = read_export_config(export_dir)  # a speculators-format draft in our keys
    except ValueError as exc:
        return [Finding("draft", "FAIL", f"{export_dir}: {exc}", "run the train stage again")]
    return [
        _aux_finding(cfg, trained_layers),
        _shape_finding(cfg, vocab_size, hidden_size),
        _norm_finding(cfg),
        *_loader_findings(export_dir, vllm_only=bool(cfg.get("norm_before_residual"))),
    ]


def _aux_finding(cfg: dict[str, Any], trained: list[int]) -> Finding:
    eagle = found if isinstance(found := cfg.get("eagle_config"), dict) else {}
    sglang, vllm = eagle.get(VLLM_AUX_KEY), cfg.get(VLLM_AUX_KEY)
    seen = (
        f"trained on the outputs of layers {trained}; SGLang reads {sglang} (outputs of layers), vLLM {vllm} "
        "(capture indices = inputs of layers)"
    )
    wrong = []
    if sglang != trained:
        wrong.append(f"SGLang would feed the draft layers {sglang} instead of {trained}")
    if vllm != [a + 1 for a in trained]:
        wrong.append(
            f"vLLM would feed it capture indices {vllm} instead of {[a + 1 for a in trained]}"
            + (" (off by one: the ids of the other convention)" if vllm == trained else "")
        )
    if wrong:
        return Finding(
            "draft: aux layer ids",
            "FAIL",
            f"{seen}: " + "; ".join(wrong),
            f"set eagle_config.{VLLM_AUX_KEY} to {trained} and the top-level {VLLM_AUX_KEY} to "
            f"{[a + 1 for a in trained]} (or export again: the train stage writes both)",
        )
    return Finding("draft: aux layer ids", "PASS", seen)


def _shape_finding(cfg: dict[str, Any], vocab_size: int, hidden_size: int) -> Finding:
    seen = (
        f"vocab {cfg.get('vocab_size')}, draft vocab {cfg.get('draft_vocab_size')}, target hidden "
        f"{cfg.get('target_hidden_size')}"
    )
    wrong = []
    if cfg.get("vocab_size") != vocab_size:
        wrong.append(f"the target's vocabulary has {vocab_size:,} tokens")
    if cfg.get("target_hidden_size") != hidden_size:
        wrong.append(f"the target's hidden size is {hidden_size:,}")
    if wrong:
        return Finding(
            "draft: sizes",
            "FAIL",
            f"{seen}; but " + " and ".join(wrong),
            "this draft was trained for another target: train one for target.path",
        )
    return Finding("draft: sizes", "PASS", seen)


def _norm_finding(cfg: dict[str, Any]) -> Finding:
    on = [k for k in NORM_FLAGS if cfg.get(k)]
    seen = f"set: {', '.join(on)}" if on else "no norm options (EAGLE-3)"
    if cfg.get("use_aux_norm"):
        return Finding(
            "draft: norm flags",
            "WARN",
            f"{seen}; use_aux_norm",
            "use_aux_norm is SGLang's legacy name of fc_norm, which vLLM and this project's eval do not read: "
            "write fc_norm",
        )
    if cfg.get("norm_before_residual"):
        return Finding(
            "draft: norm flags",
            "WARN",
            seen,
            "vLLM and the in-process eval apply norm_before_residual, SGLang 0.5.23 ignores it: serve this draft "
            "with vLLM",
        )
    return Finding("draft: norm flags", "PASS", seen + "; each applied by both engines and the in-process eval")


def _loader_findings(export_dir: Path, *, vllm_only: bool) -> list[Finding]:
    """Each engine's loader on the export; `vllm_only` (a norm_before_residual draft, which SGLang 0.5.23 cannot
    serve and the config refuses to serve with it): SGLang's problems are a WARN, the draft is vLLM's."""
    out = []
    for engine, problems in (("SGLang", validate_export(export_dir)), ("vLLM", validate_export_vllm(export_dir))):
        if problems and vllm_only and engine == "SGLang":
            out.append(Finding("draft: SGLang loader", "WARN", "; ".join(problems)[:600], "serve this draft with vLLM"))
        elif problems:
            out.append(
                Finding(
                    f"draft: {engine} loader",
                    "FAIL",
                    "; ".join(problems)[:600],
                    "export again with the train stage; a hand-edited export must keep these rules",
                )
            )
        else:
            out.append(Finding(f"draft: {engine} loader", "PASS", "config and tensors as its loader reads them"))
    return out
