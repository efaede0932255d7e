"""The model's limits as SGLang 0.5.23 derives and checks them, per prompt: `ModelLimits`, `num_reserved_tokens`.

The tokenizer manager's checks (tokenizer_manager.py ``_validate_one_request``, the ids against the
vocabulary) and the scheduler's (``validate_input_length``, the clamp of max_new_tokens to the
context), in SGLang's order and words; with an EAGLE draft the tokenizer checks add the tokens the draft
reserves (srt/managers/utils.py ``compute_num_reserved_tokens``). 0.4.x where it differs (`SGLangVersion`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from emulators.sglang_protocol.errors import BadRequest
from emulators.sglang_protocol.sampling import SamplingParams, parse_sampling_params
from emulators.sglang_protocol.versions import V05, SGLangVersion


def num_reserved_tokens(*, eagle_topk: int, num_steps: int, num_draft_tokens: int) -> int:
    """srt/managers/utils.py `compute_num_reserved_tokens` for an EAGLE draft: max(topk * steps, draft tokens).

    EAGLE stores its draft tokens in the request's output slots, so the tokenizer's length checks
    reserve them per request (no draft: 0).
    """
    return max(eagle_topk * num_steps, num_draft_tokens)


@dataclasses.dataclass(frozen=True)
class ModelLimits:
    """The model's vocabulary and context, and SGLang's limits derived from them.

    `reserved_tokens`: what the tokenizer manager reserves per request on top of the prompt
    (`num_reserved_tokens` with an EAGLE draft, else 0); `sglang_version` picks 0.4.x's checks.
    """

    vocab_size: int
    context_length: int
    reserved_tokens: int = 0
    sglang_version: SGLangVersion = V05

    def __post_init__(self):
        object.__setattr__(self, "sglang_version", SGLangVersion.of(self.sglang_version))
        if self.reserved_tokens < 0:
            raise ValueError(f"reserved_tokens must be >= 0, got {self.reserved_tokens}")

    @property
    def max_req_len(self) -> int:
        """SGLang's scheduler (tp_worker.py): a request (prompt + output) holds at most context - 1 tokens."""
        return self.context_length - 1

    @property
    def max_req_input_len(self) -> int:
        """SGLang's scheduler refuses prompts of max_req_len - 5 tokens or more."""
        return self.max_req_len - 5

    def max_new_tokens(self, prompt_len: int, params: SamplingParams) -> int:
        """The scheduler's clamp of max_new_tokens to the context left (scheduler.py `init_req_max_new_tokens`)."""
        budget = max(0, self.max_req_len - prompt_len - 1)
        return budget if params.max_new_tokens is None else min(params.max_new_tokens, budget)

    def check_ids(self, ids: Sequence[int]) -> None:
        """SGLang's checks of the prompt ids themselves (empty, out of the vocabulary)."""
        if not ids:
            raise BadRequest("input_ids cannot be empty.")
        if max(ids) >= self.vocab_size:
            raise BadRequest(
                f"The input_ids {list(ids)} contains values greater than the vocab size ({self.vocab_size})."
            )
        if min(ids) < 0:
            raise BadRequest(f"The input_ids {list(ids)} contains negative values.")

    def check_lengths(self, prompt_len: int, params: SamplingParams) -> None:
        """TokenizerManager._validate_one_request (0.5.23, lines ~1333-78), then the scheduler's validate_input_length.

        0.5.23 counts the prompt plus the reserved tokens in both tokenizer checks and refuses a total
        over the context; 0.4.10 reserves nothing and refuses a total of the context or more.
        """
        v = self.sglang_version
        n, ctx = prompt_len + (self.reserved_tokens if v.reserves_draft_tokens else 0), self.context_length
        if n >= ctx:
            raise BadRequest(f"The input ({n} tokens) is longer than the model's context length ({ctx} tokens).")
        if params.max_new_tokens is not None:
            total = n + params.max_new_tokens
            if total >= ctx if v.total_tokens_refused_at_context else total > ctx:
                raise BadRequest(
                    f"Requested token count exceeds the model's maximum context length of {ctx} tokens. "
                    f"You requested a total of {total} tokens: {n} tokens from the input "
                    f"messages and {params.max_new_tokens} tokens for the completion. Please reduce the number "
                    "of tokens in the input messages or the completion to fit within the limit."
                )
        if prompt_len >= self.max_req_input_len:
            raise BadRequest(
                f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                f"({self.max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate."
            )

    def admit(self, ids: Sequence[int], raw_params: Any, *, unimplemented_by: str | None = None) -> SamplingParams:
        """All of SGLang's checks of one prompt, in SGLang's order; returns its sampling params."""
        self.check_ids(ids)
        params = parse_sampling_params(raw_params, unimplemented_by=unimplemented_by)
        self.check_lengths(len(ids), params)
        return params
