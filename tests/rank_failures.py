"""Failures of a rank that the tests of the rank protocol and of the launcher both report."""

from __future__ import annotations

import errno
from pathlib import Path

from models.common.file_errors import WriteFailed


def shard_write_failed(directory: Path) -> WriteFailed:
    """A capture rank's disk filled while it wrote directory/shard-001-000004.safetensors."""
    return WriteFailed(
        directory / "shard-001-000004.safetensors",
        OSError(errno.ENOSPC, "No space left on device"),
        kept="every complete shard",
        resume="make room there",
    )
