"""Stopping a command on SIGTERM or SIGINT: every child it started is gone, and the command with it, within seconds.

`eagle3 run`, `generate`, `eval` and `demo` start children in process groups of their own: the serving engines
(tasks/serving/launch.py), the rank jobs (tasks/runtime/launch_ranks.py, whose launchers start each rank in yet another
session), Prefect's temporary API server (tasks/runtime/prefect_api.py). Each is `track`ed while it runs.

Within `stop_on_signals()` (the CLI's `main`) both signals take the path Ctrl-C always took: the first raises
`Interrupted`, a KeyboardInterrupt, in the main thread, so every `finally` stops what it started (servers stopped,
rank jobs killed), Prefect marks the flow run Crashed and the generate loop is cancelled (Prefect's
`run_coro_as_sync` cancels its coroutine on KeyboardInterrupt only) and flushes what arrived. A watchdog thread
started by that signal kills every tracked child (its process group and every descendant, read from /proc) and
ends the process `STOP_DEADLINE_S` after the signal if it is still there; a second signal does the same at once.
What was checkpointed stays: the generate stage's parts are atomic and resume by prompt id
(tasks/responses/checkpoints.py), so a rerun sends each prompt not yet answered exactly once.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

STOP_DEADLINE_S = 8.0  # from the first signal to the watchdog's kill: the command is gone well within 10 s
KILL_RESERVE_S = 3.0  # of that deadline, what a graceful stop leaves for the rest (crash report, Prefect's server)
SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)  # SIGHUP: the terminal or the ssh session went away

_children: dict[int, str] = {}  # pid of a process group leader this process started -> what it is
_lock = threading.Lock()
_first: tuple[int, float] | None = None  # (signal, time.monotonic()) of the first stop signal
_installed = False


class Interrupted(KeyboardInterrupt):
    """SIGTERM or SIGINT arrived: the command stops (a KeyboardInterrupt, so every `except Exception` lets it by)."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def track(process: subprocess.Popen, what: str) -> None:
    """Remember `process`, the leader of a process group of its own, until `untrack`: the watchdog kills it."""
    with _lock:
        _children[process.pid] = what


def untrack(process: subprocess.Popen) -> None:
    with _lock:
        _children.pop(process.pid, None)


def tracked() -> dict[int, str]:
    """The tracked children still running or not yet reaped: pid -> what."""
    with _lock:
        return dict(_children)


def stopping() -> bool:
    """A stop signal has arrived."""
    return _first is not None


def signalled() -> tuple[int, float] | None:
    """The first stop signal and the seconds since it came; None before one came."""
    return None if _first is None else (_first[0], time.monotonic() - _first[1])


def grace_s(default_s: float) -> float:
    """How long a graceful stop (SIGTERM, then wait) may take now: `default_s`, less once a stop signal has arrived,
    so that the stop fits the watchdog's deadline with time left for the rest."""
    if _first is None:
        return default_s
    left = _first[1] + STOP_DEADLINE_S - KILL_RESERVE_S - time.monotonic()
    return max(0.5, min(default_s, left))


