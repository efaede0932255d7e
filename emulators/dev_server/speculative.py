"""A draft to serve with: `Speculative`, from SGLang's ``--speculative-*`` flags (SGLang 0.5.23's names).

Speculative decoding (``--speculative-algorithm EAGLE3 --speculative-draft-model-path DIR
--speculative-num-steps S [--speculative-eagle-topk 1] [--speculative-num-draft-tokens S+1]``,
SGLang's flags): the server loads an EAGLE-3 draft exported by ``models/export/eagle3.py`` (draft.py) and
decodes every request with chain (top-1) speculative decoding -- the very function the in-process
eval uses, ``models.eval.speculative_decoding.speculative_decode`` (greedy target, top-1 draft; batcher.py).
``meta_info`` then
carries SGLang's ``spec_verify_ct``: the request's verify rounds (target forwards after the
prefill); the first token comes from the prefill and belongs to no round, so a request that ends
there has 0. SGLang's acceptance length is ``completion_tokens / spec_verify_ct``; the per-round
mean the eval reports excludes that prefill token: ``(completion_tokens - 1) / spec_verify_ct``.
Like SGLang's EAGLE worker, the server reserves ``max(topk * steps, draft tokens)`` = S + 1 tokens
per request in its length checks (srt/managers/utils.py ``compute_num_reserved_tokens``), so a
prompt that fits the plain server can be refused by the one with the draft.

Greedy only: a request with temperature > 0 (and top_k != 1) is refused with 400 while a draft is
loaded (SGLang samples with a draft; this server does not). Only topk 1 and S+1 draft tokens exist.
Greedy speculative decoding returns exactly the tokens plain greedy decoding returns.
Throughput cost: with a draft, requests are not batched -- the worker runs one request's whole
speculative decode at a time (batch size 1), and /abort_request reaches a request only before it
starts.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from emulators.sglang_protocol.limits import num_reserved_tokens


@dataclasses.dataclass(frozen=True)
class Speculative:
    """A draft to serve with, from SGLang's `--speculative-*` flags (checked by `from_flags`)."""

    draft_model_path: str
    num_steps: int

    @classmethod
    def from_flags(
        cls,
        *,
        draft_model_path: str | Path | None,
        algorithm: str | None = None,
        num_steps: int | None = None,
        eagle_topk: int | None = None,
        num_draft_tokens: int | None = None,
    ) -> Speculative | None:
        """None without a draft path; ValueError (SGLang's flag names) for what this server cannot do."""
        if draft_model_path is None:
            given = {
                "--speculative-algorithm": algorithm,
                "--speculative-num-steps": num_steps,
                "--speculative-eagle-topk": eagle_topk,
                "--speculative-num-draft-tokens": num_draft_tokens,
            }
            extra = [flag for flag, value in given.items() if value is not None]
            if extra:
                raise ValueError(f"{', '.join(extra)} given without --speculative-draft-model-path")
            return None
        if algorithm is not None and algorithm.upper() != "EAGLE3":
            raise ValueError(
                f"--speculative-algorithm must be EAGLE3 (the only draft this server runs), got {algorithm!r}"
            )
        if num_steps is None:
            raise ValueError("--speculative-num-steps is required with --speculative-draft-model-path")
        if num_steps < 1:
            raise ValueError(f"--speculative-num-steps must be >= 1, got {num_steps}")
        if eagle_topk is not None and eagle_topk != 1:
            raise ValueError(f"--speculative-eagle-topk must be 1 (chain speculative decoding only), got {eagle_topk}")
        if num_draft_tokens is not None and num_draft_tokens != num_steps + 1:
            raise ValueError(
                f"--speculative-num-draft-tokens must be --speculative-num-steps + 1 = {num_steps + 1} "
                f"with topk 1, got {num_draft_tokens}"
            )
        path = Path(draft_model_path)
        if not (path / "config.json").is_file():
            raise ValueError(
                f"--speculative-draft-model-path {path}: no config.json (an EAGLE-3 export, models/export/eagle3.py)"
            )
        return cls(draft_model_path=str(path), num_steps=int(num_steps))

    @property
    def reserved_tokens(self) -> int:
        """What SGLang's tokenizer manager reserves per request for this draft (`compute_num_reserved_tokens`)."""
        return num_reserved_tokens(eagle_topk=1, num_steps=self.num_steps, num_draft_tokens=self.num_steps + 1)

    def server_args(self) -> dict[str, Any]:
        """SGLang's server-arg names and values, as /server_info reports them."""
        return {
            "speculative_algorithm": "EAGLE3",
            "speculative_draft_model_path": self.draft_model_path,
            "speculative_num_steps": self.num_steps,
            "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": self.num_steps + 1,
        }
