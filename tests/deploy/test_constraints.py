"""deploy/constraints.txt (pip-compile's lock, `make lock`): the install takes what the tests ran with, and the
doctor's tested versions (models/ranks/environment.py TESTED) are the lock's, so a fresh clone's doctor warns about
nothing of its own install."""

from __future__ import annotations

import re
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

import models.ranks.environment as environment

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "deploy" / "constraints.txt"


def pins(path: Path) -> dict[str, str]:
    """`name==version` lines of a pip requirements file, names normalised as pip does (PEP 503)."""
    out = {}
    for line in path.read_text().splitlines():
        match = re.match(r"^([A-Za-z0-9._-]+)==(\S+)", line)
        if match:
            out[re.sub(r"[-_.]+", "-", match[1]).lower()] = match[2]
    return out


def within(v: str, tested: str) -> bool:
    """Whether version `v` (2.13.0+cpu) is in `tested`, a release series as TESTED writes it (2.13, or 26 for 26.x)."""
    parts = tested.split(".")
    return v.split("+")[0].split(".")[: len(parts)] == parts


def test_the_lock_pins_every_dependency_and_leaves_torch_to_the_machine():
    locked = pins(LOCK)
    text = (REPO / "pyproject.toml").read_text()
    declared = re.findall(r'^\s+"([A-Za-z0-9_.-]+)[<>=!~\[ ]', text, flags=re.M)
    assert {"prefect", "httpx", "transformers", "deepspeed", "pytest", "ruff"} <= set(declared)
    missing = [d for d in declared if re.sub(r"[-_.]+", "-", d).lower() not in locked and d != "torch"]
    assert missing == [], f"not in {LOCK.name}: {missing}; run `make lock`"
    # torch's range stays wide (a GPU box brings its CUDA build), and no CUDA-only package is pinned for it
    assert "torch" not in locked and not [n for n in locked if n.startswith(("nvidia-", "triton"))]


def test_the_doctor_s_tested_versions_are_the_lock_s():
    locked = pins(LOCK)
    makefile = (REPO / "Makefile").read_text()
    cpu_torch = re.search(r"install\.sh \$\(VENV\) -q torch==(\S+); fi", makefile)  # deploy/pip-install.sh
    assert cpu_torch is not None
    for name in {**environment.NEEDED, **environment.PIPELINE}:
        have = cpu_torch[1] if name == "torch" else locked[name]
        assert within(have, environment.tested_versions(name)[0]), (name, have)


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="the lock is resolved for Python 3.11 (Makefile)")
def test_this_venv_holds_the_locked_versions_so_the_doctor_warns_of_none():
    locked = pins(LOCK)
    installed = {name: version(dist) for name, dist in {**environment.NEEDED, **environment.PIPELINE}.items()}
    differ = {n: v for n, v in installed.items() if n != "torch" and v != locked[n]}
    assert differ == {}, f"{differ} differ from {LOCK.name}: `make venv` installs the locked versions"
    findings = environment.environment_checks("cpu", pipeline=True)
    assert [(f.name, f.detail) for f in findings if f.status != "PASS"] == []
