"""The longest silence of a command: run it, timestamp each output line, report the longest gaps between lines.

    .venv/bin/python bench/silence.py [--top N] -- .venv/bin/eagle3 demo --run-dir /tmp/silence-demo

stdout and stderr are read merged through a pipe, as a log file or CI reads a command (no PYTHONUNBUFFERED: output
that a program holds back in a buffer while it writes to a pipe counts as silence, as it would in a log). A line
ends at a newline or a carriage return (a progress bar's redraw). Each line is printed with its time since the
start; the report gives the longest gaps, each with the line before and the line after it, and exits with the
command's exit code.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from typing import IO


def timed_lines(command: list[str]) -> tuple[list[tuple[float, str]], float, int]:
    """Run `command`: its output lines with their times (s since start), the time it ended and its exit code."""
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert process.stdout is not None
    lines: list[tuple[float, str]] = []
    pending = b""
    while chunk := os.read(process.stdout.fileno(), 65536):
        now = time.monotonic() - started
        parts = re.split(rb"[\r\n]", pending + chunk)
        pending = parts.pop()
        for part in parts:
            if part.strip():
                lines.append((now, part.decode("utf-8", "replace")))
                print(f"[{now:7.1f}s] {lines[-1][1]}", flush=True)
    if pending.strip():
        lines.append((time.monotonic() - started, pending.decode("utf-8", "replace")))
    return lines, time.monotonic() - started, process.wait()


def gaps(lines: list[tuple[float, str]], ended: float) -> list[tuple[float, float, str, str]]:
    """(gap, time, line before, line after) for each gap, from the start to the end, longest first."""
    marks = [(0.0, "(start)"), *lines, (ended, "(exit)")]
    found = [(b[0] - a[0], a[0], a[1], b[1]) for a, b in zip(marks, marks[1:], strict=False)]
    return sorted(found, reverse=True)


def report(lines: list[tuple[float, str]], ended: float, top: int, out: IO[str]) -> None:
    print(f"\n{len(lines):,} lines in {ended:.1f} s; the longest silences:", file=out)
    for gap, at, before, after in gaps(lines, ended)[:top]:
        print(f"  {gap:6.1f} s after {at:7.1f} s: {before[:110]!r}\n  {'':6}   then: {after[:110]!r}", file=out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--top", type=int, default=5, help="how many of the longest gaps to report")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="the command, after --")
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("give the command after --")
    lines, ended, code = timed_lines(command)
    report(lines, ended, args.top, sys.stdout)
    return code


if __name__ == "__main__":
    sys.exit(main())
