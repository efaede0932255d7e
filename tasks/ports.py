"""A free TCP port: for a server the pipeline starts and for a rank launch's master port.

Its own module, torch-, prefect- and httpx-free, so that launching ranks (tasks/launch.py) needs
neither the server machinery (tasks/processes.py) nor Prefect: the GPU check (bench/gpu_check.py)
launches ranks on a machine that has no Prefect.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
