"""`make up` / `make down` (deploy/local-up.sh): `stop` stops everything `up` started, or says what it could not.

The first test runs the script as a user does: a Prefect server, the work pools, the deployments and two workers on a
free port with its state in a temporary directory; then `stop`, after which no process of theirs may be left (their
pids and every descendant's read from /proc before the stop). The others give `stop` pid files of stand-ins: a
process that ignores SIGTERM with a child in a session of its own, and one `stop` is not allowed to signal.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tasks.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "deploy" / "local-up.sh"
NAMES = ("server", "worker-cpu", "worker-gpu")


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def family(pid: int) -> list[int]:
    """`pid` and every live descendant, from /proc."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    found, todo = [pid], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return [p for p in found if alive(p)]


def still_alive(pids: list[int], within_s: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)  # bounded: a SIGKILLed process takes a moment to go
    return [p for p in pids if alive(p)]


def script_env(state: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(EAGLE3_STATE=str(state), EAGLE3_HOME=str(REPO), EAGLE3_BIN=str(Path(sys.executable).parent), **more)
    return env


def run_script(*args: str, env: dict[str, str], timeout: float, user: list[str] | None = None):
    return subprocess.run(
        [*(user or []), str(SCRIPT), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


def kill_groups(pids: list[int]) -> None:
    """A failed test's leftovers, so that they do not outlive it."""
    for pid in pids:
        for kill in (os.killpg, os.kill):
            try:
                kill(pid, signal.SIGKILL)
            except OSError:
                pass


@pytest.mark.e2e
@pytest.mark.multiprocess
def test_down_stops_the_server_and_both_workers(tmp_path):
    state = tmp_path / "state"
    env = script_env(state, PREFECT_PORT=str(free_port()))
    started: list[int] = []
    try:
        up = run_script(env=env, timeout=600)
        started = [int((state / f"{name}.pid").read_text()) for name in NAMES if (state / f"{name}.pid").exists()]
        assert up.returncode == 0, up.stdout[-3000:] + up.stderr[-3000:]
        assert len(started) == 3, up.stdout
        for pid in started[1:]:  # the workers: SIGINT not ignored, or their SIGTERM -> SIGINT never lands
            ignored = int(Path(f"/proc/{pid}/status").read_text().split("SigIgn:")[1].split()[0], 16)
            assert not ignored & (1 << (signal.SIGINT - 1)), f"worker {pid} ignores SIGINT"
        everything = [p for pid in started for p in family(pid)]

        t0 = time.monotonic()
        down = run_script("stop", env=env, timeout=120)
        took = time.monotonic() - t0
        print(f"local-up.sh stop: {took:.1f} s")
        assert down.returncode == 0, down.stdout + down.stderr
        for name in NAMES:
            assert f"stopped {name}" in down.stdout, down.stdout
            assert not (state / f"{name}.pid").exists()
        assert "SIGKILL" not in down.stdout, down.stdout  # they stopped when asked, not when killed
        assert not still_alive(everything), f"left running: {still_alive(everything)}"
    finally:
        kill_groups(started)


@pytest.fixture
def state() -> Iterator[Path]:
    """A state directory anyone may write (the unprivileged `stop` below needs to)."""
    path = Path(tempfile.mkdtemp(prefix="eagle3-local-up-"))
    path.chmod(0o777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def stand_in(state: Path, name: str, script: str) -> list[int]:
    """A process in a session of its own running `script` (bash), its pid in state/NAME.pid; its pid and its child's."""
    process = subprocess.Popen(
        ["bash", "-c", script], start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True
    )
    assert process.stdout is not None
    child = int(process.stdout.readline())  # printed once the script has set itself up
    (state / f"{name}.pid").write_text(f"{process.pid}\n")
    return [process.pid, child]


@pytest.mark.multiprocess
def test_down_kills_a_worker_that_ignores_sigterm_and_its_child_in_another_session(state):
    pids = stand_in(state, "worker-cpu", "trap '' TERM; setsid sleep 300 & echo $!; wait")
    try:
        down = run_script("stop", env=script_env(state, EAGLE3_STOP_TIMEOUT="1"), timeout=60)
        assert down.returncode == 0, down.stdout + down.stderr
        assert "worker-cpu (pid" in down.stdout and "SIGKILL" in down.stdout, down.stdout
        assert "stopped worker-cpu" in down.stdout
        assert not (state / "worker-cpu.pid").exists()
        assert not still_alive(pids)
    finally:
        kill_groups(pids)


@pytest.mark.multiprocess
def test_down_says_what_it_could_not_stop_and_keeps_its_pid_file(state):
    if os.geteuid() != 0 or not shutil.which("setpriv"):
        pytest.skip("needs root and setpriv: `stop` runs as another user, who may not signal root's process")
    nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    if subprocess.run([*nobody, "test", "-x", str(SCRIPT)]).returncode != 0:  # e.g. a clone under a 0700 directory
        pytest.skip(f"user nobody cannot run {SCRIPT} (a directory above it is closed to other users)")
    pids = stand_in(state, "worker-gpu", "sleep 300 & echo $!; wait")
    try:
        down = run_script("stop", env=script_env(state, EAGLE3_STOP_TIMEOUT="1"), timeout=60, user=nobody)
        assert down.returncode == 1, down.stdout + down.stderr
        assert f"could not stop worker-gpu: pid(s) {pids[0]}" in down.stderr, down.stderr
        assert (state / "worker-gpu.pid").read_text().strip() == str(pids[0])  # kept: `stop` again can finish it
        assert all(alive(p) for p in pids)
    finally:
        kill_groups(pids)
