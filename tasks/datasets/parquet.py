"""The Parquet reader: only the columns the dataset's row format needs, batch by batch."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.datasets.errors import DatasetError
from tasks.datasets.raw import ACCEPTED_FORMATS, Raw, SelectColumns

_BATCH_ROWS = 256  # rows parsed at a time: a reader holds one batch of Python rows (long records: ~70 B per token)


def read_parquet(path: Path, select: SelectColumns) -> Iterator[Raw]:
    """Rows of one Parquet file; the footer and columns are checked before the first row."""
    try:
        pf = pq.ParquetFile(path)
        schema = pf.schema_arrow
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(path, None, f"not a readable Parquet file ({e})", expected=ACCEPTED_FORMATS) from None
    return _parquet_rows(path, pf, select(path, schema))


def _parquet_rows(path: Path, pf: pq.ParquetFile, columns: list[str]) -> Iterator[Raw]:
    row = 0
    for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
        for data in batch.to_pylist():
            row += 1
            yield Raw(path, row, "row", data=data)
