"""The real SGLang 0.5.23 for the tests marked `sglang`: .venv-sglang (`make sglang`; CI makes it).

What is real: the unmodified sglang package (HTTP server, tokenizer manager, scheduler, radix cache, model code),
on CPU. What is a stand-in: its kernel library and torchvision's ops (deploy/sglang-cpu/, each file says why).
Without .venv-sglang the tests that use `sglang_python` skip, saying so.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from tasks.runtime.ports import free_port
from tasks.serving.launch import ServerProcess, fill_placeholders
from tasks.serving.sglang import cpu_command

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
START_TIMEOUT_S = 600  # ~30 s on idle cores, ~90 s on busy ones


def sglang_python() -> Path:
    """The real SGLang's interpreter, or a skip that says how to get it."""
    if not SGLANG_PYTHON.is_file():
        pytest.skip(f"no real SGLang: {SGLANG_PYTHON} is missing (`make sglang` installs it; CI does)")
    return SGLANG_PYTHON


def sglang_command(target: Path, *, context_length: int, max_running: int | None = None, extra=()) -> list[str]:
    """cpu_command for the test venv, {host} filled, {port} left to fill; a kimi_k25 target's remote code trusted."""
    kimi = '"kimi_k25"' in (target / "config.json").read_text()
    words = cpu_command(
        str(sglang_python()),
        str(target),
        context_length=context_length,
        max_running=max_running,
        trust_remote_code=kimi,
    )
    return [fill_placeholders(w, {"host": "127.0.0.1"}) for w in words] + list(extra)


BIND_FAILED = b"address already in use"  # uvicorn's words when the port was taken after free_port chose it


def start_sglang(
    target: Path,
    log: Path,
    *,
    context_length: int,
    max_running: int | None = None,
    extra: list[str] = (),  # type: ignore[assignment]
    env: dict[str, str] | None = None,
    port: int | None = None,
) -> ServerProcess:
    """A real SGLang serving `target`, healthy (its /health_generate answered 200); stop() it when done.

    A port free when chosen may be taken before SGLang binds it (the other xdist worker's servers): uvicorn then says
    "address already in use" while SGLang's process lives on, and the health probe would ask whoever holds the port
    (a CI run waited 600 s so). That launch is stopped at once and another port tried, twice at most, unless `port`
    was given."""
    for attempt in range(3):
        chosen = port or free_port()
        words = [
            fill_placeholders(w, {"port": str(chosen)})
            for w in sglang_command(target, context_length=context_length, max_running=max_running, extra=extra)
        ]
        server = ServerProcess(words, f"http://127.0.0.1:{chosen}", log_path=log, env=env, engine="sglang")
        server.start()
        done = threading.Event()
        watcher = threading.Thread(target=_stop_if_the_bind_failed, args=(server, log, done), daemon=True)
        watcher.start()
        try:
            server.wait_healthy(timeout_s=START_TIMEOUT_S)
        except BaseException:
            done.set()
            watcher.join(10)
            server.stop()
            if port is None and attempt < 2 and _bind_failed(server, log):
                continue
            raise
        done.set()
        watcher.join(10)
        return server
    raise AssertionError("unreachable")


def _bind_failed(server: ServerProcess, log: Path) -> bool:
    try:
        with open(log, "rb") as f:
            f.seek(server.log_start)
            return BIND_FAILED in f.read()
    except OSError:
        return False


def _stop_if_the_bind_failed(server: ServerProcess, log: Path, done: threading.Event) -> None:
    while not done.wait(0.5):  # polling the server's log: its only word on the bind
        if _bind_failed(server, log):
            server.stop()  # wait_healthy then sees the process gone and raises
            return
