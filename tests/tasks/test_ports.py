"""tasks/runtime/ports.py: ports chosen below the kernel's ephemeral range, where no other process's client
connection or port-0 bind can take one before its server binds it."""

from __future__ import annotations

import random
import socket
from pathlib import Path

import pytest

from tasks.runtime import ports


def ephemeral_first() -> int:
    return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])


@pytest.mark.skipif(not ports.EPHEMERAL.exists(), reason="no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
def test_a_free_port_is_below_the_ephemeral_range_and_bindable():
    first = ephemeral_first()
    chosen = [ports.free_port() for _ in range(20)]
    assert all(ports.LOWEST <= p < first for p in chosen), (chosen, first)
    for port in chosen[:3]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
    with socket.socket() as sock:  # what the kernel hands out itself is in its range: what a chosen port avoids
        sock.bind(("127.0.0.1", 0))
        assert sock.getsockname()[1] >= first


@pytest.mark.skipif(not ports.EPHEMERAL.exists(), reason="no /proc/sys/net/ipv4/ip_local_port_range (not Linux)")
def test_consecutive_ports_for_replicas_are_below_the_ephemeral_range():
    base = ports.free_ports(3)
    assert ports.LOWEST <= base and base + 3 <= ephemeral_first()
    socks = [socket.socket() for _ in range(3)]
    try:
        for i, sock in enumerate(socks):
            sock.bind(("127.0.0.1", base + i))
    finally:
        for sock in socks:
            sock.close()


def test_a_seeded_random_module_does_not_make_two_processes_choose_alike():
    random.seed(0)
    first = [ports.free_port() for _ in range(5)]
    random.seed(0)
    again = [ports.free_port() for _ in range(5)]
    assert first != again  # the shared generator would give the same five


def test_without_a_readable_range_the_kernel_chooses(monkeypatch, tmp_path):
    monkeypatch.setattr(ports, "EPHEMERAL", tmp_path / "missing")
    assert ports.chosen_range() is None
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", ports.free_port()))
    (tmp_path / "low").write_text("1024\t60999\n")  # a range that leaves no room below it
    monkeypatch.setattr(ports, "EPHEMERAL", tmp_path / "low")
    assert ports.chosen_range() is None
    (tmp_path / "default").write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "EPHEMERAL", tmp_path / "default")
    assert ports.chosen_range() == (ports.LOWEST, 32768)
