"""One writer per run directory: an exclusive OS lock on RUN_DIR/.lock for as long as a stage writes.

A stage that writes outside RUN_DIR (capture.out_dir, capture.engine.shared_dir, train.out_dir set to
other paths) also locks `.lock` in each of those: two runs whose configs name one capture.out_dir would
otherwise both write `shard-000-*` there, and the second's names would replace the first's shards.

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
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from settings.layout import LOCK_NAME

_held: dict[Path, list[Any]] = {}  # resolved run dir -> [fd, depth]
_guard = threading.Lock()
# What a writer found in `.lock` when it took the lock: a holder that never released it (a release empties the file),
# i.e. a process killed while it wrote. Its flow runs still say Running in Prefect (tasks/runtime/dead_runs.py ends
# them).
_dead: dict[Path, dict[str, Any]] = {}


class RunDirLocked(RuntimeError):
    """Another process is writing this run directory (or an output directory of it outside RUN_DIR)."""

    def __init__(self, run_dir: Path, holder: dict[str, Any], setting: str | None = None):
        self.run_dir = run_dir
        self.holder = holder
        self.setting = setting
        what = (
            "a run directory"
            if setting is None
            else (
                f"it ({setting} of this run; another run's config may name the same directory: give each run its own)"
            )
        )
        super().__init__(
            f"{run_dir}{'' if setting is None else f' ({setting})'} is in use by another "
            f"{'reader' if holder.get('reads') else 'writer'}: {describe_holder(holder)}"
            f"{' (the last reader to start; others may read it too)' if holder.get('reads') else ''}. "
            f"Only one process may write {what}. Wait for that one to finish, or stop it (it can be resumed later); "
            "`eagle3 stats` and `eagle3 plan` work meanwhile. If that process is gone and this message stays, the lock "
            f"is held from another machine that mounts {run_dir} "
            "(see docs/operate-and-recover.md, 'One writer per run directory')."
        )


def describe_holder(holder: dict[str, Any]) -> str:
    """`pid 123 on host-a, `eagle3 generate x.yaml`, flow run 'generate x' (id …), since 2026-…`."""
    if not holder:
        return "a process that has not yet said who it is"
    bits = [f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}"]
    if holder.get("command"):
        bits.append(f"`{holder['command']}`")
    if holder.get("purpose"):
        bits.append(f"{'reading it for' if holder.get('reads') else 'writing'} {holder['purpose']}")
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


def lock_holder(run_dir: Path | str) -> dict[str, Any] | None:
    """Who holds RUN_DIR's write lock, as it wrote it ({} when it has not said yet); None when it is free or ours.

    Probed with a shared, non-blocking flock released at once: readers are not disturbed, and a
    writer starting at that very instant may be refused once (it says so and can be run again).
    """
    root = Path(run_dir).resolve()
    with _guard:
        if root in _held:
            return None
    try:
        fd = os.open(root / LOCK_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return read_holder(root)
    finally:
        os.close(fd)  # releases the probe's lock, if it got one
    return None


@contextmanager
def run_lock(
    run_dir: Path | str, purpose: str, also: Iterable[tuple[str, Path]] = (), reads: Iterable[tuple[str, Path]] = ()
) -> Iterator[None]:
    """Hold the run directory's write lock for the block; RunDirLocked at once if someone else has it.

    `also`: (setting, directory) pairs the block writes besides RUN_DIR (capture.out_dir on a bigger
    disk, ...). Each one outside RUN_DIR gets its own `.lock`, so two runs whose configs name the same
    output directory cannot both write it. `reads`: directories outside RUN_DIR the block only reads
    (training from another run's capture.out_dir): a shared lock, which any number of readers hold at
    once and which keeps a writer out until they are done (and them out while it writes).
    """
    root = Path(run_dir).resolve()
    with ExitStack() as stack:
        stack.enter_context(_locked(root, purpose, None, exclusive=True))
        for pairs, exclusive in ((also, True), (reads, False)):
            for setting, directory in pairs:
                directory = Path(directory).resolve()
                if not directory.is_relative_to(root):
                    stack.enter_context(_locked(directory, purpose, setting, exclusive=exclusive))
        yield


@contextmanager
def _locked(key: Path, purpose: str, setting: str | None, *, exclusive: bool) -> Iterator[None]:
    with _guard:
        entry = _held.get(key)
        if entry is not None:
            if exclusive and not entry[2]:
                # flock cannot turn a shared lock into an exclusive one atomically (it may lose it on the way):
                # the outermost block must ask for what the inner ones write (RunConfig.written_dirs)
                raise RuntimeError(
                    f"{key} is locked for reading in this process; lock it for writing in the outer block"
                )
            entry[1] += 1
            if exclusive:
                _note_flow_run(entry[0])  # a flow run of this process writes under the lock from now on
        else:
            _held[key] = [_acquire(key, purpose, setting, exclusive), 1, exclusive]
    try:
        yield
    finally:
        with _guard:
            entry = _held[key]
            entry[1] -= 1
            if entry[1] == 0:
                del _held[key]
                _release(entry[0], entry[2])


def _acquire(run_dir: Path, purpose: str, setting: str | None, exclusive: bool) -> int:
    run_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise RunDirLocked(run_dir, read_holder(run_dir), setting) from None
    except BaseException:
        os.close(fd)
        raise
    if exclusive:
        left = _read_fd(fd)
        if left and not left.get("reads"):  # readers leave their names on purpose; a writer empties the file
            _dead[run_dir] = left
    _write_holder(fd, purpose, exclusive)
    return fd


def dead_holder(run_dir: Path | str) -> dict[str, Any] | None:
    """The holder this process found in RUN_DIR/.lock when it took the lock, one that had never released it (killed,
    or its machine stopped); None if the lock was left cleanly. Given once: the next call says None."""
    with _guard:
        return _dead.pop(Path(run_dir).resolve(), None)


def _read_fd(fd: int) -> dict[str, Any]:
    try:
        text = os.pread(fd, 1 << 16, 0).decode("utf-8")
        return json.loads(text) if text.strip() else {}
    except (OSError, ValueError):
        return {}


def note_flow_run(run_dir: Path | str) -> None:
    """Name the current flow run in RUN_DIR/.lock, which this process holds (a stage flow run under the lock the
    command or the pipeline took: tasks/runtime/dead_runs.py ends it if the holder is killed)."""
    with _guard:
        entry = _held.get(Path(run_dir).resolve())
        if entry is None or not entry[2]:
            raise RuntimeError(f"{run_dir} is not locked for writing by this process")
        _note_flow_run(entry[0])


def _note_flow_run(fd: int) -> None:
    """Add the current flow run to the holder's `flow_run_ids` (a stage's subflow under the pipeline's lock)."""
    run_id = _current_flow_run()
    if run_id is None:
        return
    info = _read_fd(fd)
    if run_id in info.get("flow_run_ids", []):
        return
    info["flow_run_ids"] = [*info.get("flow_run_ids", []), run_id]
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(info).encode(), 0)
    except OSError:  # a full disk: only the note is lost
        pass


