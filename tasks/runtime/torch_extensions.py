"""The directory rank jobs JIT-build torch extensions into (DeepSpeed's CPU comm op), freed of dead builds' locks.

DeepSpeed's ranks build their CPU comm op on first use: deepspeed 0.19.8's comm/torch.py `build_shm_op` (called by
`TorchBackend.__init__`, so by every rank's `init_distributed`) loads op_builder/cpu/comm.py's `ShareMemCommBuilder`
through builder.py `jit_load`, which is torch 2.13.0's utils/cpp_extension.py `load`: `_jit_compile` builds into
`_get_build_directory` (`$TORCH_EXTENSIONS_DIR/<name>`, else `~/.cache/torch_extensions/py311_cpu/<name>`, shared
by every virtualenv on the machine) under utils/file_baton.py's `FileBaton`: a file `lock` created with O_EXCL,
holding no pid, kept open while held and removed at the end. Every load takes it, also of a built op (ninja then
finds nothing to do). A process killed while it holds it (a build, ~1-2 min on CPU, or a rank in that short
window) leaves the file, and every later load polls it every 0.1 s forever, printing nothing.

So the pipeline gives its ranks a directory of its own, per virtualenv and machine (unless TORCH_EXTENSIONS_DIR
is set), and before it starts them (`prepare`):
- a `lock` there that no live process holds open (and no process works in its build directory: the compiler of a
  killed build) is removed, with a line saying so; one whose holders cannot all be seen stops the launch with the
  command that removes it;
- the CPU comm op is built once, in a child process, announced with its expected time and a line every
  HEARTBEAT_S, under an flock of ours (BUILD_FLOCK) so that two launches at once build it once: the second waits,
  saying for whom, then finds it built. The ranks then only load it.
"""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

COMM_OP = "deepspeed_shm_comm"  # ShareMemCommBuilder.NAME: its build directory's and its library's name
BUILD_TIME = "about 1-2 minutes on first use"  # measured: 1 min 10 s to 2 min 06 s on 2 busy cores
HEARTBEAT_S = 10.0  # a line at least this often while a build runs or a launch waits for one
DEAD_AFTER_S = 0.5  # a lock seen with no holder this long (the same file) was left by a killed process
# A killed build's compiler, still writing objects in the build directory (torch runs ninja there): busy, not dead.
COMPILERS = frozenset(
    {"ninja", "c++", "g++", "gcc", "cc", "cc1plus", "cc1", "as", "ld", "collect2", "clang", "clang++"}
)
BUILD_FLOCK = ".eagle3-build.flock"  # held (flock) by the launch that builds; names it for those that wait
# What the child runs: the very function each rank calls, so the build's flags are the ranks' own.
BUILD_CODE = (
    "from deepspeed.comm.torch import build_shm_op\nprint('built' if build_shm_op() else 'not used', flush=True)"
)

Say = Callable[[str], None]


class BuildFailed(RuntimeError):
    """The CPU comm op's build failed; the message ends with the build's last output lines."""


class LockUnknown(RuntimeError):
    """A build lock whose holders this user cannot see (another user's): the message says how to remove it."""


def extensions_dir() -> Path:
    """TORCH_EXTENSIONS_DIR when set; else this virtualenv's own, per machine (the ops are built for its CPU)."""
    given = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(given) if given else Path(sys.prefix) / "torch_extensions" / socket.gethostname()


def prepare(*, cpu: bool, say: Say | None = None) -> dict[str, str]:
    """Make the extensions directory ready for a rank job; return the environment the ranks get for it.

    Dead builds' locks removed (`clear_dead_locks`); with `cpu` (DeepSpeed's CPU accelerator) the comm op built
    (`build_comm_op`). `say` gets the lines (default: the Prefect run's log, else stderr).
    """
    say = say or _say
    directory = extensions_dir()
    clear_dead_locks(directory, say)
    if cpu and sys.platform == "linux":  # elsewhere ShareMemCommBuilder.is_compatible is False: nothing to build
        build_comm_op(directory, say)
    return {"TORCH_EXTENSIONS_DIR": str(directory)}


