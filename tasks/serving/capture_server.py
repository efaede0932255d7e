"""The vLLM server of the capture stage (capture.engine.launch: dev | command), started with the extraction config.

The command gets this capture's extraction config filled in ({speculative_config}, {kv_transfer_config}:
the layer ids the capture reads, its shared_dir and our connector), so the server cannot extract other layers than
the capture expects; its PYTHONPATH starts with deploy/vllm-plugins, where vLLM imports the connector from. The
server is waited for on vLLM's /health, stopped (its whole process group) when the attempt ends, fails or is
cancelled -- tasks/serving/launch.py's `ServerProcess` and `serving` -- and gets SIGTERM if the capture process dies.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from models.capture.vllm_hidden import connector_env, extraction_config
from tasks.serving.launch import ServerProcess, answers, fill_placeholders, serving

ORPHAN_WAIT_S = 30.0  # how long an old server at the capture's URL may take to go away
log = logging.getLogger("eagle3.capture.engine")


@dataclass(frozen=True)
class CaptureServer:
    """The capture's server: how it is launched (capture.engine.launch), where it answers, what it extracts."""

    launch: str  # dev | command | none
    url: str
    target: str
    aux_layers: list[int]
    num_layers: int
    shared_dir: Path
    command: list[str] | None = None  # launch: command
    trust_remote_code: bool = False  # the dev server's (a command carries its engine's flag itself)


def capture_server_command(server: CaptureServer) -> list[str]:
    """The server's command line: the dev server's emulation, or `command` with its placeholders filled."""
    parts = urlparse(server.url)
    host, port = parts.hostname or "127.0.0.1", str(parts.port or 80)
    shared_dir = server.shared_dir
    speculative, kv_transfer = extraction_config(server.aux_layers, server.num_layers, shared_dir)
    if server.launch == "dev":
        return [
            sys.executable,
            "-m",
            "emulators.dev_server",
            "--model",
            server.target,
            "--host",
            host,
            "--port",
            port,
            "--speculative-config",
            json.dumps(speculative),
            "--kv-transfer-config",
            json.dumps(kv_transfer),
            *(["--trust-remote-code"] if server.trust_remote_code else []),
        ]
    if not server.command:
        raise ValueError("capture.engine.launch: command needs capture.engine.command")
    fill = {
        "host": host,
        "port": port,
        "speculative_config": json.dumps(speculative),
        "kv_transfer_config": json.dumps(kv_transfer),
        "shared_dir": str(shared_dir),
    }
    return [fill_placeholders(word, fill) for word in server.command]


def launched_capture_server(
    server: CaptureServer,
    *,
    log_dir: Path | None = None,
    health_timeout_s: float = 3600.0,
    logger: logging.Logger | logging.LoggerAdapter = log,
) -> contextlib.AbstractContextManager:
    """A context running the capture's server (`dev` or `command`), or nothing (`none`: it runs already)."""
    if server.launch == "none":
        return contextlib.nullcontext()
    words = capture_server_command(server)
    url = server.url
    if answers(url) and not went_away(url, ORPHAN_WAIT_S, logger):
        raise RuntimeError(
            f"something still answers at {url} after {ORPHAN_WAIT_S:.0f} s: stop it (an old server would be used "
            "instead of the one this capture starts) or set capture.engine.launch: none to use it"
        )
    log_path = None if log_dir is None else log_dir / "capture-server.log"
    env = connector_env()  # vLLM imports the connector from deploy/vllm-plugins
    # dies with the thread that holds it: a capture killed with -9 leaves no server on the port or the GPUs
    launched = ServerProcess(words, url, log_path=log_path, env=env, engine="vllm", die_with_parent=True)
    return serving([launched], health_timeout_s)


def went_away(url: str, wait_s: float, logger: logging.Logger | logging.LoggerAdapter = log) -> bool:
    """Whether what answers at `url` stops answering within `wait_s`, saying so every 10 s: the server of a killed
    capture gets SIGTERM with its parent's death and takes seconds to shut down."""
    deadline = time.monotonic() + wait_s
    said = 0.0
    while answers(url):
        now = time.monotonic()
        if now >= deadline:
            return False
        if now - said >= 10:
            said = now
            logger.info(
                "capture: something answers at %s; waiting up to %.0f s for it to stop (a killed run's server)",
                url,
                deadline - now,
            )
        time.sleep(0.5)
    return True
