"""The layout rules the code relies on: imports point cli -> flows -> tasks -> models; no private name crosses files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "flows", "tasks", "models", "emulators", "bench", "tools", "tests")
LAYER = {"cli": 3, "flows": 2, "tasks": 1, "models": 0}
# emulators/ (the engines emulated, for the demo and the tests) stand beside the layers: they use models/ (the tiny
# target's decoding) and no layer above it; of the layers only the CLI's `serve-dev` imports them (the demo
# and the stages start the dev server as a process and reach every engine over HTTP).
EMULATORS_MAY_IMPORT = {"models", "emulators"}
IMPORTS_EMULATORS = {"cli/app.py"}


def sources():
    for package in PACKAGES:
        yield from sorted((REPO / package).rglob("*.py"))


def imports(path: Path):
    """(imported module, name or None, line) for every import in the file, nested ones included."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                yield node.module, alias.name, node.lineno
        elif isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, None, node.lineno


def imports_in(package: str, refused) -> list[str]:
    """`path:line: module` for each import in REPO/package whose top-level package `refused(top)` is true of."""
    return [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for path in sorted((REPO / package).rglob("*.py"))
        for module, _, line in imports(path)
        if refused(module.split(".")[0])
    ]


def test_no_module_imports_a_private_name_of_another():
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}.{name}"
        for path in sources()
        for module, name, line in imports(path)
        if name and name.startswith("_") and not name.startswith("__") and module.split(".")[0] in PACKAGES
    ]
    assert found == []


@pytest.mark.parametrize("package", ["cli", "flows", "tasks", "models"])
def test_imports_point_cli_to_flows_to_tasks_to_models(package):
    upward = imports_in(package, lambda top: top in LAYER and LAYER[top] > LAYER[package])
    assert upward == []


def test_models_import_no_prefect_or_httpx():
    found = imports_in("models", lambda top: top in ("prefect", "httpx"))
    assert found == []


def test_emulators_import_models_only():
    found = imports_in("emulators", lambda top: top in PACKAGES and top not in EMULATORS_MAY_IMPORT)
    assert found == []


def test_only_the_cli_imports_the_emulators():
    found = [
        f"{path.relative_to(REPO)}:{line}: {module}"
        for package in LAYER
        for path in sorted((REPO / package).rglob("*.py"))
        for module, _, line in imports(path)
        if module.split(".")[0] == "emulators" and str(path.relative_to(REPO)) not in IMPORTS_EMULATORS
    ]
    assert found == []


MAX_LINES = 600  # a file past this holds more than one concept: split it by concept, not by line count
# the layers, the emulators beside them, the benchmarks and the tools
SIZED = (*LAYER, "emulators", "bench", "tools")


def test_no_file_of_the_layers_emulators_benches_or_tools_is_over_600_lines():
    long = {
        str(path.relative_to(REPO)): n
        for package in SIZED
        for path in sorted((REPO / package).rglob("*.py"))
        if (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert long == {}


# models/common/ is what flows/ and tasks/ import from models/ without paying for torch: its modules, and the models
# modules they import, import no torch, transformers or deepspeed (nested imports included, as a fresh process sees).
TORCH_FREE = "models.common"
HEAVY = ("torch", "transformers", "deepspeed")


def test_models_common_imports_no_torch():
    names = sorted(f"{TORCH_FREE}.{p.stem}" for p in (REPO / "models" / "common").glob("*.py") if p.stem != "__init__")
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(HEAVY)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"


def test_tasks_holds_one_package_per_concern_and_no_loose_module():
    """tasks/: the stage packages, serving/ (the engines' client side), responses/ and runtime/; nothing loose."""
    loose = sorted(p.name for p in (REPO / "tasks").glob("*.py") if p.name != "__init__.py")
    assert loose == []
