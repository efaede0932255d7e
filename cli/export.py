"""`eagle3 export`: a run's draft (or any EAGLE-3 draft) written in the speculators or our SGLang format."""

from __future__ import annotations

from pathlib import Path

from models.export.convert import FORMATS, convert_draft
from settings.layout import RUN_DRAFTS
from settings.run import RunConfig


def export_draft_as(config: RunConfig, draft: str, to: str, out: Path | None = None) -> Path:
    """Write eval.draft-style `draft` (final, best or a directory) of the run in format `to`; return where.

    The target of `config` is the verifier a speculators config names (its absolute path when it is a local
    directory, so `vllm serve OUT` finds it from any working directory).
    """
    if to not in FORMATS:
        raise ValueError(f"--format {to!r}: one of {', '.join(FORMATS)}")
    layout = config.layout
    src = layout.eval_of(draft)[0]
    if not (src / "config.json").is_file():
        hint = "run the train stage first" if draft in RUN_DRAFTS else "give a draft directory"
        raise FileNotFoundError(f"{src}: no draft there (no config.json); {hint}")
    from transformers import AutoConfig

    target = config.target.path
    verifier = str(Path(target).resolve()) if Path(target).is_dir() else target
    architectures = AutoConfig.from_pretrained(target, trust_remote_code=config.target.trust_remote_code).architectures
    return convert_draft(
        src,
        out or layout.exported_as(to),
        to="speculators" if to == "speculators" else "sglang",
        verifier=verifier,
        verifier_architectures=list(architectures or []),
        num_steps=config.eval.num_steps,
    )
