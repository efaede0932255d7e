"""Launching and stopping the serving engines' processes (the dev server, SGLang, vLLM, an SGLang router)."""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import IO
from urllib.parse import urlparse

import httpx
from prefect.utilities.asyncutils import run_coro_as_sync

from settings.server import replica_url
from tasks.runtime import stopping
from tasks.runtime.ports import free_port
from tasks.serving import client_class
from tasks.serving.client import RetryPolicy
from tasks.serving.errors import ServerOutage

# A lone server's log in the log_dir it is given (RUN_DIR/logs: settings/layout.py). Every log is appended to,
# each launch after a header line naming its time and command: a second launch (another engine) keeps the first's.
SERVER_LOG = "server.log"


class ServerProcess:
    """An HTTP server child process: started in its own process group, stopped with SIGTERM then SIGKILL.

    Use as a context manager so the server is stopped on success, failure and Ctrl-C alike.
    """

    def __init__(
        self,
        command: list[str],
        url: str,
        *,
        log_path: Path | None = None,
        env: dict[str, str] | None = None,
        engine: str = "sglang",
        die_with_parent: bool = False,
    ):
        self.command = command
        # Linux: the server gets SIGTERM when the thread that started it dies, a kill -9 of this process included
        # (prctl PR_SET_PDEATHSIG), so no orphan holds the port and the GPUs; only for a server held by the thread
        # that starts it, until it stops it (the capture's: tasks/serving/capture_server.py)
        self.die_with_parent = die_with_parent
        self.url = url.rstrip("/")
        self.log_path = log_path
        self.env = env
        self.engine = (
            engine  # whose health path is polled (tasks/serving/): sglang (also the dev server, a router) or vllm
        )
        self.process: subprocess.Popen[bytes] | None = None
        self.log_start = 0  # where this launch's part of the appended log begins (its header)

    def __enter__(self) -> ServerProcess:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        log: IO[bytes] | None = None
        if self.log_path is not None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            log = open(self.log_path, "ab")
            self.log_start = log.tell()
            log.write(launch_header(self.command, self.engine).encode())
            log.flush()
        try:
            self.process = subprocess.Popen(
                self.command,
                stdout=subprocess.DEVNULL if log is None else log,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(self.env or {})},
                start_new_session=True,  # its own process group: stop() reaches its children too
                preexec_fn=terminate_with_parent if self.die_with_parent and sys.platform == "linux" else None,
            )
            stopping.track(self.process, f"the {self.engine} server at {self.url} (pid {self.process.pid})")
        finally:
            if log is not None:
                log.close()

    def wait_healthy(self, timeout_s: float = 120.0) -> None:
        """Block until the engine's health path answers 200 (EngineClient.wait_healthy); RuntimeError with the log tail
        if the process dies or the time runs out."""
        assert self.process is not None, "start() first"
        process = self.process

        def alive() -> None:
            if process.poll() is not None:
                raise RuntimeError(
                    f"server exited with code {process.returncode} before becoming healthy:\n{self.log_tail()}"
                )

        async def wait() -> None:
            async with client_class(self.engine)(
                self.url, retry=RetryPolicy(initial_s=0.05, max_s=1.0, jitter=0.0)
            ) as client:
                await client.wait_healthy(timeout_s, alive=alive)

        try:
            run_coro_as_sync(wait())
        except ServerOutage as e:
            raise RuntimeError(f"{e}\n{self.log_tail()}") from None

    def stop(self, grace_s: float = 10.0) -> None:
        """SIGTERM to the server's process group; after `grace_s` (less once SIGTERM or SIGINT came to this process:
        tasks/runtime/stopping.py) SIGKILL. Whatever is left then, of its group or of its descendants (one that left
        the group too), is killed: nothing the server started outlives its stop."""
        if self.process is None:
            return
        process = self.process
        family = stopping.descendants(process.pid)  # read now: once their parent is gone they are init's children
        try:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=stopping.grace_s(grace_s))
            except subprocess.TimeoutExpired:
                stopping.kill_tree(process.pid)
                process.wait()
        finally:
            stopping.kill_group_and(process.pid, family)
            stopping.untrack(process)

    def log_tail(self, lines: int = 30) -> str:
        """The last `lines` lines this launch wrote (not an earlier launch's, in the same appended log)."""
        if self.log_path is None or not self.log_path.exists():
            return "(no log)"
        with open(self.log_path, "rb") as f:
            f.seek(self.log_start)
            tail = deque(f, maxlen=lines)
        return b"".join(tail).decode("utf-8", "replace")


