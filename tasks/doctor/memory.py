"""Doctor: the capture's memory per GPU and per node (eagle3 plan's figures, tasks/capture/memory.py) against the
config's distributed.gpu_memory_gib and distributed.host_memory_gib."""

from __future__ import annotations

from models.common.findings import Finding
from tasks.capture.memory import MemoryPlan, MemoryTooSmall, check_memory


def memory_finding(plan: MemoryPlan, *, enforced: bool) -> Finding:
    """PASS with the figures, or FAIL with them and the ways out; `enforced` False (a vLLM server the capture does
    not start): the figures, as a PASS that says they were not checked."""
    if not enforced:
        return Finding(
            "memory: capture", "PASS", f"{plan.summary()} (a server the capture does not start: not checked)"
        )
    try:
        check_memory(plan)
    except MemoryTooSmall as exc:
        too_much, _, ways = str(exc).removeprefix(plan.summary() + ". ").partition(" Ways out: ")
        return Finding("memory: capture", "FAIL", f"{plan.summary()}. {too_much}", ways[:500])
    return Finding("memory: capture", "PASS", plan.summary())
