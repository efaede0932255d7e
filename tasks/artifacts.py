"""Prefect artifact keys: every stage names its progress bars and tables the same way."""

from __future__ import annotations

import re


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from free-form parts."""
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts if p)
