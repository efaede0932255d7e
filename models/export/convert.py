"""`eagle3 export`: a draft written in another format, the tensors unchanged.

Formats: `sglang`, our export (models/export/eagle3.py: what SGLang and vLLM load with their speculative flags), and
`speculators` (models/export/speculators.py: what `vllm serve DIR` serves alone, and the speculators library
reads). Either is read; the result is checked the way its readers read it (`validate_export` for sglang,
`validate_export_vllm` and `load_problems` for speculators) and renamed into place only when complete.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from safetensors import safe_open

from models.export.eagle3 import write_checked
from models.export.format import CONFIG_FILE, WEIGHTS_FILE
from models.export.rules import read_export
from models.export.sglang import load_problems, validate_export
from models.export.speculators import to_speculators_config, to_speculators_name
from models.export.vllm import validate_export_vllm

FORMATS = ("sglang", "speculators")


def _same(name: str) -> str:
    return name


Format = Literal["sglang", "speculators"]


def convert_draft(
    src: str | Path,
    out: str | Path,
    *,
    to: Format,
    verifier: str,
    verifier_architectures: list[str],
    num_steps: int,
) -> Path:
    """Write the draft at `src` (either format) to `out` in format `to`; return `out`.

    `verifier`, `verifier_architectures`: the target's path and architectures, written into a speculators config;
    `num_steps`: its draft tokens per round. Raises ValueError listing what the result's readers would refuse
    (e.g. SGLang and norm_before_residual), FileExistsError for an `out` that is not a draft.
    """
    src, out = Path(src), Path(out)
    problems = load_problems(src)
    if problems:
        raise ValueError(f"{src} is not a draft this project reads:\n  " + "\n  ".join(problems))
    if out.resolve() == src.resolve():
        raise ValueError(f"{out}: write the converted draft to another directory than its source")
    if out.exists() and any(out.iterdir()) and not (out / CONFIG_FILE).is_file():
        raise FileExistsError(f"{out} exists, is not empty and is not a draft; refusing to replace it")
    export = read_export(src)
    if to == "speculators":
        config = to_speculators_config(
            export.cfg, verifier=verifier, verifier_architectures=verifier_architectures, num_steps=num_steps
        )
        rename = to_speculators_name
        checks = (("the speculators format", load_problems), ("vLLM", validate_export_vllm))
    else:
        config = dict(export.cfg)
        rename = _same
        checks = (("SGLang", validate_export), ("vLLM", validate_export_vllm))
    with safe_open(str(src / WEIGHTS_FILE), framework="pt") as f:
        tensors = {rename(ours): f.get_tensor(name).contiguous() for ours, name in export.names.items()}
    failure = f"{src} written as {to} would not be read by"
    return write_checked(out, config, tensors, checks, failure=failure)
