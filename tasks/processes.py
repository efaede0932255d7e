"""Launching and stopping long-running child processes (the dev server, later SGLang and DeepSpeed)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
from prefect.utilities.asyncutils import run_coro_as_sync

from tasks.ports import free_port
from tasks.sglang_client import RetryPolicy, ServerOutage, SGLangClient


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

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Block until /health_generate answers 200 (SGLangClient.wait_healthy); RuntimeError with the log tail
        if the process dies or the time runs out."""
        assert self.process is not None, "start() first"

        def alive() -> None:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {self.process.returncode} before becoming healthy:\n{self.log_tail()}"
                )

        async def wait() -> None:
            async with SGLangClient(self.url, retry=RetryPolicy(initial_s=0.05, max_s=1.0, jitter=0.0)) as client:
                await client.wait_healthy(timeout_s, alive=alive)

        try:
            run_coro_as_sync(wait())
        except ServerOutage as e:
            raise RuntimeError(f"{e}\n{self.log_tail()}") from None

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


def launched_server(launch: str, url: str, *, target: Path | None = None, command: list[str] | None = None,
                    log_path: Path | None = None, health_timeout_s: float = 600.0) -> contextlib.AbstractContextManager:
    """A context that runs the server for the generate stage (launch `dev` or `command`), or nothing (`none`).

    The server listens where `url` says. It is stopped when the context exits, whether generation
    finished, failed or was cancelled (SIGTERM, as Prefect sends to a cancelled flow run, is turned
    into an exception so the stop runs).
    """
    if launch == "none":
        return contextlib.nullcontext()
    if _answers(url):
        raise RuntimeError(f"something already answers at {url}: stop it (an old server would be used instead "
                           f"of the one this run starts) or set server.launch: none to use it")
    if launch == "dev":
        if target is None:
            raise ValueError("launch: dev needs the target directory")
        parsed = urlparse(url)
        server = dev_server(target, port=parsed.port or 80, host=parsed.hostname or "127.0.0.1", log_path=log_path)
    elif launch == "command":
        if not command:
            raise ValueError("launch: command needs a command")
        server = ServerProcess(list(command), url, log_path=log_path)
    else:
        raise ValueError(f"unknown server launch {launch!r}: none, dev or command")
    return _serving(server, health_timeout_s)


def _answers(url: str) -> bool:
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=2.0)
        return True
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def _serving(server: ServerProcess, health_timeout_s: float) -> Iterator[ServerProcess]:
    previous = None
    if threading.current_thread() is threading.main_thread():
        def on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
            raise SystemExit(f"terminated (signal {signum}) while the server was running")
        previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        with server:
            server.wait_healthy(timeout_s=health_timeout_s)
            yield server
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
