"""What one generate run of a dataset has to do: the prompts not yet done, in the order they are sent.

A prompt is done when its id is among the dataset's responses or its standing rejects. With `turns: all` each
conversation contributes its first turn not on disk (tasks.generate.conversations); the loop queues its next turns
as they are answered.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from models.common.jobs import GenerateJob
from tasks.datasets import PromptRow
from tasks.generate.conversations import Conversation, resume
from tasks.responses.checkpoints import PartSummary, turn_answers, turn_finishes
from tasks.responses.turn_ids import split_turn_id


@dataclass
class Work:
    """What a generate run has to do: the requests to send first, and what it counts them against."""

    queue: deque[PromptRow]
    total: int  # prompts (turns: all: user turns) the dataset will use
    rejected_before: int  # of them, standing rejects
    conversations: dict[str, Conversation] = field(default_factory=dict)  # turns: all: by the queued turn's id
    ended: int = 0  # turns: all: conversations ended early
    empty: list[PromptRow] = field(default_factory=list)  # turns: all: rows with nothing to regenerate
    holes: list[str] = field(default_factory=list)  # turns: all: missing turns with later ones on disk
    turns: bool = False

    def describe(self, rows: int, before: PartSummary) -> str:
        if self.turns:
            return (
                f"{rows} conversations ({self.total} user turns), {before.rows} turns already done "
                f"({before.completion_tokens} completion tokens), {len(self.queue)} conversations to continue"
            )
        return (
            f"{rows} prompts, {rows - len(self.queue)} already done ({before.completion_tokens} completion tokens), "
            f"{len(self.queue)} to go"
        )


def plan_work(
    prompts: list[PromptRow],
    settings: GenerateJob,
    responses_dir: Path,
    responded: set[str],
    standing: set[str],
    tokenizer: Any,
) -> Work:
    """The prompts not yet done (not responded, not a standing reject); with turns: all, each conversation's first
    turn not on disk (tasks.generate.conversations)."""
    if settings.turns == "last":
        queue = deque(p for p in prompts if p.id not in responded and p.id not in standing)
        return Work(queue, len(prompts), sum(1 for p in prompts if p.id in standing))
    stop_ids = list(settings.sampling_params.get("stop_token_ids") or [])
    resumed = resume(
        prompts,
        turn_finishes(responses_dir),
        standing,
        tokenizer,
        stop_ids,
        lambda ids: turn_answers(responses_dir, ids),
    )
    ours = {p.id for p in prompts}
    rejected = sum(1 for i in standing if (split_turn_id(i) or (i, 0))[0] in ours)
    return Work(
        deque(resumed.queue),
        resumed.turns,
        rejected,
        resumed.conversations,
        resumed.ended,
        resumed.empty,
        resumed.holes,
        turns=True,
    )
