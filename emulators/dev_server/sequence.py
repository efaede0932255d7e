"""One request inside the batcher: `BatchSequence`, and its KV cache in and out of transformers' cache.

Its ``max_new_tokens`` is the request's after SGLang 0.5.23's clamp to the context (scheduler.py
``init_req_max_new_tokens``, emulators/sglang_protocol/limits.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect

import torch

from emulators.sglang_protocol.sampling import SamplingParams


@dataclasses.dataclass(eq=False)
class BatchSequence:
    """One request's state inside the batcher."""

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new_tokens: int  # after SGLang's clamp to the context
    created: float  # perf_counter at arrival, for e2e_latency
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    output_ids: list[int] = dataclasses.field(default_factory=list)
    kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None  # per layer [1, kv_heads, len, head_dim]
    generator: torch.Generator | None = None
    abort_requested: bool = False
    finish_reason: dict | None = None
    spec_verify_ct: int | None = None  # verify rounds, with a draft

    @property
    def prefilled_kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """`kv`, which only a sequence that has had its prefill has."""
        if self.kv is None:
            raise RuntimeError(f"sequence {self.rid!r} has no KV cache: used before its prefill or after its finish")
        return self.kv

    @property
    def kv_len(self) -> int:
        return self.prefilled_kv[0][0].shape[2]


def kv_from_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    if hasattr(cache, "layers"):  # transformers >= 4.56
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache))


def cache_from_kv(kv: list[tuple[torch.Tensor, ...]]):  # per layer (keys, values)
    from transformers import DynamicCache

    if "ddp_cache_data" in inspect.signature(DynamicCache.__init__).parameters:
        return DynamicCache(ddp_cache_data=kv)
    # Older transformers (before ddp_cache_data) only; transformers 5, whose stubs mypy reads, removed it.
    return DynamicCache.from_legacy_cache(tuple(kv))  # type: ignore[attr-defined]
