"""The vLLM server of the capture stage (capture.engine.launch: dev | command), started with the extraction config.

The command gets this capture's extraction config filled in ({speculative_config}, {kv_transfer_config}:
the layer ids the capture reads and its shared_dir), so the server cannot extract other layers than
the capture expects. The server is waited for on vLLM's /health, stopped (its whole process group)
when the stage ends, fails or is cancelled -- tasks/launch_servers.py's `ServerProcess` and `serving`.
"""

from __future__ import annotations

import contextlib
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from models.capture.vllm_hidden import extraction_config
from tasks.launch_servers import ServerProcess, answers, fill_placeholders, serving


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
    server: CaptureServer, *, log_dir: Path | None = None, health_timeout_s: float = 3600.0
) -> contextlib.AbstractContextManager:
    """A context running the capture's server (`dev` or `command`), or nothing (`none`: it runs already)."""
    if server.launch == "none":
        return contextlib.nullcontext()
    words = capture_server_command(server)
    url = server.url
    if answers(url):
        raise RuntimeError(
            f"something already answers at {url}: stop it (an old server would be used instead of the one this "
            "capture starts) or set capture.engine.launch: none to use it"
        )
    log_path = None if log_dir is None else log_dir / "capture-server.log"
    return serving([ServerProcess(words, url, log_path=log_path, engine="vllm")], health_timeout_s)