def _current_flow_run() -> str | None:
    """The id of the Prefect flow run this thread is in, or None."""
    if "prefect" not in sys.modules:  # not in a flow run (and importing Prefect only to learn that is slow)
        return None
    try:
        from prefect.runtime import flow_run

        return str(flow_run.id) if flow_run.id else None
    except Exception:  # no Prefect context
        return None


def _write_holder(fd: int, purpose: str, exclusive: bool) -> None:
    # Readers each write their own name and leave it: a refused writer learns the last reader to start.
    info = json.dumps(_holder_info(purpose, reads=not exclusive)).encode()
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, info, 0)
    except OSError:  # a full disk: the lock holds all the same, only the holder's name is not shown
        pass


def _release(fd: int, exclusive: bool) -> None:
    if exclusive:  # a reader leaves the name: other readers may still hold the lock
        try:
            os.ftruncate(fd, 0)  # still ours: no one can have taken it yet
        except OSError:
            pass
    os.close(fd)  # releases the flock


def _holder_info(purpose: str, *, reads: bool = False) -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]) if sys.argv and sys.argv[0] else "",
        "purpose": purpose,
        "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }
    if reads:
        info["reads"] = True
    run_id = _current_flow_run()
    if run_id is not None:  # inside a Prefect flow run: name it, that is what the UI shows
        from prefect.runtime import flow_run

        info["flow_run"] = f"'{flow_run.name}' (id {run_id})"
        if not reads:
            info["flow_run_ids"] = [run_id]
    return info
