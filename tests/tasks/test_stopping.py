"""tasks/runtime/stopping.py on its own: killing a tree that left its group, the watchdog's deadline, a second signal.

Each case runs a small Python program (no Prefect, no torch) that uses the module as the CLI does, and reads what it
prints to know when it is ready to be signalled.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tasks.runtime import stopping

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.multiprocess

# Inside stop_on_signals: a child in a session of its own (tracked, as the servers and rank jobs are), which starts a
# grandchild in yet another session (as torchrun starts its ranks); then runs `BODY`, whose `ready()` prints both pids
# (where the signal is to land). The children's output goes nowhere: one that outlived the program would keep its
# pipes open.
PROGRAM = """
import os, subprocess, sys, time
from tasks.runtime import stopping
stopping.STOP_DEADLINE_S = {deadline}
with stopping.stop_on_signals():
    child = subprocess.Popen(
        [sys.executable, "-c", "import subprocess, sys, time; "
         "g = subprocess.Popen(['sleep', '300'], start_new_session=True); print(g.pid, flush=True); time.sleep(300)"],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, start_new_session=True,
    )
    stopping.track(child, "a test child")
    grandchild = int(child.stdout.readline())
    child.stdout.close()
    ready = lambda: print(child.pid, grandchild, flush=True)
{body}
"""


def start(body: str, deadline: float = 8.0) -> tuple[subprocess.Popen, list[int]]:
    program = PROGRAM.format(deadline=deadline, body=textwrap.indent(textwrap.dedent(body), "    "))
    process = subprocess.Popen(
        [sys.executable, "-c", program],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert process.stdout is not None
    pids = [int(p) for p in process.stdout.readline().split()]
    assert len(pids) == 2, process.stderr.read() if process.stderr else ""
    return process, pids


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def gone(pids: list[int], within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)  # bounded: SIGKILLed processes take a moment to go
    return not any(alive(p) for p in pids)


def test_kill_tree_reaches_a_grandchild_in_a_session_of_its_own():
    child = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess, time; g = subprocess.Popen(['sleep', '300'], start_new_session=True); "
            "print(g.pid, flush=True); time.sleep(300)",
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert child.stdout is not None
    grandchild = int(child.stdout.readline())
    assert os.getsid(grandchild) not in (os.getsid(child.pid), os.getsid(0))
    stopping.kill_tree(child.pid)
    child.wait(timeout=10)
    assert gone([grandchild])


def test_sigterm_becomes_an_interrupt_and_nothing_tracked_outlives_the_command():
    process, pids = start("""
        try:
            ready()
            time.sleep(300)
        except KeyboardInterrupt as stop:
            print(type(stop).__name__, stopping.stopping(), flush=True)
            raise
    """)
    process.send_signal(signal.SIGTERM)
    out, err = process.communicate(timeout=30)
    assert out.split() == ["Interrupted", "True"], err
    assert "eagle3: SIGTERM: stopping" in err
    assert gone(pids), "the tracked child or its grandchild outlived the command"


def test_the_watchdog_ends_a_command_whose_cleanup_hangs():
    process, pids = start(
        """
        try:
            ready()
            time.sleep(300)
        except KeyboardInterrupt:
            time.sleep(300)  # a cleanup that never ends
        """,
        deadline=2.0,
    )
    started = time.monotonic()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=30)
    took = time.monotonic() - started
    assert process.returncode == 128 + signal.SIGTERM, err
    assert 2.0 <= took < 6.0, took
    assert "still stopping 2 s after SIGTERM" in err and "a test child" in err, err
    assert gone(pids)


def test_a_second_signal_kills_at_once():
    process, pids = start("""
        try:
            ready()
            time.sleep(300)
        except KeyboardInterrupt:
            print("cleaning up", flush=True)
            time.sleep(300)
    """)
    process.send_signal(signal.SIGINT)
    assert process.stdout is not None and process.stdout.readline() == "cleaning up\n"
    started = time.monotonic()
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=30)
    assert process.returncode == 128 + signal.SIGINT, err
    assert time.monotonic() - started < 3.0
    assert "SIGINT again: killing every child now" in err
    assert gone(pids)


def test_grace_shrinks_once_a_signal_came(monkeypatch):
    assert stopping.grace_s(10.0) == 10.0
    monkeypatch.setattr(stopping, "_first", (signal.SIGTERM, time.monotonic()))
    assert stopping.grace_s(10.0) == pytest.approx(stopping.STOP_DEADLINE_S - stopping.KILL_RESERVE_S, abs=0.5)
    monkeypatch.setattr(stopping, "_first", (signal.SIGTERM, time.monotonic() - 60))
    assert stopping.grace_s(10.0) == 0.5  # past the deadline: a last half second
