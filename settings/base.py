"""The strict pydantic base of every setting: `StrictModel` (job specs and config sections) and `Section`.

`StrictModel` rejects unknown keys, validates on assignment and refuses true/false for a number; a field's
description is the docstring under it (pydantic's use_attribute_docstrings), which docs/config-keys.md shows
(settings/keys.py). A launched process reads its JSON job file through the same classes (models/common/job_files.py
`load_job`).
"""

from __future__ import annotations

import types
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator


class StrictModel(BaseModel):
    """Base of every job spec and config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, use_attribute_docstrings=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true/false as 1/0 for an int or float, so `max_concurrency: true` would
        # quietly mean 1; every number field of every spec (present and future) refuses them.
        if info.field_name is None:  # pydantic names the field for every field validator
            return value
        problem = _bool_for_number(value, cls.model_fields[info.field_name].annotation)
        if problem:
            raise ValueError(problem)
        return value

    def pick(self, spec: type[StrictModel]) -> dict[str, Any]:
        """The values of the fields `spec` declares (self is a subclass of it): a job's share of a config section."""
        return {name: getattr(self, name) for name in spec.model_fields}


class Section(StrictModel):
    """Base of every config section: unknown keys are errors, no bool for a number (`StrictModel`)."""


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _bool_for_number(value: Any, annotation: Any) -> str | None:
    """Why `value` holds a bool where `annotation` wants a number (also inside lists and dicts), or None."""
    members = _union_members(annotation)
    if isinstance(value, bool):
        if bool in members or not {int, float} & set(members):
            return None
        number = "a number" if float in members else "a whole number"
        return f"must be {number}, not true/false"
    for member in members:
        origin = get_origin(member)
        if origin is list and isinstance(value, list):
            (item,) = get_args(member)
            for i, v in enumerate(value):
                problem = _bool_for_number(v, item)
                if problem:
                    return f"item {i} {problem} (got {v!r})"
        elif origin is dict and isinstance(value, dict):
            item = get_args(member)[1]
            for k, v in value.items():
                problem = _bool_for_number(v, item)
                if problem:
                    return f"{k!r} {problem} (got {v!r})"
    return None
