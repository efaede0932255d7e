"""The model behind sglang_protocol's SGLang endpoints: `DevBackend` (an sglang_protocol.app.SGLangBackend).

/generate as SGLang 0.5.23's tokenizer_manager.py ``generate_request`` takes it: the body normalised, its
rids claimed (``_init_req_state``: duplicates refused), each prompt tokenized (``text``: no chat template,
no special tokens) and checked (sglang_protocol.limits.ModelLimits), a failure freeing the batch's rids;
SGLang sampling params it does not implement (stop strings, penalties, grammars, ...) are refused (400)
unless they have their no-op values. ``GET /health_generate`` is a 1-token probe through the batcher.
/server_info, /v1/loads and /model_info are sglang_protocol/info.py's, with this server's values.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from fastapi import Request

from emulators.dev_server.batcher import Batcher
from emulators.dev_server.sequence import BatchSequence
from emulators.dev_server.speculative import Speculative
from emulators.sglang_protocol.disconnect import DISCONNECT_POLL_S, results_or_abort
from emulators.sglang_protocol.errors import BadRequest, ContractError, ServerError
from emulators.sglang_protocol.info import loads, model_info, server_info
from emulators.sglang_protocol.limits import ModelLimits
from emulators.sglang_protocol.request import parse_generate
from emulators.sglang_protocol.rids import HeldRids, abort_matcher, health_check_rid

logger = logging.getLogger("eagle3.dev_server")

VERSION = "0.1.0-eagle3-dev"
_HEALTH_CHECK_TIMEOUT_S = 20.0


class DevBackend:
    """The model behind the SGLang endpoints (see sglang_protocol.app.SGLangBackend)."""

    def __init__(
        self,
        batcher: Batcher,
        model,
        tokenizer,
        limits: ModelLimits,
        *,
        model_path: str,
        served_model_name: str,
        max_batch_size: int,
        speculative: Speculative | None = None,
        disconnect_poll_s: float = DISCONNECT_POLL_S,
    ):
        self.batcher, self.model, self.tokenizer, self.limits = batcher, model, tokenizer, limits
        self.model_path, self.served_model_name = model_path, served_model_name
        self.max_batch_size = max_batch_size
        self.speculative = speculative
        self.version = batcher.version
        self.disconnect_poll_s = disconnect_poll_s
        self.held = HeldRids(self.version)  # event loop only

    def sequence(self, prompt: str | list[int], raw_params: Any, rid: str, arrived: float) -> BatchSequence:
        """Tokenize and check one prompt (SGLang's checks and words): a sequence for the batcher."""
        if isinstance(prompt, str):
            with self.batcher.tokenizer_lock:
                ids = self.tokenizer.encode(prompt, add_special_tokens=False)  # no chat template, no BOS
        else:
            ids = list(prompt)
        params = self.limits.admit(ids, raw_params, unimplemented_by="dev server")
        if self.speculative is not None and not params.greedy:
            raise BadRequest(
                f"This dev server decodes speculatively (draft {self.speculative.draft_model_path}) with greedy "
                f"sampling only; got temperature={params.temperature}, top_k={params.top_k}. Send temperature 0, "
                "or start the server without --speculative-draft-model-path."
            )
        loop = asyncio.get_running_loop()
        return BatchSequence(
            rid=rid,
            prompt_ids=ids,
            params=params,
            max_new_tokens=self.limits.max_new_tokens(len(ids), params),
            created=arrived,
            loop=loop,
            future=loop.create_future(),
        )

    async def generate(self, request: Request) -> Any:
        arrived = time.perf_counter()
        if not self.batcher.alive:  # app used without its lifespan, or shutting down
            raise ServerError(503, "The dev server's batcher is not running.")
        try:
            req = parse_generate(await request.body(), server="dev server", version=self.version)
            # tokenizer_manager.py generate_request: normalise, `_init_req_state` (duplicate rids), then
            # tokenize and validate each prompt; a failure frees the batch's rids again.
            self.held.claim(req.rids)
            try:
                seqs = [
                    self.sequence(p, sp, r, arrived) for p, sp, r in zip(req.prompts, req.sampling_params, req.rids)
                ]
            except BaseException:
                for rid in req.rids:
                    self.held.release(rid)
                raise
        except (BadRequest, ContractError) as exc:
            logger.info("[dev_server] bad request: %s", exc)
            raise
        for s in seqs:  # held until its final output is processed (`_handle_batch_output` deletes it)
            # The default re-binds the loop variable; mypy can't infer such a lambda (python/mypy#15459).
            s.future.add_done_callback(lambda _f, rid=s.rid: self.held.release(rid))  # type: ignore[misc]
        self.batcher.submit(seqs)
        try:
            results = await results_or_abort(
                request,
                asyncio.gather(*(s.future for s in seqs)),
                # The poll noticed the client is gone: abort_request(rid) for each (prefix rule included).
                lambda: [self.abort(s.rid, False) for s in seqs],
                poll_s=self.disconnect_poll_s,
            )
        except Exception as exc:
            raise ServerError(500, f"Generation failed: {exc!r}") from exc
        return results[0] if req.single else results

    def abort(self, rid: str, abort_all: bool) -> int:
        match = abort_matcher(rid, abort_all, self.held)
        return 0 if match is None else self.batcher.abort(match)

    def flush_cache(self) -> bool:
        return self.batcher.flush_cache()

    def healthy(self) -> bool:
        return self.batcher.alive

    async def health_generate(self) -> bool:
        if not self.batcher.alive:
            return False
        probe = self.sequence([0], {"max_new_tokens": 1, "temperature": 0}, health_check_rid(), time.perf_counter())
        self.batcher.submit([probe])
        try:
            await asyncio.wait_for(probe.future, timeout=_HEALTH_CHECK_TIMEOUT_S)
        except Exception:  # includes the timeout
            self.batcher.abort(seqs=[probe])
            return False
        return True

    def server_info(self) -> dict[str, Any]:
        return server_info(
            model_path=self.model_path,
            served_model_name=self.served_model_name,
            limits=self.limits,
            max_running=self.max_batch_size,
            dtype="float32",
            device="cpu",
            skip_tokenizer_init=False,
            version=VERSION,
            speculative=self.speculative.server_args() if self.speculative else None,
            avg_spec_accept_length=self.batcher.avg_spec_accept_length if self.speculative else None,
        )

    def loads(self) -> dict[str, Any]:
        return loads(
            running=len(self.batcher._active),
            waiting=len(self.batcher._waiting),
            max_running=self.max_batch_size,
            version=VERSION,
        )

    def model_info(self) -> dict[str, Any]:
        config = self.model.config
        return model_info(
            model_path=self.model_path,
            model_type=getattr(config, "model_type", None),
            architectures=getattr(config, "architectures", None),
        )
