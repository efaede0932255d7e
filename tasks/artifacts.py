"""Prefect artifact keys: every stage names its progress bars and tables the same way; a sync task's progress bar."""

from __future__ import annotations

import re
from uuid import UUID

from prefect.artifacts import create_progress_artifact


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from free-form parts."""
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts if p)


def progress_artifact(progress: float, key: str, description: str) -> UUID:
    """`create_progress_artifact` from a sync task: the new artifact's id, for `update_progress_artifact`.

    Prefect types the call `UUID | Coroutine` (called from async code it is `acreate_progress_artifact`'s
    coroutine); an async task awaits `acreate_progress_artifact` itself.
    """
    artifact_id = create_progress_artifact(progress=progress, key=key, description=description)
    if not isinstance(artifact_id, UUID):
        artifact_id.close()  # not awaited: no "never awaited" warning on top of the error
        raise TypeError(
            f"create_progress_artifact for {key!r} returned a coroutine: it runs in async code, "
            "which awaits acreate_progress_artifact instead"
        )
    return artifact_id
