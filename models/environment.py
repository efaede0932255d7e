"""The environment a run needs, checked in seconds before anything long starts (no Prefect, no httpx).

`environment_checks` imports what the ranks and the check process import, reads the versions, and
looks at the device: each finding is PASS, WARN (works, but not as tested) or FAIL (the run would
fail later, after minutes or hours of GPU time), with one line of what to do. bench/gpu_check.py
runs it first and stops before its first phase on a FAIL: a GPU slot is too short to find a
missing package in its third minute.
"""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass
from importlib import metadata
from typing import Any

# The versions the project's tests ran with (a WARN, not a FAIL, when the major.minor differs).
TESTED = {"torch": "2.13", "transformers": "5.24", "deepspeed": "0.19", "safetensors": "0.8", "pyarrow": "26",
          "numpy": "2.4"}
# What a rank process and the GPU check import, and the distribution that provides each.
NEEDED = {"torch": "torch", "deepspeed": "deepspeed", "transformers": "transformers", "safetensors": "safetensors",
          "pyarrow": "pyarrow", "numpy": "numpy"}


@dataclass(frozen=True)
class Finding:
    """One check's outcome: PASS | WARN | FAIL, what was seen, what to do."""

    name: str
    status: str
    detail: str
    advice: str = ""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def environment_checks(device: str, *, install_hint: str = "pip install it (or bash bench/gpu_check.sh, which installs "
                                                              "the carried wheels)") -> list[Finding]:
    """The findings for running on `device` ("cuda" or "cpu"): each needed module, its version, the device."""
    out: list[Finding] = []
    for module, dist in NEEDED.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding (ImportError, a broken build)
            out.append(Finding(module, "FAIL", f"import {module} failed: {type(e).__name__}: {e}"[:300], install_hint))
            continue
        out.append(_version_finding(module, dist))
    if not any(f.name == "torch" and f.status == "FAIL" for f in out):
        out += _device_findings(device)
    return out


def failed(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "FAIL"]


def _version_finding(module: str, dist: str) -> Finding:
    try:
        have = metadata.version(dist)
    except metadata.PackageNotFoundError:
        have = getattr(importlib.import_module(module), "__version__", "unknown")
    tested = TESTED.get(module)
    if tested is None or _major_minor(have).startswith(tested):
        return Finding(module, "PASS", have)
    return Finding(module, "WARN", f"{have}; tested with {tested}.x",
                   "it may work; if a later step fails, install the tested version")


def _major_minor(version: str) -> str:
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2])


def _device_findings(device: str) -> list[Finding]:
    import torch

    if device != "cuda":
        return [Finding("device", "PASS", f"cpu ({torch.get_num_threads()} threads); gloo for the ranks")]
    if not torch.cuda.is_available():
        return [Finding("device", "FAIL", f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})",
                        "use a CUDA build of torch on a machine with a GPU, or the CPU path (--cpu-smoke)")]
    props = torch.cuda.get_device_properties(0)
    out = [Finding("device", "PASS", f"{torch.cuda.device_count()} x {props.name}, "
                                     f"{props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}")]
    out.append(Finding("bf16", "PASS" if torch.cuda.is_bf16_supported() else "WARN",
                       "supported" if torch.cuda.is_bf16_supported() else "not supported by this GPU",
                       "" if torch.cuda.is_bf16_supported() else "capture and train in fp16 or fp32 instead"))
    try:
        nccl = torch.cuda.nccl.version()
        out.append(Finding("nccl", "PASS", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    except Exception as e:  # noqa: BLE001 - a torch built without NCCL
        out.append(Finding("nccl", "FAIL", f"{type(e).__name__}: {e}"[:200], "use a torch build with NCCL"))
    return out
