"""Launching and stopping long-running child processes (the dev server, later SGLang and DeepSpeed)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import deque
from pathlib import Path

import httpx


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """An HTTP server child process: started in its own process group, stopped with SIGTERM then SIGKILL.

    Use as a context manager so the server is stopped on success, failure and Ctrl-C alike.
    """

    def __init__(self, command: list[str], url: str, *, log_path: Path | None = None, env: dict[str, str] | None = None):
        self.command = command
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.env = env
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
        else:
            log = subprocess.DEVNULL
        try:
            self.process = subprocess.Popen(
                self.command,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,  # its own process group: stop() reaches its children too
            )
        finally:
            if log is not subprocess.DEVNULL:
                log.close()

    def wait_healthy(self, timeout_s: float = 120.0, path: str = "/health_generate") -> None:
        """Block until GET `path` answers 200; RuntimeError with the log tail if it dies or times out."""
        assert self.process is not None, "start() first"
        deadline = time.monotonic() + timeout_s
        delay = 0.05
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.process.returncode} before becoming healthy:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.url + path, timeout=30.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(delay)  # polling a child process that has no other readiness signal
            delay = min(delay * 2, 1.0)
        raise RuntimeError(f"server at {self.url} not healthy after {timeout_s:.0f}s:\n{self.log_tail()}")

    def stop(self, grace_s: float = 10.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()
        except ProcessLookupError:
            pass

    def log_tail(self, lines: int = 30) -> str:
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            tail = deque(f, maxlen=lines)
        return b"".join(tail).decode("utf-8", "replace")


def dev_server(model_dir: Path, *, port: int | None = None, log_path: Path | None = None, host: str = "127.0.0.1") -> ServerProcess:
    """The SGLang-compatible dev server over `model_dir`, as a child process (not yet started)."""
    port = port or free_port(host)
    command = [sys.executable, "-m", "deploy.dev_server", "--model", str(model_dir), "--host", host, "--port", str(port)]
    return ServerProcess(command, f"http://{host}:{port}", log_path=log_path)
