"""The base of every run config section (flows/config/schema.py, flows/config/dataset.py)."""

from __future__ import annotations

from models.common.strict import StrictModel


class Section(StrictModel):
    """Base of every config section: unknown keys are errors, no bool for a number (models/common/jobs.py)."""
