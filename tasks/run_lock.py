"""One writer per run directory: an exclusive OS lock on RUN_DIR/.lock for as long as a stage writes.

The lock is `flock(2)` on an open file, so it belongs to the process and dies with it: a kill -9
leaves nothing stale to clean up. The holder writes who it is (host, pid, command, Prefect flow run,
since when) into the file, so a second writer is refused at once with a message that names it.
Readers (`eagle3 stats`, `plan`, `validate`) never take the lock.

Within one process the lock is re-entrant: the pipeline flow holds it and the stage flows it runs
as subflows take it again without blocking.

Caveat: flock is reliable on local filesystems. On NFS it is emulated with POSIX locks by Linux
clients (v4 lock leases), and some network filesystems (older NFS without lockd, some FUSE mounts)
ignore it: there, two machines could both "hold" the lock. Run one pipeline per run directory.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

LOCK_NAME = ".lock"

_held: dict[Path, list[Any]] = {}  # resolved run dir -> [fd, depth]
_guard = threading.Lock()


class RunDirLocked(RuntimeError):
    """Another process is writing this run directory."""

    def __init__(self, run_dir: Path, holder: dict[str, Any]):
        self.run_dir = run_dir
        self.holder = holder
        super().__init__(
            f"{run_dir} is in use by another writer: {describe_holder(holder)}. Only one process may write a run "
            "directory. Wait for that one to finish, or stop it (it can be resumed later); `eagle3 stats` and "
            "`eagle3 plan` work meanwhile. If that process is gone and this message stays, the lock is held "
            f"from another machine that mounts {run_dir} (see docs/operations.md, 'One writer per run directory')."
        )


def describe_holder(holder: dict[str, Any]) -> str:
    """`pid 123 on host-a, `eagle3 generate x.yaml`, flow run 'generate x' (id …), since 2026-…`."""
    if not holder:
        return "a process that has not yet said who it is"
    bits = [f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"]
    if holder.get("command"):
        bits.append(f"`{holder['command']}`")
    if holder.get("purpose"):
        bits.append(f"writing {holder['purpose']}")
    if holder.get("flow_run"):
        bits.append(f"flow run {holder['flow_run']}")
    if holder.get("since"):
        bits.append(f"since {holder['since']}")
    return ", ".join(bits)


def read_holder(run_dir: Path) -> dict[str, Any]:
    """What the current holder wrote into RUN_DIR/.lock ({} when free or unreadable)."""
    try:
        text = (Path(run_dir) / LOCK_NAME).read_text(encoding="utf-8")
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


@contextmanager
def run_lock(run_dir: Path | str, purpose: str) -> Iterator[None]:
    """Hold the run directory's write lock for the block; RunDirLocked at once if someone else has it."""
    key = Path(run_dir).resolve()
    with _guard:
        entry = _held.get(key)
        if entry is not None:
            entry[1] += 1
        else:
            _held[key] = [_acquire(key, purpose), 1]
    try:
        yield
    finally:
        with _guard:
            entry = _held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                _release(entry[0])


def _acquire(run_dir: Path, purpose: str) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirLocked(run_dir, read_holder(run_dir)) from None
    except BaseException:
        os.close(fd)
        raise
    info = json.dumps(_holder_info(purpose)).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
    except OSError:  # a full disk: the lock holds all the same, only the holder's name is not shown
        pass
    return fd


def _release(fd: int) -> None:
    try:
        os.ftruncate(fd, 0)  # still ours: no one can have taken it yet
    except OSError:
        pass
    os.close(fd)  # releases the flock


def _holder_info(purpose: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
        "purpose": purpose,
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if "prefect" not in sys.modules:  # not in a flow run (and importing Prefect only to learn that is slow)
        return info
    try:  # inside a Prefect flow run: name it, that is what the UI shows
        from prefect.runtime import flow_run

        if flow_run.id:
            info["flow_run"] = f"'{flow_run.name}' (id {flow_run.id})"
    except Exception:  # no Prefect context: the command says enough
        pass
    return info
