"""The simulated engine behind sglang_protocol's SGLang endpoints: `SimBackend` (an sglang_protocol.app.SGLangBackend).

/generate as SGLang 0.5.23's tokenizer_manager.py ``generate_request`` takes it: the body normalised, its rids
claimed (``_init_req_state``: duplicates refused), each prompt checked (sglang_protocol.limits.ModelLimits), a failure
freeing the batch's rids; /flush_cache only when idle (scheduler.py ``flush_cache``).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable, MutableMapping
from typing import Any, Protocol

from fastapi import Request

from emulators.sglang_protocol.disconnect import results_or_abort
from emulators.sglang_protocol.errors import BadRequest, ContractError, MalformedRequest
from emulators.sglang_protocol.info import loads, model_info, server_info
from emulators.sglang_protocol.request import parse_generate
from emulators.sglang_protocol.rids import HeldRids
from emulators.sglang_protocol.versions import SGLangVersion
from emulators.sim.config import SimConfig
from emulators.sim.output import simulate_output
from emulators.sim.scheduler import Seq
from emulators.sim.stats import SimStats

VERSION = "0.1.0-eagle3-sim"


class SimEngine(Protocol):
    """What the backend uses of the server it answers for: server.py's `SimServer`, its engine (Scheduler,
    scheduler.py) and its faults (FaultInjection, faults.py)."""

    config: SimConfig
    version: SGLangVersion
    stats: SimStats
    _held: HeldRids
    _running: set[Seq]
    _live: set[Seq]
    _starting: bool
    _drop_fraction: float
    _drop_after_s: float
    _drop_rng: random.Random
    _reject: Callable[[list[int]], Any] | None
    _abort_if: Callable[[list[int]], Any] | None
    _hold_if: Callable[[list[int]], Any] | None

    def _batch_loop(self) -> asyncio.AbstractEventLoop: ...

    def _admit(self, seqs: list[Seq]) -> None: ...

    def _abort(self, rid: str, abort_all: bool = False, cause: str = "request") -> int: ...

    def _cut_later(self, scope: MutableMapping[str, Any], after_s: float, seqs: list[Seq]) -> None: ...


class SimBackend:
    """The simulated engine behind the SGLang endpoints (see sglang_protocol.app.SGLangBackend)."""

    def __init__(self, server: SimEngine):
        self.server = server

    async def generate(self, request: Request) -> Any:
        srv = self.server
        stats = srv.stats
        stats.requests += 1
        stats.open_requests += 1
        if stats.open_requests > stats.max_open_requests:
            stats.max_open_requests = stats.open_requests
        try:
            arrived = srv._batch_loop().time()
            try:
                req = parse_generate(await request.body(), server="sim server", accepts_text=False, version=srv.version)
                # tokenizer_manager.py generate_request: normalise, `_init_req_state` (duplicate rids),
                # then check each prompt; a failure frees the batch's rids again.
                try:
                    srv._held.claim(req.rids)
                except BadRequest:
                    srv.stats.duplicate_rids += 1
                    raise
                try:
                    seqs = [
                        self._sequence(ids, raw, rid, arrived)
                        for ids, raw, rid in zip(req.prompts, req.sampling_params, req.rids)
                    ]
                except BaseException:
                    for rid in req.rids:
                        srv._held.release(rid)
                    raise
            except (BadRequest, ContractError, MalformedRequest):
                srv.stats.rejected += 1
                raise
            srv._admit(seqs)
            if srv._drop_fraction > 0 and srv._drop_rng.random() < srv._drop_fraction:
                srv._cut_later(request.scope, srv._drop_after_s, seqs)
            results = await results_or_abort(
                request,
                asyncio.gather(*(s.future for s in seqs)),
                # The poll noticed the client is gone: abort_request(rid) for each (prefix rule included).
                lambda: [srv._abort(s.rid, cause="disconnect") for s in seqs],
                poll_s=srv.config.disconnect_poll_s,
            )
            return results[0] if req.single else results
        finally:
            stats = srv.stats  # reset_stats may have replaced it meanwhile
            stats.open_requests = max(0, stats.open_requests - 1)

    def _sequence(self, ids: str | list[int], raw_params: Any, rid: str, arrived: float) -> Seq:
        """Check one prompt as SGLang would, then as reject_if says; its simulated answer."""
        if isinstance(ids, str):  # parse_generate(accepts_text=False) refuses text prompts
            raise RuntimeError("sim server: parse_generate let a text prompt through")
        srv = self.server
        params = srv.config.limits.admit(ids, raw_params)
        if srv._reject is not None:
            verdict = srv._reject(ids)
            if verdict:
                raise BadRequest(
                    verdict
                    if isinstance(verdict, str)
                    else "The prompt was rejected by the sim server's reject_if rule."
                )
        out = simulate_output(ids, params, srv.config, rid)
        doomed = srv._abort_if is not None and bool(srv._abort_if(ids))
        held = srv._hold_if is not None and bool(srv._hold_if(ids))
        return Seq(rid, len(ids), out, arrived, srv._batch_loop().create_future(), doomed, held)

    def abort(self, rid: str, abort_all: bool) -> int:
        self.server.stats.abort_requests += 1
        return self.server._abort(rid, abort_all)

    def flush_cache(self) -> bool:
        return not self.server._live  # scheduler.py flush_cache: only when idle (nothing else to reset here)

    def healthy(self) -> bool:
        return not self.server._starting

    async def health_generate(self) -> bool:
        return not self.server._starting  # no model to probe: as healthy as /health

    def server_info(self) -> dict[str, Any]:
        srv = self.server
        cfg = srv.config
        return server_info(
            model_path=cfg.model_path,
            served_model_name=cfg.model_path,
            limits=cfg.limits,
            max_running=cfg.max_running,
            dtype="simulated",
            device="none",
            skip_tokenizer_init=False,  # it answers with a "text" (emulators/sim/output.py), as a tokenizer would
            version=VERSION,
        )

    def loads(self) -> dict[str, Any]:
        srv = self.server
        return loads(
            running=len(srv._running),
            waiting=len(srv._live) - len(srv._running),
            max_running=srv.config.max_running,
            version=VERSION,
        )

    def model_info(self) -> dict[str, Any]:
        return model_info(
            model_path=self.server.config.model_path, model_type="simulated", architectures=["SimulatedForCausalLM"]
        )
