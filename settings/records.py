"""The `records:` section: how responses and passthrough rows become training records, each key once.

`RecordSettings` is what the records tasks carry (models/common/jobs.py `RecordsJob`, with the target's vocabulary);
`RecordsConfig` is the section.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from settings.base import Section, StrictModel


class RecordSettings(StrictModel):
    """How responses and passthrough rows become training records (input_ids + loss_mask)."""

    max_seq_len: int | None = Field(default=8192, ge=16)
    """Longest record in tokens; longer ones are cut or dropped (see overflow). null: no limit."""
    overflow: Literal["truncate", "drop"] = "truncate"
    """`truncate`: keep the first max_seq_len tokens. `drop`: leave the record out."""
    min_loss_tokens: int = Field(default=1, ge=1)
    """Records with fewer loss tokens than this are left out."""
    keep_truncated: bool = False
    """Also train on responses that ended by length (cut off by max_new_tokens) or abort."""
    on_rewrite: Literal["split", "reject"] = "split"
    """Passthrough conversations whose chat template rewrites earlier turns (e.g. drops their reasoning): `split` makes
    one record per assistant turn, exactly as the model saw it; `reject` sends the row to rejects."""


class RecordsConfig(RecordSettings, Section):
    """How responses and passthrough rows become training records (input_ids + loss_mask)."""