def launch_header(command: list[str], engine: str) -> str:
    """The line that opens a launch's part of an appended server log: when, which engine's API, what command (a
    key's or a password's value in it hidden)."""
    when = time.strftime("%Y-%m-%d %H:%M:%S %Z")
    shown: list[str] = []
    for word in command:
        flag, eq, _ = word.partition("=")
        if shown and _secret_flag(shown[-1]) and not eq:
            shown.append("***")
        else:
            shown.append(f"{flag}=***" if eq and _secret_flag(flag) else word)
    one_line = shlex.join(shown).replace("\n", "\\n")  # a script given with -c stays on the header's line
    return f"===== {when}: launching ({engine} API, from pid {os.getpid()}): {one_line}\n"


def _secret_flag(word: str) -> bool:
    word = word.lower()
    return word.startswith("--") and (any(s in word for s in ("key", "secret", "password")) or word.endswith("-token"))


def dev_server(
    model_dir: Path,
    *,
    port: int | None = None,
    log_path: Path | None = None,
    host: str = "127.0.0.1",
    extra_args: list[str] | None = None,
    trust_remote_code: bool = False,
) -> ServerProcess:
    """The SGLang-compatible dev server over `model_dir`, as a child process (not yet started); `extra_args` are its
    further flags (e.g. SGLang's --speculative-* ones); `trust_remote_code` adds SGLang's --trust-remote-code (a
    target whose tokenizer is remote code, as Kimi-K2.5's)."""
    port = port or free_port(host)
    command = [
        sys.executable,
        "-m",
        "emulators.dev_server",
        "--model",
        str(model_dir),
        "--host",
        host,
        "--port",
        str(port),
        *(["--trust-remote-code"] if trust_remote_code else []),
        *(extra_args or []),
    ]
    return ServerProcess(command, f"http://{host}:{port}", log_path=log_path)


def launched_servers(
    launch: str,
    url: str,
    *,
    replicas: int = 1,
    router: bool = False,
    router_args: list[str] | None = None,
    gpus_per_replica: int | None = None,
    target: Path | None = None,
    command: list[str] | None = None,
    log_dir: Path | None = None,
    health_timeout_s: float = 600.0,
    extra_args: list[str] | None = None,
    engine: str = "sglang",
    trust_remote_code: bool = False,
) -> contextlib.AbstractContextManager:
    """A context that runs the servers of the generate stage (launch `dev` or `command`), or nothing (`none`).

    `replicas` servers are started at once, replica N on url's port + N, or + 1 + N with a `router`,
    which then listens at `url` in front of them. Each is waited for until its engine's health path answers
    (a replica that dies at start is reported with its log). All are stopped when the context exits,
    whether generation finished, failed or was cancelled (SIGTERM, as Prefect sends to a cancelled
    flow run, is turned into an exception so the stop runs). Logs: log_dir/server.log for a lone
    server, server-N.log for replica N, router.log. `trust_remote_code`: the dev server loads the target's remote
    code (a `command` carries its engine's flag itself).
    """
    if launch == "none":
        return contextlib.nullcontext()
    if launch not in ("dev", "command"):
        raise ValueError(f"unknown server launch {launch!r}: none, dev or command")
    if launch == "dev" and target is None:
        raise ValueError("launch: dev needs the target directory")
    if launch == "command" and not command:
        raise ValueError("launch: command needs a command")
    servers: list[ServerProcess] = []
    for i in range(replicas):
        address = replica_url(url, i, router=router) if (replicas > 1 or router) else url.rstrip("/")
        parts = urlparse(address)
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80)
        log_path = (
            None if log_dir is None else log_dir / (SERVER_LOG if replicas == 1 and not router else f"server-{i}.log")
        )
        gpus = (
            None
            if gpus_per_replica is None
            else ",".join(str(g) for g in range(i * gpus_per_replica, (i + 1) * gpus_per_replica))
        )
        if launch == "dev" and target is not None:  # checked above: dev has a target, command a command
            servers.append(
                dev_server(
                    target,
                    port=port,
                    host=host,
                    log_path=log_path,
                    extra_args=extra_args,
                    trust_remote_code=trust_remote_code,
                )
            )
        elif command:
            fill = {"host": host, "port": str(port), "replica": str(i), "gpus": gpus or ""}
            words = [fill_placeholders(word, fill) for word in command] + list(extra_args or [])
            env = {"CUDA_VISIBLE_DEVICES": gpus} if gpus is not None else None
            servers.append(ServerProcess(words, address, log_path=log_path, env=env, engine=engine))
    if router:
        servers.append(
            router_process(
                url,
                [s.url for s in servers],
                router_args or [],
                log_path=None if log_dir is None else log_dir / "router.log",
            )
        )
    busy = [s.url for s in servers if answers(s.url)]
    if busy:
        raise RuntimeError(
            f"something already answers at {', '.join(busy)}: stop it (an old server would be used "
            f"instead of the one this run starts) or set server.launch: none to use it"
        )
    return serving(servers, health_timeout_s)


