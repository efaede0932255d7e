"""Prefect's API for a command of the CLI: a temporary server of the command's own when PREFECT_API_URL is unset.

Without PREFECT_API_URL, Prefect 3.9.1 starts a temporary server itself (`SubprocessASGIServer`,
prefect/server/api/server.py) the first time a client needs one. That server is a child in the command's process
group: Ctrl-C in a terminal, or a SIGTERM to the group, stops it at once, before the flow run's crash is reported.
Its `stop` (an atexit hook) forgets the instance, so any later client -- the log and event workers draining at exit
(prefect/logging/handlers.py `APILogWorker`, prefect/events/worker.py) -- starts a second one ("Starting temporary
server" after "Crash detected!"), which nothing stops: it outlived the command, and the logs sent to the first
printed `--- Logging error ---` by the dozen.

So the command starts the server itself, in a session of its own (`tasks/runtime/stopping.py` tracks it), points
PREFECT_API_URL at it for the whole process (so no client ever starts another), and at the end sends what Prefect's
log and event workers still hold, turns logging to the API off, then stops the server.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx

from tasks.runtime import stopping
from tasks.runtime.ports import free_port

STARTUP_TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"  # Prefect's own setting for its server
PORT_IN_USE = 3  # uvicorn's exit code when it cannot bind (SubprocessASGIServer.start picks another port on it)


class PrefectServerFailed(RuntimeError):
    """The temporary Prefect server did not come up; the message ends with its output."""


@contextlib.contextmanager
def prefect_api(say: Callable[[str], None]) -> Iterator[str]:
    """Within: Prefect's API for this command, its URL yielded; `say` prints a line for the user.

    The server PREFECT_API_URL names (in the environment or Prefect's profile) if any, else a temporary one of the
    command's own, stopped on the way out. Either way the flows keep the command's SIGTERM handler
    (`stopping.keep_handlers_in_flows`), and the logs and events still queued are sent before the end.
    """
    from prefect.settings import get_current_settings

    given = get_current_settings().api.url
    if given and given not in _started:
        with _flows_in_this_process():
            yield given
        return
    with _temporary_server(say) as url:
        _point_prefect_at(url)
        with _flows_in_this_process():
            yield url


_started: set[str] = set()  # the API URLs of the temporary servers this process started (and stopped)


@contextlib.contextmanager
def _temporary_server(say: Callable[[str], None]) -> Iterator[str]:
    timeout_s = float(os.environ.get(STARTUP_TIMEOUT_ENV) or 90)
    with tempfile.TemporaryDirectory(prefix="eagle3-prefect-") as tmp:
        log = Path(tmp) / "server.log"
        for _ in range(3):  # a port free when picked may be taken before uvicorn binds it
            port = free_port()
            process = _start(port, log)
            try:
                if _healthy(process, f"http://127.0.0.1:{port}", timeout_s, log):
                    break
            except BaseException:
                _stop(process)
                raise
        else:
            raise PrefectServerFailed(f"no free port for the temporary Prefect server:\n{_tail(log)}")
        url = f"http://127.0.0.1:{port}/api"
        _started.add(url)
        say(
            f"Prefect: temporary server at {url} for this command (stopped with it; PREFECT_API_URL names a server "
            "of your own instead)"
        )
        try:
            yield url
        finally:
            _stop(process)


def _start(port: int, log: Path) -> subprocess.Popen:
    """`uvicorn` serving Prefect's API app as SubprocessASGIServer._run_uvicorn_command does (prefect 3.9.1,
    prefect/server/api/server.py: the same app factory, no UI, the ephemeral-server flags), in a session of its own."""
    env = {
        **os.environ,
        "PREFECT_UI_ENABLED": "0",
        "PREFECT__SERVER_EPHEMERAL": "1",
        "PREFECT__SERVER_FINAL": "1",
    }
    env.pop("PREFECT_API_URL", None)
    with open(log, "ab") as out:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "uvicorn",
                "--app-dir",
                _site_packages(),
                "--factory",
                "prefect.server.api.server:create_app",
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--log-level",
                "error",
                "--lifespan",
                "on",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # Ctrl-C in the terminal reaches the command, not its API server
        )
    stopping.track(process, f"Prefect's temporary server (pid {process.pid}, port {port})")
    return process


def _healthy(process: subprocess.Popen, url: str, timeout_s: float, log: Path) -> bool:
    """True once `url` answers /api/health; False when uvicorn could not bind the port; else raises."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=5) as client:
        while time.monotonic() < deadline:
            code = process.poll()
            if code is not None:
                stopping.untrack(process)
                if code == PORT_IN_USE:
                    return False
                raise PrefectServerFailed(f"the temporary Prefect server exited with code {code}:\n{_tail(log)}")
            try:
                if client.get(f"{url}/api/health").status_code == 200:
                    return True
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # polling: the server has no other readiness signal
    raise PrefectServerFailed(
        f"the temporary Prefect server did not answer within {timeout_s:g} s ({STARTUP_TIMEOUT_ENV}):\n{_tail(log)}"
    )


def _stop(process: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL after a grace (shorter once a stop signal came): the server and its group."""
    try:
        if process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            try:
                process.wait(timeout=stopping.grace_s(5.0))
            except subprocess.TimeoutExpired:
                stopping.kill_tree(process.pid)
                process.wait()
    finally:
        stopping.untrack(process)


def _point_prefect_at(url: str) -> None:
    """PREFECT_API_URL=url for this process and every thread in it, and left so after the server stops: a client
    made after that (a late log or event) then fails to connect, where without it Prefect would start a server."""
    os.environ["PREFECT_API_URL"] = url
    _refresh_prefect_settings()


def _site_packages() -> str:
    """Where the prefect package is (uvicorn's --app-dir, as Prefect gives it), without importing it again."""
    spec = importlib.util.find_spec("prefect")
    assert spec is not None and spec.submodule_search_locations, "prefect is installed"
    return str(Path(list(spec.submodule_search_locations)[0]).parent)


@contextlib.contextmanager
def _flows_in_this_process() -> Iterator[None]:
    """Flows keep the command's signal handlers; on the way out Prefect's queued logs and events go to the API, then
    logging to the API stops (a record sent after would find no server: `--- Logging error ---`)."""
    stopping.keep_handlers_in_flows()
    try:
        yield
    finally:
        if "prefect" in sys.modules:
            _drain_prefect_workers(stopping.grace_s(5.0))
            os.environ["PREFECT_LOGGING_TO_API_ENABLED"] = "false"
            _refresh_prefect_settings()


def _drain_prefect_workers(timeout_s: float) -> None:
    """Send the logs and events Prefect's workers still hold (their own drain, bounded by `timeout_s`)."""
    from prefect.events.worker import EventsWorker
    from prefect.logging.handlers import APILogWorker

    for worker in (APILogWorker, EventsWorker):
        with contextlib.suppress(Exception):  # the run's outcome is already decided; a log lost here is only a log
            worker.drain_all(timeout=timeout_s)


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings from the environment once, at import, into a global context that threads fall back
    to (prefect/context.py, GLOBAL_SETTINGS_CONTEXT): read them again if it is imported already."""
    if "prefect.context" in sys.modules:
        from prefect.context import refresh_global_settings_context

        refresh_global_settings_context()


def _tail(log: Path, lines: int = 30) -> str:
    try:
        with open(log, "rb") as f:
            return b"".join(deque(f, maxlen=lines)).decode("utf-8", "replace")
    except OSError:
        return "(no output)"