def descendants(pid: int) -> list[int]:
    """Every live descendant of `pid` (children first), from /proc: also those in sessions of their own."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def kill_tree(pid: int) -> None:
    """SIGKILL the process group `pid` leads and every descendant of `pid`, with the group each of them leads
    (torchrun and the deepspeed launcher start ranks in sessions of their own, out of the launcher's group).

    The descendants are read before the kill: once their parent is gone they are the init process's children.
    """
    kill_group_and(pid, descendants(pid))


def kill_group_and(pgid: int, pids: list[int]) -> None:
    """SIGKILL the process group `pgid`, each of `pids` and the group each of them leads; never this process's group.
    What is gone already is skipped."""
    own = os.getpgrp()
    for p in [pgid, *pids]:
        with contextlib.suppress(OSError):  # gone already
            if p != own and (p == pgid or os.getpgid(p) == p):
                os.killpg(p, signal.SIGKILL)
        with contextlib.suppress(OSError):
            if p != os.getpid():
                os.kill(p, signal.SIGKILL)


def kill_all() -> list[str]:
    """Kill every tracked child (`kill_tree`); what they were."""
    children = tracked()
    for pid in children:
        kill_tree(pid)
    return list(children.values())


@contextlib.contextmanager
def stop_on_signals() -> Iterator[None]:
    """Within: SIGTERM and SIGINT stop the command (see the module's docstring), and SIGHUP unless it is ignored.

    On the way out, a child still tracked is killed: nothing this process started outlives it, whatever the
    signal interrupted (even a `finally` on its way to stop that child).
    """
    global _installed
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers are the main thread's
        return
    # a SIGHUP ignored on entry (`nohup eagle3 ...`) stays ignored
    handled = [s for s in SIGNALS if s != signal.SIGHUP or signal.getsignal(s) == signal.SIG_DFL]
    previous = {s: signal.signal(s, _on_signal) for s in handled}
    _installed = True
    try:
        yield
    finally:
        left = kill_all()
        if left:
            _say(f"eagle3: killed what was still running: {', '.join(left)}")
        _installed = False
        for s, handler in previous.items():
            signal.signal(s, handler)


def installed() -> bool:
    """`stop_on_signals` is in force: the command's own SIGTERM handler is the one to keep."""
    return _installed


def keep_handlers_in_flows() -> None:
    """Within `stop_on_signals`, keep its SIGTERM handler while Prefect runs flows in this process.

    Prefect 3.9.1's flow engine swaps in its own SIGTERM handler for a flow run (prefect/flow_engine.py runs the flow
    inside `capture_sigterm()`, prefect/utilities/engine/__init__.py), which raises `TerminationSignal`. That is not a
    KeyboardInterrupt, so `run_coro_as_sync` (prefect/utilities/asyncutils/__init__.py) leaves the async generate
    subflow running in its loop thread while the servers it talks to are stopped; and once the crash is reported the
    bridge sends SIGTERM again to the handler it replaced. The bridge exists for a runner that cancels a deployment's
    run through it (prefect/_internal/control_listener.py); the CLI's process has no runner, so here the flows run
    without it. A worker's flow runs (`prefect deployment run`) never come here and keep it.
    """
    if not _installed:
        return
    import prefect.flow_engine

    prefect.flow_engine.capture_sigterm = contextlib.nullcontext  # type: ignore[assignment]


def _on_signal(signum: int, frame: object) -> None:
    global _first
    name = signal.Signals(signum).name
    if _first is None:
        _first = (signum, time.monotonic())
        _say(
            f"eagle3: {name}: stopping the servers, rank jobs and Prefect's temporary server; "
            f"whatever is left is killed in {STOP_DEADLINE_S:g} s"
        )
        threading.Thread(target=_watchdog, name="eagle3-stop-watchdog", daemon=True).start()
        raise Interrupted(signum)
    _say(f"eagle3: {name} again: killing every child now")
    _kill_and_exit(signum)


def _watchdog() -> None:
    assert _first is not None
    signum, since = _first
    time.sleep(max(0.0, since + STOP_DEADLINE_S - time.monotonic()))
    _say(f"eagle3: still stopping {STOP_DEADLINE_S:g} s after {signal.Signals(signum).name}: killing every child")
    _kill_and_exit(signum)


def _say(line: str) -> None:
    """A line to stderr, unbuffered: from a signal handler or the watchdog, a buffered stream's lock may be held by
    the very code the signal interrupted."""
    with contextlib.suppress(OSError):
        os.write(2, (line + "\n").encode("utf-8", "replace"))


def _kill_and_exit(signum: int) -> None:
    left = kill_all()
    _say(
        f"eagle3: stopped by {signal.Signals(signum).name}"
        + (f" (killed: {', '.join(left)})" if left else "")
        + "; what was checkpointed is kept: run the same command again to resume"
    )
    exit_now(128 + signum)


def exit_now(code: int) -> NoReturn:
    """End the process with `code` once its output is flushed, skipping the interpreter's shutdown.

    For a command stopped by a signal, whose children are stopped already: the shutdown (atexit hooks, then
    garbage-collecting torch's, transformers' and Prefect's objects) took 4 to 6 s more on a busy 2-core machine,
    and nothing in it is needed: checkpoints are atomic (a part being written is lost, not torn), locks are flock(2)s.
    """
    with contextlib.suppress(Exception):
        sys.stdout.flush()
        sys.stderr.flush()
    os._exit(code)
