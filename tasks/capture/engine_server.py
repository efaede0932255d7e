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
from pathlib import Path
from urllib.parse import urlparse

from models.engine_hidden import extraction_config
from tasks.launch_servers import ServerProcess, answers, fill_placeholders, serving


def engine_command(
    launch: str,
    url: str,
    *,
    target: str,
    aux_layers: list[int],
    num_layers: int,
    shared_dir: Path,
    command: list[str] | None = None,
) -> list[str]:
    """The server's command line: the dev server's emulation, or `command` with its placeholders filled."""
    parts = urlparse(url)
    host, port = parts.hostname or "127.0.0.1", str(parts.port or 80)
    speculative, kv_transfer = extraction_config(aux_layers, num_layers, shared_dir)
    if launch == "dev":
        return [
            sys.executable,
            "-m",
            "emulators.dev_server",
            "--model",
            target,
            "--host",
            host,
            "--port",
            port,
            "--speculative-config",
            json.dumps(speculative),
            "--kv-transfer-config",
            json.dumps(kv_transfer),
        ]
    if not command:
        raise ValueError("capture.engine.launch: command needs capture.engine.command")
    fill = {
        "host": host,
        "port": port,
        "speculative_config": json.dumps(speculative),
        "kv_transfer_config": json.dumps(kv_transfer),
        "shared_dir": str(shared_dir),
    }
    return [fill_placeholders(word, fill) for word in command]


def launched_engine(
    launch: str,
    url: str,
    *,
    target: str,
    aux_layers: list[int],
    num_layers: int,
    shared_dir: Path,
    command: list[str] | None = None,
    log_dir: Path | None = None,
    health_timeout_s: float = 3600.0,
) -> contextlib.AbstractContextManager:
    """A context running the capture's server (`dev` or `command`), or nothing (`none`: it runs already)."""
    if launch == "none":
        return contextlib.nullcontext()
    words = engine_command(
        launch, url, target=target, aux_layers=aux_layers, num_layers=num_layers, shared_dir=shared_dir, command=command
    )
    if answers(url):
        raise RuntimeError(
            f"something already answers at {url}: stop it (an old server would be used instead of the one this "
            "capture starts) or set capture.engine.launch: none to use it"
        )
    log_path = None if log_dir is None else log_dir / "capture-server.log"
    return serving([ServerProcess(words, url, log_path=log_path, engine="vllm")], health_timeout_s)
