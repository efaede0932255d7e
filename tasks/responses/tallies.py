"""Tallies: dataclasses of counts that add up, part by part, into a dataset's total."""

from __future__ import annotations

from dataclasses import fields
from typing import Any


def add_counts(into: Any, other: Any) -> None:
    """Add `other`'s counts into `into`, a dataclass of the same type, field by field.

    A count is a field that starts at 0, [] or {}: an int adds, a list extends, a {key: count} dict
    adds key by key. Any other field (a time that starts at None) is the caller's to combine.
    """
    for f in fields(into):
        mine, theirs = getattr(into, f.name), getattr(other, f.name)
        if f.default_factory is dict:
            for key, n in theirs.items():
                mine[key] = mine.get(key, 0) + n
        elif f.default_factory is list:
            mine.extend(theirs)
        elif type(f.default) is int:
            setattr(into, f.name, mine + theirs)
