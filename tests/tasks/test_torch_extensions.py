"""The ranks' torch extensions directory: a killed build's lock cleared within seconds, the comm op built once, said.

The locks here are torch's own (torch.utils.file_baton.FileBaton, as `_jit_compile` takes it), held by real
processes killed with SIGKILL; the slow test kills a real build of DeepSpeed's CPU comm op mid-way.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tasks.runtime import torch_extensions
from tasks.runtime.torch_extensions import COMM_OP, LockUnknown, clear_dead_locks, extensions_dir, lock_holders
from tests.capture_jobs import small_capture_job

REPO = Path(__file__).resolve().parents[2]
# Takes an extension's build lock as torch's _jit_compile does, says so, holds it until its stdin closes.
HOLD = (
    "import sys\n"
    "from torch.utils.file_baton import FileBaton\n"
    "baton = FileBaton(sys.argv[1])\n"
    "assert baton.try_acquire()\n"
    "print('held', flush=True)\n"
    "sys.stdin.read()\n"
    "baton.release()\n"
)
PREPARE = (
    "from tasks.runtime.torch_extensions import prepare\nprepare(cpu=True)\n"  # what rank_command runs before the ranks
)


def _holder(lock: Path) -> subprocess.Popen:
    lock.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _killed_holder(lock: Path) -> None:
    """The lock as a process killed while holding it leaves it: the file, nobody holding it."""
    proc = _holder(lock)
    proc.kill()
    proc.wait()
    assert lock.exists() and lock_holders(lock) == []


def test_the_directory_is_the_virtualenvs_own_unless_one_is_set(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    assert extensions_dir() == Path(sys.prefix) / "torch_extensions" / socket.gethostname()
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extensions_dir() == tmp_path


@pytest.mark.multiprocess
def test_a_lock_whose_holder_was_killed_is_removed_within_seconds(tmp_path):
    lock = tmp_path / COMM_OP / "lock"
    _killed_holder(lock)
    said: list[str] = []
    started = time.monotonic()
    clear_dead_locks(tmp_path, said.append)
    assert time.monotonic() - started < 5
    assert not lock.exists()
    assert said == [
        f"removed {lock}: a build lock left by a killed build (no process holds it); "
        "the extension is loaded, or built again, as usual"
    ]


def test_a_lock_seen_unheld_while_its_holder_releases_it_is_left_to_the_holder(tmp_path, monkeypatch):
    # FileBaton.release closes the file, then removes it: a look in between sees a lock that no process holds.
    lock = tmp_path / COMM_OP / "lock"
    lock.parent.mkdir()
    lock.touch()
    looks: list[int] = []

    def in_the_release(path: Path) -> list[int]:
        looks.append(1)
        if len(looks) == 2:
            path.unlink()  # the holder's os.remove, just after our first look
        return []

    monkeypatch.setattr(torch_extensions, "lock_holders", in_the_release)
    said: list[str] = []
    clear_dead_locks(tmp_path, said.append)
    assert said == [] and len(looks) == 2  # not removed, not said: the holder removed it


@pytest.mark.multiprocess
def test_a_live_holder_is_waited_for_and_named(tmp_path, monkeypatch):
    monkeypatch.setattr(torch_extensions, "HEARTBEAT_S", 0.0)  # a line at every look
    lock = tmp_path / "cpu_adam" / "lock"
    proc = _holder(lock)
    said: list[str] = []
    waiting = threading.Event()

    def say(line: str) -> None:
        said.append(line)
        waiting.set()

    clearing = threading.Thread(target=clear_dead_locks, args=(tmp_path, say))
    clearing.start()
    try:
        assert waiting.wait(30)
        assert lock.exists()  # a live build's lock is never removed
        assert said[0].startswith(f"waiting for pid {proc.pid} (") and f"to finish building in {lock.parent}" in said[0]
    finally:
        assert proc.stdin is not None
        proc.stdin.close()  # the holder releases it, as a finished build does
        proc.wait()
    clearing.join(30)
    assert not clearing.is_alive() and not lock.exists()
    assert not any(line.startswith("removed") for line in said)  # released by its holder, not by us


@pytest.mark.multiprocess
def test_a_compiler_left_working_in_the_build_directory_counts_as_a_holder(tmp_path):
    # kill -9 of a build's python leaves its ninja and compilers running there (ninja gives each its own group).
    lock = tmp_path / COMM_OP / "lock"
    _killed_holder(lock)
    ninja = tmp_path / "bin" / "ninja"
    ninja.parent.mkdir()
    shutil.copy(shutil.which("cat") or "/bin/cat", ninja)  # a process whose name is "ninja", waiting on its stdin
    compiler = subprocess.Popen([str(ninja)], cwd=lock.parent, stdin=subprocess.PIPE)
    try:
        assert lock_holders(lock) == [compiler.pid]
    finally:
        compiler.kill()
        compiler.wait()
    assert lock_holders(lock) == []


def test_a_lock_of_another_user_stops_with_the_command_that_removes_it(tmp_path, monkeypatch):
    lock = tmp_path / COMM_OP / "lock"
    lock.parent.mkdir()
    lock.touch()
    monkeypatch.setattr(os, "geteuid", lambda: lock.stat().st_uid + 1)  # not root, not its owner
    with pytest.raises(LockUnknown) as caught:
        clear_dead_locks(tmp_path, print)
    assert str(caught.value) == (
        f"{lock}: a torch extension build lock of uid {lock.stat().st_uid}, whose processes this user "
        f"(uid {lock.stat().st_uid + 1}) cannot see. If no build is running on this machine, a killed build left it "
        f"and every rank would wait on it forever: remove it (rm {lock}) and launch again"
    )
    assert lock.exists()


def _lines(proc: subprocess.Popen, into: list[tuple[float, str]]) -> threading.Thread:
    """A thread that reads `proc`'s stderr into (monotonic time, line) pairs."""

    def read() -> None:
        assert proc.stderr is not None
        for line in proc.stderr:
            into.append((time.monotonic(), line.rstrip("\n")))

    thread = threading.Thread(target=read, daemon=True)
    thread.start()
    return thread


