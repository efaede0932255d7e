"""A gate in front of a real serving engine: a proxy that passes the first N generate requests and holds the next
ones until it is opened. A test that kills a client mid-run kills it at a known point (N answered, the next one
waiting at the gate) instead of racing the engine: on a starved machine an engine once answered a whole dataset
between the test's first look and its kill."""

from __future__ import annotations

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import TracebackType

import httpx

FORWARDED_HEADERS = ("content-type", "authorization", "accept")


class Gate:
    """`with Gate(upstream, "/v1/completions", passes=8) as gate:` clients use `gate.url`; every request is forwarded
    to `upstream` as it came, except that POSTs to `path` after the first `passes` wait until `open()` (or the end of
    the `with`). `wait_until_holding()` returns once one waits."""

    def __init__(self, upstream: str, path: str, passes: int):
        self.upstream, self.path, self.passes = upstream.rstrip("/"), path, passes
        self.passed = 0
        self.holding = 0
        self.opened = False
        self._state = threading.Condition()
        gate = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                self.forward(b"")

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                if self.path == gate.path:
                    gate.wait_turn()
                self.forward(body)

            def forward(self, body: bytes) -> None:
                headers = {k: v for k, v in self.headers.items() if k.lower() in FORWARDED_HEADERS}
                reply = httpx.request(
                    self.command, gate.upstream + self.path, content=body, headers=headers, timeout=600
                )
                self.send_response(reply.status_code)
                self.send_header("content-type", reply.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            def log_message(self, *args: object) -> None:  # quiet: the test's output is the engine's
                pass

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # a held request whose client was killed: its answer has nowhere to go

        self._server = Server(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def wait_turn(self) -> None:
        with self._state:
            if self.opened or self.passed < self.passes:
                self.passed += 1
                return
            self.holding += 1
            self._state.notify_all()
            self._state.wait_for(lambda: self.opened)
            self.holding -= 1

    def wait_until_holding(self, timeout_s: float) -> bool:
        """True once a request waits at the gate; False after `timeout_s` without one."""
        with self._state:
            return self._state.wait_for(lambda: self.holding > 0, timeout=timeout_s)

    def open(self) -> None:
        with self._state:
            self.opened = True
            self._state.notify_all()

    def __enter__(self) -> Gate:
        self._thread.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.open()
        self._server.shutdown()
        self._server.server_close()
