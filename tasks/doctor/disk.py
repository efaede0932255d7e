"""Doctor: the capture's bytes (eagle3 plan's figures) against the free space where they go.

Before the records exist the capture's size is not known; the token budgets give a floor (every
budgeted completion token is captured, with its prompt besides), which is checked instead.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from models.common.findings import Finding
from tasks.capture.plan import CapturePlan, DiskTooSmall, check_fits, human_bytes

LOW_FREE_BYTES = 1 << 30  # a run directory's responses, records and logs: a WARN below 1 GiB free


def disk_findings(plan: CapturePlan, *, budget_tokens: int, run_dir: Path) -> list[Finding]:
    """The capture's plan (records built) or its floor from the budgets (not yet), and the run directory's room."""
    out: list[Finding] = []
    if plan.tokens_total:
        seen = (
            f"{plan.tokens_todo:,} tokens to capture x {plan.bytes_per_token:,} B = {human_bytes(plan.bytes_needed)}; "
            f"{human_bytes(plan.free_bytes)} free in {plan.out_dir}"
        )
        try:
            check_fits(plan)
            out.append(Finding("disk: capture", "PASS", seen))
        except DiskTooSmall as exc:
            out.append(Finding("disk: capture", "FAIL", seen, str(exc)[:500]))
    elif budget_tokens:
        floor = budget_tokens * plan.bytes_per_token
        seen = (
            f"records not built yet; the budgets' {budget_tokens:,} completion tokens alone need "
            f"{human_bytes(floor)} ({plan.bytes_per_token:,} B a token, prompts add to it); "
            f"{human_bytes(plan.free_bytes)} free in {plan.out_dir}"
        )
        if floor > plan.usable_bytes:
            out.append(
                Finding(
                    "disk: capture",
                    "FAIL",
                    seen,
                    "capture.out_dir on a bigger disk, smaller token budgets, or train online (train.mode: online)",
                )
            )
        else:
            out.append(Finding("disk: capture", "PASS", seen))
    else:
        out.append(
            Finding(
                "disk: capture",
                "PASS",
                f"records not built yet and no token budget to size them; "
                f"{human_bytes(plan.free_bytes)} free in {plan.out_dir}",
            )
        )
    if plan.temp_dir is not None:
        where = (
            "on the shards' filesystem (counted above)"
            if plan.temp_usable_bytes is None
            else f"{human_bytes(plan.temp_usable_bytes)} usable there"
        )
        seen = f"vLLM connector files: up to {human_bytes(plan.temp_bytes)} at once in {plan.temp_dir}, {where}"
        out.append(
            Finding(
                "disk: vLLM connector",
                "PASS" if plan.temp_fits else "FAIL",
                seen,
                ""
                if plan.temp_fits
                else "capture.engine.shared_dir on a bigger filesystem, or a lower capture.engine.max_concurrency",
            )
        )
    free = shutil.disk_usage(_existing(run_dir)).free
    if free < LOW_FREE_BYTES:
        out.append(
            Finding(
                "disk: run directory",
                "WARN",
                f"{human_bytes(free)} free in {run_dir}",
                "responses, records and logs go there: free some space or move run_dir",
            )
        )
    else:
        out.append(Finding("disk: run directory", "PASS", f"{human_bytes(free)} free in {run_dir}"))
    return out


def _existing(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return path
