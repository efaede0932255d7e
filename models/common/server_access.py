"""How a server is reached: its base URL (checked), a launched replica's URL, the API key from the environment.

Plain Python: the run config's server sections (models/common/jobs.py) and the launchers (tasks/serving/launch.py) use
it.
"""

from __future__ import annotations

import os
import re
from urllib.parse import urlsplit

SERVER_URL_FORM = "scheme://host:port, e.g. http://127.0.0.1:30000"
_NETLOC = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\[\]@]+)(?::(?P<port>[^:]*))?")


def api_key_from_env(variable: str | None, setting: str) -> str | None:
    """The API key in env variable `variable` (None when none is named); RuntimeError naming `setting` when unset."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise RuntimeError(f"{setting} names ${variable}, which is not set in this environment")
    return key


def replica_url(url: str, replica: int, *, router: bool) -> str:
    """Where launched replica `replica` listens: url's port + replica (+ 1 behind a router, which takes url's port)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname  # IPv6 keeps its brackets
    return f"{parts.scheme}://{host}:{port + replica + (1 if router else 0)}"


def server_url(value: str) -> str:
    """`value` as scheme://host[:port] without a trailing slash; ValueError showing the right form."""
    parts = urlsplit(value)
    if "@" in parts.netloc:
        # Credentials in the URL would end up in logs and RUN_DIR/config.yaml.
        raise ValueError(
            f"must not hold a user or password; the form is {SERVER_URL_FORM}"
            " (put the API key in the environment variable named by server.api_key_env)"
        )
    netloc = _NETLOC.fullmatch(parts.netloc)
    if parts.scheme not in ("http", "https") or netloc is None or re.search(r"\s", value):
        raise ValueError(f"must be an http(s) URL of the form {SERVER_URL_FORM}")
    port = netloc["port"]
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not a number from 1 to 65535; the form is {SERVER_URL_FORM}")
    base = f"{parts.scheme}://{parts.netloc}"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        # The client appends /generate, /health_generate and /abort_request to this base itself.
        raise ValueError(
            f"must be the server's base URL, scheme://host:port with no path: use {base!r}"
            " (SGLang's native API is at the root; the pipeline adds /generate itself)"
        )
    return base
