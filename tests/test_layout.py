"""The layout rules the code relies on: imports point cli -> flows -> tasks -> models -> settings; no private name
crosses files."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("cli", "flows", "tasks", "models", "settings", "emulators", "bench", "tools", "tests")
LAYER = {"cli": 4, "flows": 3, "tasks": 2, "models": 1, "settings": 0}
# emulators/ (the engines emulated, for the demo and the tests) stand beside the layers: they use models/ (the tiny
# target's decoding) and settings/, and no layer above them; of the layers only the CLI's `serve-dev` imports them (the
# demo and the stages start the dev server as a process and reach every engine over HTTP).
EMULATORS_MAY_IMPORT = {"models", "settings", "emulators"}
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


@pytest.mark.parametrize("package", list(LAYER))
def test_imports_point_cli_to_flows_to_tasks_to_models_to_settings(package):
    upward = imports_in(package, lambda top: top in LAYER and LAYER[top] > LAYER[package])
    assert upward == []


def test_models_import_no_prefect_or_httpx():
    found = imports_in("models", lambda top: top in ("prefect", "httpx"))
    assert found == []


def test_emulators_import_models_and_settings_only():
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


def loaded_by_importing(package: str, watched: tuple[str, ...]) -> list[str]:
    """Which of the `watched` top-level packages a fresh process holds once it imported every module of `package`."""
    root = REPO.joinpath(*package.split("."))
    names = sorted(
        ".".join((package, *p.relative_to(root).with_suffix("").parts))
        for p in root.rglob("*.py")
        if p.stem != "__init__"
    )
    script = (
        "import importlib, sys\n"
        f"for name in {names!r}: importlib.import_module(name)\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & {set(watched)!r}))\n"
    )
    done = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, check=True)
    return ast.literal_eval(done.stdout.strip())


def test_models_common_imports_no_torch():
    assert loaded_by_importing(TORCH_FREE, HEAVY) == []


# settings/ is every setting, declared once, under every layer: the standard library and pydantic only, so that the
# CLI, a flow, a task and a rank process all read one declaration without paying for torch, Prefect or an HTTP client.
SETTINGS_MAY_IMPORT = {"pydantic", "pydantic_core", "settings", "__future__"}
NOT_IN_SETTINGS = ("torch", "transformers", "deepspeed", "prefect", "httpx", "pyarrow", "yaml")


def test_settings_import_the_standard_library_and_pydantic_only():
    found = imports_in("settings", lambda top: top not in SETTINGS_MAY_IMPORT and top not in sys.stdlib_module_names)
    assert found == []


def test_importing_every_settings_module_loads_no_torch_prefect_httpx_or_pyarrow():
    assert loaded_by_importing("settings", NOT_IN_SETTINGS) == []


def test_tasks_holds_one_package_per_concern_and_no_loose_module():
    """tasks/: the stage packages, serving/ (the engines' client side), responses/ and runtime/; nothing loose."""
    loose = sorted(p.name for p in (REPO / "tasks").glob("*.py") if p.name != "__init__.py")
    assert loose == []
