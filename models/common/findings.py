"""A check's finding: PASS, WARN (works, but not as tested or not as meant) or FAIL (a later step would fail).

`eagle3 doctor` (flows/preflight.py), the pipeline's preflight and tools/gpu_check.py all report in
findings: one line of what was seen and, unless it passed, one line of what to do.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

STATUSES = ("PASS", "WARN", "FAIL")


@dataclass(frozen=True)
class Finding:
    """One check's outcome: PASS | WARN | FAIL, what was seen, what to do."""

    name: str
    status: str
    detail: str
    advice: str = ""

    def __post_init__(self) -> None:
        if self.status not in STATUSES:
            raise ValueError(f"finding {self.name!r}: status {self.status!r} is not one of {', '.join(STATUSES)}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def failed(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.status == "FAIL"]
