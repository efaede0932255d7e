"""The simulated server's counters: `SimStats` (requests, served and aborted tokens, the busy-slot integral, maxima)."""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass
class SimStats:
    """Server counters. Live on `SimServer.stats`; `SimServer.snapshot()` returns a current copy.

    Utilisation of a run = served_tokens / (config.capacity_tokens_per_s * wall_s).
    """

    requests: int = 0  # /generate HTTP requests received (including failed and dropped ones)
    sequences: int = 0  # prompts accepted for generation (a batch counts each item)
    completed: int = 0  # sequences finished with stop or length
    aborted: int = 0  # sequences finished by abort: /abort_request, client gone, down/restart
    served_tokens: int = 0  # completion tokens of completed sequences
    aborted_tokens: int = 0  # tokens generated for aborted sequences: wasted capacity
    busy_slot_s: float = 0.0  # integral over time of the number of running sequences
    busy_wall_s: float = 0.0  # wall time with at least one sequence running
    queue_wait_s: float = 0.0  # summed time sequences waited for a slot (after any slow() hold)
    queued_sequences: int = 0  # sequences that found no free slot and had to wait
    running: int = 0
    queued: int = 0  # waiting for a slot (including those held by slow())
    in_flight: int = 0  # running + queued
    max_running_seen: int = 0
    max_in_flight: int = 0
    open_requests: int = 0  # /generate HTTP requests being handled now
    max_open_requests: int = 0
    injected_errors: int = 0  # answered by fail_next
    dropped_connections: int = 0  # closed by drop_next, and admitted requests cut by drop_fraction
    rejected: int = 0  # 400 answers to /generate (bad input, reject_if, contract gate, duplicate rids)
    duplicate_rids: int = 0  # of those, refused for a rid the server still holds (or repeated in the batch)
    abort_requests: int = 0  # /abort_request calls answered (ignored ones included; not the 401s)
    aborted_by_request: int = 0  # sequences aborted by /abort_request or abort_all() (prefix matches included)
    aborted_by_disconnect: int = 0  # sequences aborted when the disconnect poll found their client gone
    queued_aborts: int = 0  # of the aborted, those still queued: SGLang's queued-abort answer (not down()'s drops)
    auth_refused: int = 0  # 401/403 answers (a missing or wrong API key)
    restarts: int = 0  # down()/up() cycles
    since: float = 0.0  # event-loop clock when counting started (start or reset_stats)
    clock: float = 0.0  # event-loop clock of this snapshot

    @property
    def wall_s(self) -> float:
        return max(0.0, self.clock - self.since)

    def to_dict(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "wall_s": self.wall_s}
