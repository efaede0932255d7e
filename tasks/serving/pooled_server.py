"""One server of the generate stage's pool (tasks/serving/pool.py): its client, limits, health and figures, and a
request's place at it (`Lease`)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from tasks.serving.client import EngineClient


@dataclass
class Server:
    """One server of the pool: its client, limits, state and figures."""

    url: str
    client: EngineClient
    max_concurrency: int
    in_flight: int = 0
    healthy: bool = False
    seen_healthy: bool = False
    down_since: float | None = None
    failures_in_a_row: int = 0
    max_input: int | None = None  # max_req_input_len: a prompt must be shorter
    refused: BaseException | None = None  # the server refused the run (401/403/404): stop
    router: bool = False
    responses: int = 0
    completion_tokens: int = 0
    failures: int = 0  # requests that failed here (sent again elsewhere)
    busy_s: float = 0.0  # time with at least one request in flight
    busy_since: float | None = None
    probes: int = 0  # health probes after a failed request
    monitor: asyncio.Task | None = field(default=None, repr=False)
    probe: asyncio.Task | None = field(default=None, repr=False)

    def load(self) -> float:
        return self.in_flight / self.max_concurrency

    def fits(self, prompt_len: int) -> bool:
        return self.max_input is None or prompt_len < self.max_input

    def state(self) -> str:
        if self.healthy:
            return "healthy"
        return "down" if self.seen_healthy else "not up yet"


@dataclass
class Lease:
    """One request's place at a server, from `reserve` until `release` (a failover moves it to another server)."""

    server: Server
    held: bool = True
