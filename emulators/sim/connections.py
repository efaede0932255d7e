"""The simulated server's open TCP connections, recorded through uvicorn's h11 protocol, for the faults that cut them.

HTTP has no words for a connection closed without an answer or reset mid-request; faults.py needs the
connection's transport for those (``drop_next``, ``drop_fraction``) and ``down()`` cuts every open one.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import Callable
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class Connections:
    """The server's open TCP connections by client address, for the faults HTTP has no words for.

    drop_next closes one request's connection without an answer (FIN, or RST with reset=True);
    down() cuts every open connection at once. Both need the connection's transport, which
    neither ASGI nor Starlette hands to an app: raising from the app makes uvicorn answer 500
    instead (or, once a response has started, close after sending its status line), and a TCP
    proxy in front would copy every byte through Python. uvicorn takes its HTTP protocol class
    through its public config (``Config(http=...)``), so a subclass of its h11 protocol records
    each connection in asyncio's own Protocol callbacks (``connection_made``/``connection_lost``),
    keyed by the peer address that ASGI gives every request as ``scope["client"]``.
    """

    def __init__(self) -> None:
        self.open: dict[tuple[str, int], asyncio.Transport] = {}
        self.refusing = False  # cut new connections at once (down() before uvicorn stops listening)
        self.protocol_class = self._tracking_protocol()

    def _tracking_protocol(self) -> type[H11Protocol]:
        connections = self

        class TrackedH11Protocol(H11Protocol):
            def connection_made(self, transport):
                super().connection_made(transport)
                self.tracked_transport = transport
                connections.opened(transport)

            def connection_lost(self, exc):
                connections.closed(self.tracked_transport)
                super().connection_lost(exc)

        return TrackedH11Protocol

    def opened(self, transport: asyncio.Transport) -> None:
        if self.refusing:
            transport.abort()
            return
        key = peer(transport.get_extra_info("peername"))
        if key is not None:
            self.open[key] = transport

    def closed(self, transport: asyncio.Transport) -> None:
        key = peer(transport.get_extra_info("peername"))
        if key is not None and self.open.get(key) is transport:
            del self.open[key]

    def abort_all(self) -> None:
        for transport in list(self.open.values()):
            transport.abort()

    async def drop(self, scope: dict, receive: Callable, *, reset: bool) -> None:
        """Close the connection of the request in `scope` without a response."""
        key = peer(scope.get("client"))
        transport = None if key is None else self.open.get(key)
        if transport is None:
            raise RuntimeError(f"sim server: no open connection from {scope.get('client')} to drop")
        if reset:
            sock = transport.get_extra_info("socket")
            if sock is not None:  # linger 0: close() sends RST instead of FIN
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        else:
            transport.close()
        # Return only once uvicorn has seen the disconnect, so it does not answer 500 for us.
        while (await receive())["type"] != "http.disconnect":
            pass


def peer(address: Any) -> tuple[str, int] | None:
    """A TCP peer address as ASGI's scope["client"] gives it: (host, port)."""
    if not isinstance(address, (tuple, list)) or len(address) < 2:
        return None
    return str(address[0]), int(address[1])
