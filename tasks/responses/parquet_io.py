"""Atomic Parquet parts: the on-disk unit every stage checkpoints in.

A stage directory holds `part-000000.parquet`, `part-000001.parquet`, ... Each part is written
to a hidden temporary name in the same directory, fsynced, renamed into place and the directory
fsynced, so a reader (or a resumed run) sees either a complete part or none at all. Temporary
names start with `.` and end with `.tmp`; `list_parts` never returns them.

One writer per directory: part numbers are taken from what is on disk, so two processes writing
the same directory at once could pick the same number.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from models.common.atomic import TMP_SUFFIX, atomic_file
from models.common.file_errors import DamagedFile

PART_SUFFIX = ".parquet"
# Zero padding keeps names in lexical order up to a million parts per directory.
PART_DIGITS = 6


def write_parquet_atomic(
    table: pa.Table,
    path: Path,
    metadata: Mapping[str, Any] | None = None,
    **write_options: Any,
) -> Path:
    """Write `table` to `path` so that readers see the whole file or nothing; return `path`.

    `metadata` is merged into the schema metadata (keys and values stored as str), where
    `read_metadata` finds it without reading any rows. `write_options` go to `pq.write_table`.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if metadata:
        merged = dict(table.schema.metadata or {})
        merged.update({str(k).encode(): str(v).encode() for k, v in metadata.items()})
        table = table.replace_schema_metadata(merged)

    # A kill -9 can leave the temp file behind: readers ignore it, `clean_stale_temps` removes it.
    with atomic_file(path, "wb") as f:
        pq.write_table(table, f, **write_options)
    return path


class StreamedPart:
    """A Parquet file being written one row group at a time (`parquet_atomic_writer`); `metadata` set before the
    block ends goes into the footer."""

    def __init__(self, writer: pq.ParquetWriter) -> None:
        self.writer = writer
        self.metadata: dict[str, Any] = {}
        self.rows = 0

    def write(self, table: pa.Table) -> None:
        """One row group (nothing for an empty table)."""
        if table.num_rows:
            self.writer.write_table(table)
            self.rows += table.num_rows


@contextmanager
def parquet_atomic_writer(path: Path, schema: pa.Schema) -> Iterator[StreamedPart]:
    """`write_parquet_atomic` for a file written in row groups, so that the writer holds one group, not the file.

    Readers see the whole file or nothing; on an error in the block the temp file goes and `path` is untouched. The
    metadata is stored as the footer's key-value metadata, where `read_metadata` finds it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_file(path, "wb") as f:
        part = StreamedPart(pq.ParquetWriter(f, schema))
        try:
            yield part
            if part.metadata:
                part.writer.add_key_value_metadata({str(k): str(v) for k, v in part.metadata.items()})
        finally:
            part.writer.close()  # on an error too: the temp file it ends is then removed


def next_part_path(directory: Path, prefix: str = "part") -> Path:
    """The next free part name in `directory`: one past the highest existing number."""
    numbers = [n for n, _ in _numbered_parts(Path(directory), prefix)]
    n = max(numbers) + 1 if numbers else 0
    return Path(directory) / f"{prefix}-{n:0{PART_DIGITS}d}{PART_SUFFIX}"


def list_parts(directory: Path, prefix: str = "part") -> list[Path]:
    """Complete parts in `directory`, in part-number order; [] if the directory is missing."""
    return [p for _, p in sorted(_numbered_parts(Path(directory), prefix))]


class DamagedPart(DamagedFile):
    """A Parquet part on disk that cannot be read: names the file, what is wrong, and what to do."""


@contextmanager
def reading(path: Path) -> Iterator[None]:
    """pyarrow's verdict that `path` is not a readable Parquet file becomes DamagedPart naming it.

    Errors of the OS itself (a missing file: a compaction may have just replaced it; permission;
    I/O) pass through unchanged.
    """
    try:
        yield
    except (pa.ArrowException, OSError) as exc:
        if isinstance(exc, OSError) and exc.errno is not None and not isinstance(exc, pa.ArrowException):
            raise  # the OS refused the read (missing, permission, I/O): that error names the file itself
        path = Path(path)
        size = path.stat().st_size if path.exists() else 0
        first = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise DamagedPart(path, f"{size:,} bytes, not a readable Parquet file: {first}") from None


def read_metadata(path: Path) -> dict[str, str]:
    """The metadata of a Parquet file, read from the footer only (no row data); DamagedPart if unreadable.

    The footer's key-value metadata: the schema metadata `write_parquet_atomic` stores is there too (pyarrow writes
    it as both), and so is what `parquet_atomic_writer` adds once its rows are written."""
    with reading(path):
        raw = pq.read_metadata(path).metadata or {}
    return {k.decode("utf-8", "replace"): v.decode("utf-8", "replace") for k, v in raw.items() if k != b"ARROW:schema"}


def clean_stale_temps(directory: Path, older_than_s: float = 0.0) -> list[Path]:
    """Delete temp files left by interrupted writes; return what was removed.

    Call it before a writer starts on `directory` (one writer per directory), or pass
    `older_than_s` to spare temp files a live writer may still be filling.
    """
    directory = Path(directory)
    if not directory.is_dir():
        return []
    now = time.time()
    removed = []
    for p in directory.iterdir():
        if not (p.name.startswith(".") and p.name.endswith(TMP_SUFFIX) and p.is_file()):
            continue
        try:
            if older_than_s and now - p.stat().st_mtime < older_than_s:
                continue
            p.unlink()
        except FileNotFoundError:
            continue
        removed.append(p)
    return removed


def _numbered_parts(directory: Path, prefix: str) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    pattern = re.compile(rf"^{re.escape(prefix)}-(\d+){re.escape(PART_SUFFIX)}$")
    found = []
    for p in directory.iterdir():
        m = pattern.match(p.name)
        if m and p.is_file():
            found.append((int(m.group(1)), p))
    return found
