"""The rehearsal's processes: what each costs (`ProcWatch`), a command run and killed at a point (`run_cli`), `eagle3
stats` on a timer while a stage runs (`StatsLoop`), and the servers it talks to (the simulated engine, Prefect).

Every process the rehearsal starts carries REHEARSAL_ROLE in its environment and hands it down to its children (the
CLI's torchrun launcher and ranks included, even after a kill -9 orphans them), so one scan of /proc finds them all
and says which stage each belongs to. A process's peak RSS is the kernel's own (VmHWM, exact even when sampled late),
its CPU the last utime + stime seen (sampled every 0.5 s: a process that lives less than that may be missed).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench import harness

ROLE_ENV = "REHEARSAL_ROLE"
HZ = os.sysconf("SC_CLK_TCK")
EAGLE3 = str(Path(sys.executable).with_name("eagle3"))


@dataclass
class Proc:
    role: str  # the stage (or sim, prefect, stats) it was started for
    kind: str  # cli, torchrun, rank, prefect, sim, stats, other: from its command line
    cpu_s: float = 0.0
    peak_rss_mb: float = 0.0
    first_seen: float = 0.0
    last_seen: float = 0.0


def _kind(cmdline: list[str]) -> str:
    text = " ".join(cmdline)
    if "emulators.sim" in text:
        return "sim"
    if "torchrun" in text or "torch.distributed.run" in text:
        return "torchrun"
    if " -m models." in f" {text}" or "models/" in text and "job" in text:
        return "rank"
    if "prefect" in text and "server" in text:
        return "prefect"
    if cmdline[1:2] == ["stats"] or " stats " in f" {text} ":
        return "stats"
    if "eagle3" in text:
        return "cli"
    return "other"


class ProcWatch:
    """Every process with REHEARSAL_ROLE in its environment, scanned every `every_s`: CPU and peak RSS per pid."""

    def __init__(self, every_s: float = 0.5):
        self.every_s = every_s
        self.procs: dict[tuple[int, str], Proc] = {}  # (pid, start time) -> Proc
        self._skip: dict[tuple[int, str], bytes] = {}  # not ours: the command line it had then
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="procwatch")

    def __enter__(self) -> ProcWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.scan()
            self._stop.wait(self.every_s)

    def scan(self) -> None:
        now = time.monotonic()
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            try:
                stat = Path(f"/proc/{entry.name}/stat").read_text()
                fields = stat.rsplit(")", 1)[1].split()
                key = (int(entry.name), fields[19])  # starttime: a reused pid is another process
                proc = self.procs.get(key)
                if proc is None:
                    # A child seen between fork and exec still has its parent's environment: look again once it
                    # runs another program (its command line changes).
                    cmd_bytes = Path(f"/proc/{entry.name}/cmdline").read_bytes()
                    if self._skip.get(key) == cmd_bytes:
                        continue
                    env = Path(f"/proc/{entry.name}/environ").read_bytes().split(b"\0")
                    mark = ROLE_ENV.encode() + b"="
                    role = next((v[len(mark) :].decode() for v in env if v.startswith(mark)), None)
                    if role is None:
                        self._skip[key] = cmd_bytes
                        continue
                    cmd = cmd_bytes.decode(errors="replace").split("\0")
                    proc = self.procs[key] = Proc(role, _kind(cmd), first_seen=now)
                proc.cpu_s = (int(fields[11]) + int(fields[12])) / HZ
                proc.last_seen = now
                for line in Path(f"/proc/{entry.name}/status").read_text().splitlines():
                    if line.startswith("VmHWM:"):
                        proc.peak_rss_mb = max(proc.peak_rss_mb, int(line.split()[1]) / 1024)
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile

    def summary(self, role: str) -> dict[str, Any]:
        """CPU seconds of `role`'s processes, and the peak RSS of each kind (the largest of its processes)."""
        mine = [p for p in self.procs.values() if p.role == role]
        peaks: dict[str, float] = {}
        for p in mine:
            peaks[p.kind] = max(peaks.get(p.kind, 0.0), p.peak_rss_mb)
        return {
            "cpu_s": round(sum(p.cpu_s for p in mine), 2),
            "processes": len(mine),
            "peak_rss_mb": {k: round(v, 1) for k, v in sorted(peaks.items())},
        }


def child_env(role: str, **extra: str) -> dict[str, str]:
    return {**os.environ, ROLE_ENV: role, "PYTHONUNBUFFERED": "1", **extra}


@dataclass
class Invocation:
    """One run of a command: how long, how it ended, and where it was killed."""

    argv: list[str]
    wall_s: float = 0.0
    rc: int | None = None
    killed_at: dict[str, Any] | None = None
    log: str = ""


