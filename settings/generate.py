"""The `generate:` section: checkpointing, progress and retries of the generate stage, each key once.

`GenerateSettings` is what each dataset's generate task carries (models/common/jobs.py `GenerateJob`, with the
dataset's own budget: settings/dataset.py `DatasetGenerateSettings`); `GenerateConfig`, the section, adds the retries
the flow runs the tasks with.
"""

from __future__ import annotations

from pydantic import Field

from settings.base import Section, StrictModel


class GenerateSettings(StrictModel):
    """Checkpointing and progress of the generate stage."""

    flush_every: int = Field(default=256, ge=1)
    """Write a checkpoint part every this many responses."""
    flush_interval_s: float = Field(default=60.0, gt=0)
    """...and at least this often (seconds): a kill loses at most this window."""
    log_interval_s: float = Field(default=30.0, gt=0)
    """Seconds between progress log lines and progress-artifact updates."""
    throughput_window_s: float = Field(default=120.0, gt=0)
    """Tokens/s and the ETA are measured over this recent window."""
    compact_min_parts: int = Field(default=64, ge=2)
    """Merge small checkpoint parts once this many have been written."""


class GenerateConfig(GenerateSettings, Section):
    """Checkpointing, progress and retries of the generate stage."""

    retries: int = Field(default=3, ge=0)
    """Prefect retries of a dataset task that failed (e.g. server outage)."""
    retry_delay_s: float = Field(default=60.0, ge=0)
    """First delay before a retry; doubles each time, with jitter."""
