"""A free TCP port: for a server the pipeline starts and for a rank launch's master port.

Its own module, torch-, prefect- and httpx-free, so that launching ranks (tasks/runtime/launch_ranks.py) needs
neither the server machinery (tasks/serving/launch.py) nor Prefect: the GPU check (tools/gpu_check.py)
launches ranks on a machine that has no Prefect.

A port is chosen below the kernel's ephemeral range (/proc/sys/net/ipv4/ip_local_port_range, 32768-60999 by
default), where the kernel never puts a port of its own: a port chosen there stays free until its server binds it,
unless someone else chose the same one. A port asked of the kernel (bind to port 0) is one of its ephemeral ports,
which it hands out again to the next client connection or port-0 bind of any process on the machine: a CI run saw
a dev server refused its chosen port ("address already in use") while the other test worker's engines ran.
"""

from __future__ import annotations

import random
import socket
from pathlib import Path

LOWEST = 10000  # below: the well-known and registered services' usual ports
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")
# Not the `random` module's shared generator: a process that seeded it (a training's seed) would choose the same
# ports as every other process seeded alike.
CHOOSE = random.SystemRandom()


def chosen_range() -> tuple[int, int] | None:
    """[LOWEST, the first ephemeral port): where free ports are chosen; None where the ephemeral range starts too low
    to leave room (or is unknown: not Linux), and the kernel then chooses."""
    try:
        first = int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return (LOWEST, first) if first - LOWEST >= 1000 else None


def _bindable(host: str, ports: range) -> bool:
    socks: list[socket.socket] = []
    try:
        for port in ports:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(sock)
            sock.bind((host, port))
        return True
    except OSError:
        return False
    finally:
        for sock in socks:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that nothing listens on right now, below the ephemeral range (module docstring)."""
    span = chosen_range()
    if span is not None:
        for _ in range(50):
            port = CHOOSE.randrange(*span)
            if _bindable(host, range(port, port + 1)):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def free_ports(count: int, host: str = "127.0.0.1", tries: int = 50) -> int:
    """The first of `count` consecutive ports on `host` that nothing listens on right now (for replicas), below the
    ephemeral range where there is one (module docstring)."""
    low, high = chosen_range() or (20000, 60000)
    for _ in range(tries):
        base = CHOOSE.randint(low, high - count)
        if _bindable(host, range(base, base + count)):
            return base
    raise RuntimeError(f"no {count} consecutive free ports on {host} after {tries} tries")
