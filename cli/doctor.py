"""`eagle3 doctor`: every preflight check of a config (flows/preflight.py), as a table."""

from __future__ import annotations

import time
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.preflight import doctor_findings, short_name
from models.common.findings import Finding
from settings.run import RunConfig

STATUS_STYLE = {"PASS": "green", "WARN": "yellow", "FAIL": "bold red"}


def render(findings: list[tuple[str, Finding]], title: str) -> Table:
    table = Table(title=title, title_justify="left")
    for column in ("group", "check", "status", "seen", "what to do"):
        table.add_column(column, overflow="fold")
    for group, f in findings:
        table.add_row(
            escape(group),
            escape(short_name(group, f)),
            f"[{STATUS_STYLE[f.status]}]{f.status}[/]",
            escape(f.detail),
            escape(f.advice),
        )
    return table


def print_doctor(config: RunConfig, config_path: Path, console: Console) -> bool:
    """`eagle3 doctor`: every check, as a table; False when one FAILs."""
    started = time.monotonic()
    findings = doctor_findings(config)
    console.print(render(findings, f"{config_path}: checks ({time.monotonic() - started:.1f} s)"))
    counts = {s: sum(f.status == s for _, f in findings) for s in STATUS_STYLE}
    console.print(f"{counts['PASS']} passed, {counts['WARN']} warnings, {counts['FAIL']} failed", highlight=False)
    return not counts["FAIL"]