def clear_dead_locks(directory: Path, say: Say) -> None:
    """Remove every `<directory>/<extension>/lock` whose builder is gone; wait (saying so) while one is alive.

    Alive: a process holds the file open (FileBaton keeps it open while held) or works in its directory (the
    compiler of a killed build, still writing objects). LockUnknown when the processes that may hold it cannot be read.
    """
    for lock in sorted(directory.glob("*/lock")):
        waited_since: float | None = None
        last_said = 0.0
        unheld: tuple[tuple[int, int], float] | None = None  # (the file, since when) while seen with no holder
        while True:
            try:
                before = lock.stat()
            except FileNotFoundError:
                break  # released
            if not sees_its_holders(before):
                raise LockUnknown(
                    f"{lock}: a torch extension build lock of uid {before.st_uid}, whose processes this user "
                    f"(uid {os.geteuid()}) cannot see. If no build is running on this machine, a killed build left it "
                    f"and every rank would wait on it forever: remove it (rm {lock}) and launch again"
                )
            holders = lock_holders(lock)
            now = time.monotonic()
            if not holders:
                # Twice, DEAD_AFTER_S apart, the same file: FileBaton.release closes it before it removes it, and
                # os.open creates it before the fd is the holder's; a lock seen in either moment is not dead.
                seen = (before.st_ino, before.st_ctime_ns)
                if unheld is None or unheld[0] != seen:
                    unheld = (seen, now)
                elif now - unheld[1] >= DEAD_AFTER_S:
                    if _same_file(lock, before) and _unlink(lock):  # not released and taken again meanwhile
                        say(
                            f"removed {lock}: a build lock left by a killed build (no process holds it); "
                            "the extension is loaded, or built again, as usual"
                        )
                    break
                time.sleep(0.1)
                continue
            unheld = None
            if waited_since is None:
                waited_since = now
            if now - last_said >= HEARTBEAT_S:
                last_said = now
                say(
                    f"waiting for {describe_pids(holders)} to finish building in {lock.parent} "
                    f"({now - waited_since:.0f} s so far; it holds {lock.name})"
                )
            time.sleep(0.2)


def sees_its_holders(lock: os.stat_result) -> bool:
    """Whether this process can read every process that could hold the lock: its owner's (FileBaton creates it)."""
    return os.geteuid() in (0, lock.st_uid)


def lock_holders(lock: Path) -> list[int]:
    """The pids that hold `lock` open, or compile in its directory.

    Read from /proc: this machine's processes that this user can read (every one of the lock owner's, when
    `sees_its_holders`); those of other pid namespaces, or that even root cannot read (a sandbox's init), are not seen.
    """
    try:
        target = lock.stat()
    except FileNotFoundError:
        return []
    build_dir = str(lock.parent.resolve())
    holders: list[int] = []
    me = os.getpid()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            fds = list((entry / "fd").iterdir())
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue  # exited meanwhile, or not ours to read
        if name in COMPILERS and (cwd == build_dir or cwd.startswith(build_dir + os.sep)):
            holders.append(int(entry.name))
            continue
        for fd in fds:
            try:
                held = fd.stat()
            except OSError:
                continue
            if (held.st_dev, held.st_ino) == (target.st_dev, target.st_ino):
                holders.append(int(entry.name))
                break
    return holders


def build_comm_op(directory: Path, say: Say) -> None:
    """Build DeepSpeed's CPU comm op into `directory` unless it is built; once, whoever else launches meanwhile."""
    if comm_op_built(directory):
        return
    with build_flock(directory, say):
        clear_dead_locks(directory, say)  # again: a launch waited for may have been killed mid-build
        if comm_op_built(directory):
            say(f"DeepSpeed's CPU comm op {COMM_OP} is built (by the launch waited for)")
            return
        say(f"building DeepSpeed's CPU comm op {COMM_OP} into {directory / COMM_OP}, {BUILD_TIME}")
        started = time.monotonic()
        command = [sys.executable, "-c", BUILD_CODE]
        env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(directory), "DS_ACCELERATOR": "cpu"}
        tail = _run_saying(command, env, say, lambda s: f"still building {COMM_OP} ({s:.0f} s so far, {BUILD_TIME})")
        if tail and tail[-1] == "not used":
            say(f"DeepSpeed does not use its CPU comm op {COMM_OP} here: nothing built")
            return
        say(f"built {COMM_OP} in {time.monotonic() - started:.0f} s")