def fill_placeholders(word: str, values: dict[str, str]) -> str:
    """`word` with {host}, {port}, {replica}, {gpus} filled in (other braces, e.g. JSON, left as they are)."""
    for name, value in values.items():
        word = word.replace("{" + name + "}", value)
    return word


def router_process(url: str, workers: list[str], extra: list[str], *, log_path: Path | None) -> ServerProcess:
    """An SGLang router (the `sglang-router` package) at `url` in front of `workers`."""
    import importlib.util

    if importlib.util.find_spec("sglang_router") is None:
        raise RuntimeError(
            "server.router: true needs the SGLang router: pip install sglang-router "
            "(or start one yourself and set server.launch: none, server.url: its address)"
        )
    parts = urlparse(url)
    command = [
        sys.executable,
        "-m",
        "sglang_router.launch_router",
        "--worker-urls",
        *workers,
        "--host",
        parts.hostname or "127.0.0.1",
        "--port",
        str(parts.port or 80),
        *extra,
    ]
    if not any(word.startswith("--prometheus-port") for word in extra):
        # its metrics port defaults to 29000, often taken (torch.distributed uses 29500 nearby): a router that
        # cannot bind it dies at start, so it gets a free one unless router_args name one
        command += ["--prometheus-port", str(free_port())]
    if not any(word.startswith("--policy") for word in extra):
        # its default, cache_aware, sends prompts that share a prefix (one chat template, one system prompt) to
        # one worker until the loads differ by 64 requests and 1.5x: below that concurrency the others stay idle
        command += ["--policy", "round_robin"]
    return ServerProcess(command, url, log_path=log_path)


def terminate_with_parent() -> None:
    """In the child, before exec: SIGTERM when the parent thread dies (Linux prctl PR_SET_PDEATHSIG)."""
    import ctypes

    pr_set_pdeathsig = 1  # linux/prctl.h
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, int(signal.SIGTERM), 0, 0, 0)


def answers(url: str) -> bool:
    """Something answers HTTP at url's /health (any status): a server left running from before."""
    try:
        httpx.get(url.rstrip("/") + "/health", timeout=2.0)
        return True
    except httpx.HTTPError:
        return False


@contextlib.contextmanager
def serving(servers: list[ServerProcess], health_timeout_s: float) -> Iterator[list[ServerProcess]]:
    """Start `servers`, wait until each is healthy, yield them;
    stop them all on exit (SIGTERM raises here, so they are)."""
    previous = None
    # The CLI's own handler (tasks/runtime/stopping.py) already turns SIGTERM into an exception that stops them, and
    # one that also cancels the generate loop: keep it.
    if threading.current_thread() is threading.main_thread() and not stopping.installed():

        def on_sigterm(signum, frame):  # noqa: ARG001 - signal handler signature
            raise SystemExit(f"terminated (signal {signum}) while the server was running")

        previous = signal.signal(signal.SIGTERM, on_sigterm)
    with contextlib.ExitStack() as stack:
        try:
            for server in servers:  # all start loading at once
                stack.enter_context(server)
            for server in servers:
                server.wait_healthy(timeout_s=health_timeout_s)
            yield servers
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
