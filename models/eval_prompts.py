"""The eval's prompts: one selection that every eval backend (HF in-process, serving engine) decodes.

`eval_prompts(job, vocab_size)` returns them in a fixed order, so two backends, two runs and the
untrained baseline all measure on the same token ids.
"""

from __future__ import annotations

from typing import NamedTuple

from models.jobs import EvalJob
from models.train_data import held_out_prompts


class EvalPrompt(NamedTuple):
    source: str  # the dataset (held-out records) it came from
    id: str
    input_ids: list[int]


def eval_prompts(job: EvalJob, vocab_size: int | None = None) -> list[EvalPrompt]:
    """Up to `job.prompts` prompts: held-out records' tokens before their first loss token, in held-out hash order."""
    return [EvalPrompt(*p) for p in held_out_prompts(job.datasets, job.eval_fraction, job.prompts, vocab_size)]
