"""Doctor: the draft a stage will serve, against the target and the rules of what serves it.

Which draft: the eval's (`eval.draft`: the train stage's export `final` or `best`, or the directory of another
trainer's draft; `eagle3 eval --draft DIR` for one run). What serves it: the engine eval's server (`server.engine`:
SGLang's rules for SGLang and the dev server, which emulates it; vLLM's for vLLM) and the in-process eval (the rules
of `load_exported_draft`). A problem of the engine that serves it is a FAIL; the train stage's own export is held to
both engines' rules (it promises both), another trainer's draft only to those of what serves it (the other engine's
problems are a WARN: what serving it there would need).

The aux layer ids are where a draft is most easily served wrong without an error: SGLang reads
`eagle_config.eagle_aux_hidden_state_layer_ids` as outputs of 0-based layers (ours), vLLM the
top-level key as capture indices (input of layer i), so the two lists must differ by exactly one
and name the layers the draft was trained on (models/export/sglang.py's docstring has the engine
code). vLLM's id 0 crashes vLLM 0.32's DeepSeek/Kimi class on the first request (models/export/vllm.py
`vllm_load_problems`). Shapes, names and the rest of what each loader reads are `validate_export` and
`validate_export_vllm`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.common.findings import Finding
from models.export.format import CONFIG_FILE, VLLM_AUX_KEY
from models.export.rules import read_export_config
from models.export.sglang import load_problems, validate_export
from models.export.vllm import validate_export_vllm

NORM_FLAGS = ("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual")  # models/draft/eagle3.py reads each
ENGINE_NAMES = {"sglang": "SGLang", "dev": "SGLang", "vllm": "vLLM"}  # the dev server: SGLang's rules
LOADERS: dict[str, Callable[[Path], list[str]]] = {"SGLang": validate_export, "vLLM": validate_export_vllm}


@dataclass(frozen=True)
class ServedDraft:
    """The draft a stage will serve, and what serves it."""

    path: Path
    chosen: str
    """Where it was chosen, for the messages: `eval.draft: final`, `--draft DIR`."""
    ours: bool
    """The train stage's export (final, best): held to both engines' rules. Else another trainer's draft."""
    engine: str | None
    """What the engine eval serves it through: sglang, dev (the dev server, which loads a draft as SGLang does:
    SGLang's rules), vllm; None: in-process only."""
    in_process: bool = False
    """The in-process (HF) eval loads it too (eval.backend hf or both)."""
    required: bool = False
    """It must be there now (the preflight of an eval that does not train first); else its absence is a PASS."""

    @property
    def setting(self) -> str:
        """`eval.draft` or `--draft`: what chose it."""
        return self.chosen.split()[0].rstrip(":")


def draft_findings(
    served: ServedDraft, *, trained_layers: list[int], vocab_size: int, hidden_size: int
) -> list[Finding]:
    """Findings for the draft `served`.

    `trained_layers`: the aux layers the capture and training use (ours: outputs of 0-based layers), the layers the
    train stage's export must name; `vocab_size`, `hidden_size`: the target's.
    """
    path = served.path
    if not (path / CONFIG_FILE).is_file():
        return [_missing(served)]
    try:
        cfg, _ = read_export_config(path)  # a speculators-format draft in our keys
    except ValueError as exc:
        again = "run the train stage again" if served.ours else f"point {served.setting} at an EAGLE-3 draft"
        return [Finding("draft", "FAIL", f"{served.chosen} ({path}): {exc}", again)]
    aux = [_aux_finding(cfg, trained_layers)] if served.ours else []
    return [
        *aux,
        _shape_finding(cfg, vocab_size, hidden_size),
        _norm_finding(cfg),
        *_loader_findings(served, vllm_only=bool(cfg.get("norm_before_residual"))),
    ]


def _missing(served: ServedDraft) -> Finding:
    if served.ours and not served.required:
        return Finding("draft", "PASS", f"no export in {served.path} yet (the train stage writes it)")
    if served.ours:
        return Finding(
            "draft",
            "FAIL",
            f"{served.chosen}: no export in {served.path} (no {CONFIG_FILE}): the eval has no draft to measure",
            "run the train stage first (eagle3 run CONFIG --stages train,eval), or measure a draft directory "
            "(eval.draft: DIR, eagle3 eval CONFIG --draft DIR)",
        )
    return Finding(
        "draft",
        "FAIL",
        f"{served.chosen}: no {CONFIG_FILE} in {served.path}: not an EAGLE-3 draft directory",
        "give the directory that holds the draft's config.json and model.safetensors",
    )


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


def _loader_findings(served: ServedDraft, *, vllm_only: bool) -> list[Finding]:
    """Each engine's loader on the draft, and the in-process eval's where it loads another trainer's draft.

    A problem of the engine that serves it is a FAIL. Of the other engine: a FAIL for the train stage's export (it
    promises both), a WARN for another trainer's draft. `vllm_only` (a norm_before_residual draft, which SGLang 0.5.23
    cannot serve and the config refuses to serve with it unless through the dev server, which serves it as SGLang
    does): SGLang's problems are a WARN unless a real SGLang serves it, the draft is vLLM's.
    """
    serves = ENGINE_NAMES.get(served.engine or "")
    out = []
    for engine, loader in LOADERS.items():
        problems = loader(served.path)
        seen = "; ".join(problems)[:900]
        if not problems:
            out.append(Finding(f"draft: {engine} loader", "PASS", "config and tensors as its loader reads them"))
        elif vllm_only and engine == "SGLang" and served.engine != "sglang":
            out.append(Finding("draft: SGLang loader", "WARN", seen, "serve this draft with vLLM"))
        elif engine == serves or served.ours:
            out.append(Finding(f"draft: {engine} loader", "FAIL", f"{_whose(served)}: {seen}", _fix(served, engine)))
        else:
            how = f"the eval serves it through {serves}" if serves else "the eval runs it in-process only"
            out.append(
                Finding(
                    f"draft: {engine} loader",
                    "WARN",
                    f"{_whose(served)}: {seen}",
                    f"{how}; serving it with {engine} would need these fixed",
                )
            )
    if served.in_process and not served.ours:  # the train stage's export passes it whenever it passes SGLang's
        problems = load_problems(served.path)
        if problems:
            out.append(
                Finding(
                    "draft: in-process loader",
                    "FAIL",
                    f"{_whose(served)}: " + "; ".join(problems)[:900],
                    "the in-process eval (eval.backend hf or both) cannot load it as trained: fix its files, or set "
                    "eval.backend: engine",
                )
            )
        else:
            out.append(
                Finding("draft: in-process loader", "PASS", "config and tensors as the in-process eval reads them")
            )
    return out


def _whose(served: ServedDraft) -> str:
    return f"{served.chosen} ({served.path})" if not served.chosen.endswith(str(served.path)) else served.chosen


def _fix(served: ServedDraft, engine: str) -> str:
    if served.ours:
        return "export again with the train stage; a hand-edited export must keep these rules"
    other = "SGLang" if engine == "vLLM" else "vLLM"
    return (
        f"fix the draft's config.json or tensors as said (ask its trainer for a {engine} export), serve it with "
        f"{other} (server.engine), or measure another draft"
    )
