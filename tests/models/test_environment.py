"""models/environment.py: a missing or broken package is a FAIL naming it, another version a WARN, the device seen."""

from __future__ import annotations

import sys

import pytest

import models.environment as environment
from models.environment import Finding, environment_checks, failed


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.name: f for f in findings}


def test_this_machine_passes_on_cpu():
    findings = by_name(environment_checks("cpu"))
    assert set(findings) == {*environment.NEEDED, "device"}
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
