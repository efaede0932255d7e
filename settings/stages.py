"""The pipeline's stages: their names, their order, and the parse of a `--stages` list.

One type for the CLI (`eagle3 run --stages`, `eagle3 node --stages`), the pipeline flow (its `stages` parameter),
the preflight (the checks that matter to the chosen stages) and the run lock (what the chosen stages write).
Plain Python: the run config, the flows and the CLI import it.
"""

from __future__ import annotations

from typing import Literal

Stage = Literal["generate", "records", "capture", "train", "eval"]
STAGES: tuple[Stage, ...] = ("generate", "records", "capture", "train", "eval")  # in pipeline order
NODE_STAGES: tuple[Stage, ...] = ("capture", "train")  # the stages whose rank jobs span nodes (`eagle3 node`)


class UnknownStage(ValueError):
    """A `--stages` list that names no stage, or one that is not among the allowed ones."""


def parse_stages(text: str, allowed: tuple[Stage, ...] = STAGES) -> list[Stage]:
    """The stages of a comma-separated list, in pipeline order, each once; UnknownStage naming what is wrong."""
    chosen = [s.strip() for s in text.split(",") if s.strip()]
    unknown = [s for s in chosen if s not in allowed]
    if unknown or not chosen:
        raise UnknownStage(f"unknown stage(s) {', '.join(unknown) or '(none given)'}; available: {', '.join(allowed)}")
    return [s for s in allowed if s in chosen]
