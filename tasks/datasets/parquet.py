"""The Parquet reader: only the columns a row kind needs, batch by batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.datasets.errors import DatasetError
from tasks.datasets.raw import ACCEPTED_FORMATS, Raw, columns_for

_BATCH_ROWS = 1024


def read_parquet(path: Path, kind: str) -> Iterator[Raw]:
    """Rows of one Parquet file; the footer and columns are checked before the first row."""
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(path, None, f"not a readable Parquet file ({e})", expected=ACCEPTED_FORMATS) from None
    return _parquet_rows(path, pf, columns_for(path, kind, names))


def _parquet_rows(path: Path, pf: pq.ParquetFile, columns: list[str]) -> Iterator[Raw]:
    row = 0
    for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
        for data in batch.to_pylist():
            row += 1
            yield Raw(path, row, "row", data=data)