def _longest_gap(start: float, lines: list[tuple[float, str]], end: float) -> float:
    times = [start, *(t for t, _ in lines), end]
    return max(b - a for a, b in zip(times, times[1:], strict=False))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_build_killed_mid_way_then_two_launches_then_a_capture(tmp_path, monkeypatch, capsys):
    """The issue's hang, for real: DeepSpeed's CPU comm op build killed with SIGKILL mid-build, its lock left.

    The next two launches at once: the lock removed within seconds, the op built by one of them while the other
    waits, each saying what it does at least every 15 s. Then a rank killed holding the lock of the built op: the
    next capture launch (2 torchrun ranks) removes it and finishes within 30 s.
    """
    directory = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(directory))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    lock = directory / COMM_OP / "lock"

    def launch() -> subprocess.Popen:
        return subprocess.Popen(
            [sys.executable, "-c", PREPARE],
            cwd=REPO,
            env=env,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )

    # 1. A launch starts the build; killed (its process group, then the build's) once a compiler runs.
    first = launch()
    first_lines: list[tuple[float, str]] = []
    _lines(first, first_lines)
    deadline = time.monotonic() + 120
    while not any(name in ("cc1plus", "c++") for name in _names(lock_holders(lock))):
        assert time.monotonic() < deadline and first.poll() is None, first_lines
        time.sleep(0.1)  # polling for the compiler to start: the point of the kill
    assert any(f"building DeepSpeed's CPU comm op {COMM_OP} into {lock.parent}" in line for _, line in first_lines)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    while holders := lock_holders(lock):  # the build's python, ninja and compilers: SIGKILL, as a kill -9 does
        for pid in holders:
            _kill(pid)
        assert time.monotonic() < deadline
    assert lock.exists() and not (lock.parent / f"{COMM_OP}.so").exists()

    # 2. Two launches at once: the dead lock removed at once, one build, the other launch waiting for it.
    started = time.monotonic()
    launches = [launch(), launch()]
    lines: list[list[tuple[float, str]]] = [[], []]
    readers = [_lines(p, into) for p, into in zip(launches, lines, strict=True)]
    for proc in launches:
        assert proc.wait(timeout=400) == 0
    ended = time.monotonic()
    for reader in readers:
        reader.join(10)
    said = [line for one in lines for _, line in one]
    removed = [t for one in lines for t, line in one if line.startswith(f"removed {lock}")]
    assert len(removed) == 1 and removed[0] - started < 30, said
    assert sum(line.startswith("building DeepSpeed's CPU comm op") for line in said) == 1, said
    assert sum(line.startswith("waiting for another launch: pid") for line in said) >= 1, said
    assert f"DeepSpeed's CPU comm op {COMM_OP} is built (by the launch waited for)" in said, said
    assert any(line.startswith(f"built {COMM_OP} in ") for line in said), said
    for one in lines:
        assert _longest_gap(started, one, ended) < 15, one
    assert (lock.parent / f"{COMM_OP}.so").is_file() and not lock.exists()

    # 3. A rank killed while it held the built op's lock; the next capture launch finishes within 30 s.
    _killed_holder(lock)
    job = small_capture_job(tmp_path)[1]
    from models.common.rank_protocol import CAPTURE
    from tasks.runtime.launch_ranks import follow_job, rank_command, run_job

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    capsys.readouterr()
    started = time.monotonic()
    command, rank_env = rank_command("models.capture", ["--job", str(job)], num_ranks=2, launcher="torchrun")
    assert rank_env["TORCH_EXTENSIONS_DIR"] == str(directory)
    logged: list[str] = []
    follow_job(
        command,
        protocol=CAPTURE,
        log=logged.append,
        env=rank_env,
        run=lambda c, **kw: run_job(c, timeout_s=120, **kw),
    )
    elapsed = time.monotonic() - started
    assert f"removed {lock}: a build lock left by a killed build" in capsys.readouterr().err
    assert list((tmp_path / "hidden").glob("shard-*.safetensors")), logged
    assert elapsed < 30, (elapsed, logged)


def _names(pids: list[int]) -> list[str]:
    names = []
    for pid in pids:
        try:
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
        except OSError:
            pass
    return names


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
