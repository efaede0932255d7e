"""The generate bench's simulated SGLang server: `emulators.sim` in a process of its own (client and server share no
GIL), its stats window reset and read over HTTP; `Poller` samples its /_stats in a thread while a client runs."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import httpx

from bench import harness
from bench.generate_params import EOS, Params


class SimProcess:
    """``python -m emulators.sim --port 0 ...`` as a child process; admin calls over HTTP."""

    def __init__(self, p: Params):
        self.p = p
        cmd = [
            sys.executable,
            "-m",
            "emulators.sim",
            "--port",
            "0",
            "--max-running",
            str(p.max_running),
            "--decode-ms",
            str(p.decode_ms),
            "--mean-len",
            str(p.mean_len),
            "--sigma",
            str(p.sigma),
            "--seed",
            str(p.seed),
            "--eos-id",
            str(EOS),
        ]
        self.proc = subprocess.Popen(cmd, cwd=harness.REPO, stdout=subprocess.PIPE, text=True)
        self.url = self._wait_listening(timeout=60.0)
        self.admin = httpx.Client(base_url=self.url, timeout=30.0)

    def _wait_listening(self, timeout: float) -> str:
        found: list[str] = []

        def read() -> None:
            assert self.proc.stdout is not None
            for line in self.proc.stdout:
                if "listening on" in line:
                    found.append(line.split("listening on", 1)[1].strip())
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout)
        if not found:
            self.close()
            raise RuntimeError(f"sim server did not print 'listening on' within {timeout:.0f}s")
        return found[0]

    def reset_stats(self) -> None:
        self.admin.post("/_fault", json={"reset_stats": True}).raise_for_status()

    def stats(self) -> dict[str, Any]:
        r = self.admin.get("/_stats")
        r.raise_for_status()
        return r.json()

    def cpu_s(self) -> float:
        """User + system CPU seconds of the server process so far (from /proc)."""
        return harness.process_cpu_s(self.proc.pid)

    def close(self) -> None:
        if getattr(self, "admin", None) is not None:
            self.admin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)


class Poller:
    """Samples the server's /_stats every `interval` s in a thread: where the run's time went."""

    def __init__(self, url: str, interval: float = 0.25):
        self.url, self.interval = url, interval
        self.samples: list[dict[str, Any]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Poller:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)

    def _run(self) -> None:
        with httpx.Client(base_url=self.url, timeout=10.0) as c:
            while not self._stop.is_set():
                try:
                    self.samples.append(c.get("/_stats").json())
                except httpx.HTTPError:
                    pass
                self._stop.wait(self.interval)