def run_cli(
    argv: list[str],
    role: str,
    log: Path,
    env: dict[str, str],
    kill_when: Callable[[], dict[str, Any] | None] | None = None,
    poll_s: float = 0.2,
) -> Invocation:
    """`argv` in a session of its own, its output in `log`; killed with SIGKILL (the whole process group) as soon as
    `kill_when()` returns what it saw (a dict), else run to its end."""
    run = Invocation(argv, log=str(log))
    started = time.monotonic()
    with log.open("ab") as out:
        process = subprocess.Popen(
            argv,
            cwd=harness.REPO,
            env=child_env(role, **env),
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        while process.poll() is None:
            if kill_when is not None and (seen := kill_when()) is not None:
                os.killpg(process.pid, signal.SIGKILL)
                run.killed_at = {**seen, "after_s": round(time.monotonic() - started, 2)}
                process.wait()
                break
            time.sleep(poll_s)  # polling the kill condition: a file count or a server's counter
    run.rc = process.returncode
    run.wall_s = round(time.monotonic() - started, 2)
    if run.rc != 0 and run.killed_at is None:
        tail = log.read_text(errors="replace").splitlines()[-15:]
        raise RuntimeError(f"{' '.join(argv)} failed (rc {run.rc}); the end of {log}:\n" + "\n".join(tail))
    return run


class StatsLoop:
    """`eagle3 stats RUN_DIR --json` every `every_s` s in a thread: each call's latency, CPU, peak RSS and rc."""

    def __init__(self, run_dir: Path, every_s: float, env: dict[str, str]):
        self.run_dir, self.every_s, self.env = run_dir, every_s, env
        self.calls: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="stats")

    def __enter__(self) -> StatsLoop:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(120)

    def _run(self) -> None:
        while not self._stop.wait(self.every_s):
            self.calls.append(self.call())

    def call(self) -> dict[str, Any]:
        """One call, under `REAPER`: its own CPU and peak RSS, exactly."""
        started = time.monotonic()
        done = subprocess.run(
            [sys.executable, "-c", REAPER, EAGLE3, "stats", str(self.run_dir), "--json"],
            cwd=harness.REPO,
            env=child_env("stats-call", **self.env),
            capture_output=True,
        )
        wall = time.monotonic() - started
        *_, last = done.stderr.decode(errors="replace").rstrip().splitlines() or [""]
        rc, cpu_s, peak_kb = json.loads(last.removeprefix("RUSAGE ")) if last.startswith("RUSAGE ") else (-1, 0, 0)
        rows = parts = None
        try:
            table = json.loads(done.stdout)["responses"]
            rows = sum(int(d["responses"]) for d in table)
            parts = sum(int(d["parts"]) for d in table)
        except (ValueError, TypeError, KeyError):
            pass
        return {
            "at_s": round(started, 2),
            "wall_s": round(wall, 3),
            "cpu_s": round(cpu_s, 3),
            "peak_rss_mb": round(peak_kb / 1024, 1),
            "rc": rc,
            "rows": rows,
            "parts": parts,
            "error": done.stderr.decode(errors="replace")[-600:] if rc else "",
        }


# The rusage of a command, from a small process that forks it and reaps it with wait4. Reaped by the bench itself, a
# child's peak RSS would include the bench's own pages, which a fork maps before the exec (Linux keeps the larger of
# the two across exec); forked from this small process, the peak is the command's own.
REAPER = """
import json, os, sys
pid = os.fork()
if pid == 0:
    os.execv(sys.argv[1], sys.argv[1:])
_, status, usage = os.wait4(pid, 0)
code = os.waitstatus_to_exitcode(status)
print("RUSAGE " + json.dumps([code, usage.ru_utime + usage.ru_stime, usage.ru_maxrss]), file=sys.stderr)
sys.exit(code if code >= 0 else 1)
"""


@dataclass
class Server:
    process: subprocess.Popen
    url: str
    log: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)


def _wait_healthy(server: Server, path: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            raise RuntimeError(
                f"{server.log} ended (rc {server.process.returncode}):\n{server.log.read_text()[-2000:]}"
            )
        try:
            if httpx.get(server.url + path, timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.25)  # polling a server that has no other readiness signal
    raise RuntimeError(f"no answer on {server.url}{path} within {timeout_s:.0f} s: {server.log}")


def start_sim(scratch: Path, rules: Path, model: Path, vocab: int, eos: int, seed: int) -> Server:
    """The simulated SGLang engine: no decode time (the client, not the server, is what is measured), 256 slots."""
    from tasks.runtime.ports import free_port

    port = free_port()
    log = scratch / "sim.log"
    argv = [
        sys.executable,
        "-m",
        "emulators.sim",
        "--port",
        str(port),
        "--max-running",
        "256",
        "--decode-ms",
        "0",
        "--vocab-size",
        str(vocab),
        "--eos-id",
        str(eos),
        "--context-length",
        "65536",
        "--seed",
        str(seed),
        "--length-rules",
        str(rules),
        "--model-path",
        str(model),
    ]
    with log.open("wb") as out:
        process = subprocess.Popen(argv, cwd=harness.REPO, env=child_env("sim"), stdout=out, stderr=subprocess.STDOUT)
    server = Server(process, f"http://127.0.0.1:{port}", log)
    _wait_healthy(server, "/health", 60)
    return server


def sim_stats(url: str) -> dict[str, Any]:
    return httpx.get(url + "/_stats", timeout=10).json()


def start_prefect(scratch: Path) -> Server:
    """`prefect server start` with a home of its own (its database: home/prefect.db), the UI on."""
    from tasks.runtime.ports import free_port

    port = free_port()
    home = scratch / "prefect-home"
    home.mkdir(parents=True, exist_ok=True)
    log = scratch / "prefect.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        **{ROLE_ENV: "prefect"},
    )
    prefect = str(Path(sys.executable).with_name("prefect"))
    with log.open("wb") as out:
        process = subprocess.Popen(
            [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            cwd=scratch,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    server = Server(process, f"http://127.0.0.1:{port}", log, {"home": str(home)})
    _wait_healthy(server, "/api/health", 180)
    return server