def comm_op_built(directory: Path) -> bool:
    """Its library is there, newer than DeepSpeed's sources of it (an upgraded DeepSpeed rebuilds it)."""
    library = directory / COMM_OP / f"{COMM_OP}.so"
    try:
        built = library.stat().st_mtime
    except FileNotFoundError:
        return False
    spec = importlib.util.find_spec("deepspeed")  # found, not imported
    if spec is None or spec.origin is None:
        return True
    sources = Path(spec.origin).parent / "ops" / "csrc" / "cpu" / "comm"
    return all(built >= s.stat().st_mtime for s in sources.glob("shm*"))


@contextmanager
def build_flock(directory: Path, say: Say) -> Iterator[None]:
    """Hold `directory`/BUILD_FLOCK exclusively (waiting, saying for whom, every HEARTBEAT_S); a kill frees it."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / BUILD_FLOCK
    with open(path, "a+") as f:
        started = time.monotonic()
        last_said: float | None = None
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if last_said is None or now - last_said >= HEARTBEAT_S:
                    last_said = now
                    say(
                        f"waiting for {_flock_holder(path)}, which builds in {directory} "
                        f"({now - started:.0f} s so far; built once, then loaded by every launch)"
                    )
                time.sleep(0.2)
        try:
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "command": " ".join(sys.argv)}))
            f.flush()
            yield
        finally:
            f.seek(0)
            f.truncate()
            fcntl.flock(f, fcntl.LOCK_UN)


def describe_pids(pids: list[int]) -> str:
    """`pid 12 (python -c ...)`, a few of them."""
    return ", ".join(f"pid {pid} ({_command_of(pid)})" for pid in pids[:3]) + (" and more" if len(pids) > 3 else "")


def _flock_holder(path: Path) -> str:
    try:
        holder = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        holder = {}
    if "pid" not in holder:
        return "another launch"
    return f"another launch: pid {holder['pid']} on {holder.get('host', '?')}, `{holder.get('command', '')[:120]}`"


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()[:120]
    except OSError:
        return "?"


def _same_file(path: Path, seen: os.stat_result) -> bool:
    try:
        now = path.stat()
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (seen.st_dev, seen.st_ino)


def _unlink(path: Path) -> bool:
    """Removed by us (False: another launch removed it first)."""
    try:
        path.unlink()
        return True
    except FileNotFoundError:
        return False


def _run_saying(command: list[str], env: dict[str, str], say: Say, still: Callable[[float], str]) -> list[str]:
    """Run `command` (its own process group, killed with us), saying `still(seconds)` every HEARTBEAT_S; its tail."""
    tail: deque[str] = deque(maxlen=30)
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, text=True, start_new_session=True
    )

    def read() -> None:
        assert process.stdout is not None
        for line in process.stdout:
            tail.append(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    started = time.monotonic()
    try:
        while True:
            try:
                code = process.wait(timeout=HEARTBEAT_S)
                break
            except subprocess.TimeoutExpired:
                say(still(time.monotonic() - started))
    except BaseException:
        try:
            os.killpg(process.pid, signal.SIGKILL)  # the compiler too; the lock it leaves is cleared at the next launch
        except ProcessLookupError:
            pass
        process.wait()
        raise
    reader.join()
    if code != 0:
        raise BuildFailed(
            f"building DeepSpeed's CPU comm op {COMM_OP} failed (exit {code}): {' '.join(command[:2])} ...\n"
            "--- last output ---\n" + "\n".join(tail)
        )
    return list(tail)


def _say(line: str) -> None:
    """The Prefect run's log when there is one (a stage task), else stderr (also where Prefect is not installed: the
    GPU check's machine, tools/gpu_check.py, launches ranks through rank_command without it)."""
    try:
        from prefect.exceptions import MissingContextError
        from prefect.logging import get_run_logger
    except ImportError:
        print(line, file=sys.stderr, flush=True)
        return
    try:
        get_run_logger().info(line)
    except MissingContextError:
        print(line, file=sys.stderr, flush=True)
