"""The `sampling:` section: the sampling parameters sent with every /generate request, each key once."""

from __future__ import annotations

from pydantic import Field, field_validator

from settings.base import Section


class SamplingConfig(Section):
    """Sampling parameters sent with every /generate request (SGLang's `sampling_params`)."""

    max_new_tokens: int = Field(default=16384, ge=1)
    """Most completion tokens per response. Set it explicitly: SGLang's own default is 128, which silently truncates
    reasoning responses."""
    temperature: float = Field(default=1.0, ge=0)
    """0 means greedy decoding."""
    top_p: float = Field(default=0.95, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """-1 disables top-k filtering."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a response (kept in output_ids). Default: the target tokenizer's eos token."""
    seed: int | None = Field(default=None, ge=0)
    """Makes sampling repeatable: each /generate request gets SGLang's `sampling_seed`, derived from (seed, dataset,
    prompt id), so a prompt's response does not depend on the order or concurrency it was sent with. SGLang honours
    it only when the server runs with --enable-deterministic-inference (docs/run-a-pipeline.md, 'Repeatable
    sampling'); the dev server always does. None: the server draws its own randomness."""

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (off) or a positive number of candidates")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(i < 0 for i in value)):
            raise ValueError("must be a non-empty list of non-negative token ids (or omitted)")
        return value
