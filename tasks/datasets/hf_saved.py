"""The reader of a `datasets` save_to_disk directory (state.json + data-*.arrow), with pyarrow alone; a DatasetDict
contributes its "train" split."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa

from tasks.datasets.errors import DatasetError
from tasks.datasets.raw import ACCEPTED_FORMATS, Raw, SelectColumns


def read_hf_saved(directory: Path, select: SelectColumns) -> Iterator[Raw]:
    """Rows of a `Dataset.save_to_disk` directory, numbered across its data files."""
    try:
        state = json.loads((directory / "state.json").read_text(encoding="utf-8"))
        files = [directory / f["filename"] for f in state.get("_data_files") or []]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise DatasetError(directory, None, f"state.json is not a datasets state file ({e})") from None
    files = files or sorted(directory.glob("data-*.arrow"))
    if not files:
        raise DatasetError(directory, None, "has state.json but no data-*.arrow files", expected=ACCEPTED_FORMATS)
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise DatasetError(directory, None, f"state.json lists data files that are missing: {', '.join(missing)}")
    # Column check before the first row, like the other readers.
    columns = select(directory, _arrow_schema(files[0]))
    return _hf_rows(directory, files, columns)


def _hf_rows(directory: Path, files: list[Path], columns: list[str]) -> Iterator[Raw]:
    row = 0
    for file in files:
        for batch in _arrow_batches(file):
            for data in batch.select(columns).to_pylist():
                row += 1
                yield Raw(directory, row, "row", data=data)


def _arrow_schema(file: Path) -> pa.Schema:
    with pa.memory_map(str(file)) as source:
        try:
            return pa.ipc.open_stream(source).schema
        except pa.ArrowInvalid:
            source.seek(0)
            return pa.ipc.open_file(source).schema


def _arrow_batches(file: Path) -> Iterator[pa.RecordBatch]:
    # save_to_disk writes the IPC stream format; accept the file format too. Memory-mapped,
    # so selecting columns does not read the others.
    with pa.memory_map(str(file)) as source:
        try:
            reader = pa.ipc.open_stream(source)
        except pa.ArrowInvalid:
            source.seek(0)
            file_reader = pa.ipc.open_file(source)
            for i in range(file_reader.num_record_batches):
                yield file_reader.get_batch(i)
            return
        yield from reader


def train_split(directory: Path) -> Path:
    try:
        splits = json.loads((directory / "dataset_dict.json").read_text(encoding="utf-8"))["splits"]
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(directory, None, f"dataset_dict.json has no 'splits' list ({e})") from None
    if "train" not in splits:
        example = directory / str(splits[0]) if splits else directory / "SPLIT"
        raise DatasetError(
            directory,
            None,
            f"is a DatasetDict without a 'train' split (splits: {', '.join(map(str, splits)) or 'none'})",
            expected=f"point datasets[i].path at one split directory, e.g. {example}",
        )
    return directory / "train"
