"""A free TCP port: for a server the pipeline starts and for a rank launch's master port.

Its own module, torch-, prefect- and httpx-free, so that launching ranks (tasks/runtime/launch_ranks.py) needs
neither the server machinery (tasks/serving/launch.py) nor Prefect: the GPU check (tools/gpu_check.py)
launches ranks on a machine that has no Prefect.
"""

from __future__ import annotations

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """The first of `count` consecutive ports on `host` that nothing listens on right now (for replicas)."""
    import random

    for _ in range(tries):
        base = random.randint(20000, 60000 - count)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + count):
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(sock)
                sock.bind((host, port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host} after {tries} tries")
