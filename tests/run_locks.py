"""A run directory's writer lock held by another process, for the tests of everything that must refuse it."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@contextmanager
def lock_held_elsewhere(run: Path, stage: str) -> Iterator[subprocess.Popen]:
    """`run_lock(run, stage)` taken by a child process and held until the block ends; the child (its pid)."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys; from tasks.runtime.run_lock import run_lock\n"
            f"with run_lock({str(run)!r}, {stage!r}):\n    print('held', flush=True); sys.stdin.read()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    try:
        assert holder.stdout.readline().strip() == "held"  # the lock is taken before this line is printed
        yield holder
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
