"""models/ranks/environment.py: a missing or broken package is a FAIL naming it, another version a WARN, the device
seen."""

from __future__ import annotations

import sys

import pytest

import models.ranks.environment as environment
from models.common.findings import Finding, failed
from models.ranks.environment import environment_checks


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.name: f for f in findings}


def test_this_machine_passes_on_cpu():
    findings = by_name(environment_checks("cpu"))
    assert set(findings) == {"python", *environment.NEEDED, "device"}
    assert failed(list(findings.values())) == []
    assert findings["device"].status == "PASS" and findings["device"].detail.startswith("cpu")


def test_a_missing_package_fails_with_what_to_do(monkeypatch):
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # absent, as an uninstalled package is
    f = by_name(environment_checks("cpu", install_hint="install it"))["deepspeed"]
    assert (f.status, f.advice) == ("FAIL", "install it") and "ModuleNotFoundError" in f.detail


def test_another_version_is_a_warning(monkeypatch):
    monkeypatch.setitem(environment.TESTED, "numpy", "1.26")
    f = by_name(environment_checks("cpu"))["numpy"]
    assert f.status == "WARN" and "tested with 1.26.x" in f.detail


def test_cuda_asked_on_a_machine_without_it_fails():
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU machine: the device PASSes there (the GPU check reads it)")
    f = by_name(environment_checks("cuda"))["device"]
    assert f.status == "FAIL" and "sees no CUDA device" in f.detail


def test_the_pipeline_modules_are_checked_when_asked():
    findings = by_name(environment_checks("cpu", pipeline=True))
    assert set(environment.PIPELINE) <= set(findings)
    assert findings["prefect"].status == "PASS"


def test_an_op_deepspeed_cannot_build_fails_naming_the_setting(monkeypatch):
    from deepspeed.ops import op_builder

    monkeypatch.setattr(op_builder.AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    f = by_name(environment_checks("cpu", ops=("async_io",)))["deepspeed op async_io"]
    assert f.status == "FAIL" and "libaio" in f.advice and "capture.offload" in f.advice


def test_another_python_is_a_warning(monkeypatch):
    monkeypatch.setitem(environment.TESTED, "python", "3.99")
    f = by_name(environment_checks("cpu"))["python"]
    assert f.status == "WARN" and "tested with 3.99.x" in f.detail


def test_the_allreduce_is_skipped_without_several_gpus():
    import torch

    if torch.cuda.device_count() > 1:
        pytest.skip("several GPUs: the all-reduce runs (the GPU check's machine has one)")
    assert "nccl all-reduce" not in by_name(environment_checks("cpu", allreduce=True))  # CPU: no NCCL at all


def test_any_of_the_tested_versions_passes(monkeypatch):
    import numpy

    major_minor = ".".join(numpy.__version__.split(".")[:2])
    monkeypatch.setitem(environment.TESTED, "numpy", ("1.26", major_minor))  # this machine's is the second one
    assert by_name(environment_checks("cpu"))["numpy"].status == "PASS"
    monkeypatch.setitem(environment.TESTED, "numpy", ("1.26", "1.25"))
    f = by_name(environment_checks("cpu"))["numpy"]
    assert f.status == "WARN" and f.detail.endswith("tested with 1.26.x or 1.25.x")
