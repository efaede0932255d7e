"""docs/config-keys.md is what `make config-keys` writes from the schema now, and it lists every key the presets use."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from settings.keys import PAGE, page

REPO = Path(__file__).resolve().parents[2]


def test_the_page_is_current():
    assert PAGE.read_text() == page(), "docs/config-keys.md is stale: run `make config-keys` (do not edit it by hand)"


def rows(text: str) -> dict[str, dict[str, str]]:
    """section heading -> {key: its row}, read back from the markdown."""
    found: dict[str, dict[str, str]] = {}
    section = ""
    for line in text.splitlines():
        heading = re.match(r"## `(.+)`$", line)
        if heading or line == "## The top level":
            section = heading.group(1) if heading else ""
            found[section] = {}
        key = re.match(r"\| `(\w+)` \|", line)
        if key:
            found[section][key.group(1)] = line
    return found


def keys_of(data: dict, prefix: str = "") -> list[tuple[str, str]]:
    """(section, key) of every key in a config file's data, nested sections and lists of sections included."""
    found = []
    for key, value in data.items():
        found.append((prefix, key))
        inner = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict) and key not in ("draft_overrides",):
            found += keys_of(value, inner)
        if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for item in value:
                found += keys_of(item, f"{inner}[]")
    return found


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "configs").glob("*.yaml")))
def test_every_key_a_preset_uses_is_on_the_page(preset):
    table = rows(PAGE.read_text())
    data = yaml.safe_load((REPO / "configs" / preset).read_text())
    missing = [f"{s}.{k}" if s else k for s, k in keys_of(data) if k not in table.get(s, {})]
    assert missing == []


def test_a_row_says_type_bounds_default_and_description():
    # values written by hand from settings/train.py and settings/target.py, not read from the schema
    lr = rows(PAGE.read_text())["train"]["lr"]
    want = "Peak learning rate (AdamW's; Muon's is derived from it, see optimizer)."
    assert lr == f"| `lr` | float (> 0) | `0.0001` | {want} |"
    target = rows(PAGE.read_text())["target"]["path"]
    assert "| str | required |" in target
    assert "| `benchmarks` |" in rows(PAGE.read_text())["eval"]["benchmarks"]
