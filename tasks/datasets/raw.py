"""What every file format's reader yields: one `Raw` per row (source, number, parsed value or parse error), the fields
of the canonical row per kind, and how a column reader is told which columns to read."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

# The fields of the canonical row per kind (format messages); a column reader reads only the fields of the dataset's
# format (tasks/datasets/formats.py: Shape.columns) and never the rest of the file.
COLUMNS: dict[str, tuple[str, ...]] = {
    "generate": ("id", "messages", "prompt", "tools"),
    "passthrough": ("id", "messages", "input_ids", "loss_mask"),
}
# What each kind expects, appended to every row error.
EXPECTED: dict[str, str] = {
    "generate": "each row needs 'messages' [{role, content}] or 'prompt' (string)",
    "passthrough": (
        "each row needs 'messages' [{role, content}] with an assistant turn,"
        " or 'input_ids' + 'loss_mask' (lists of ints)"
    ),
}
ACCEPTED_FORMATS = (
    "accepted: a .jsonl/.json file (one JSON object per line), a .parquet file, a directory of"
    " *.parquet files, or a directory written by datasets' save_to_disk"
    " (state.json + data-*.arrow, or a DatasetDict with a 'train' split)"
)


@dataclass(slots=True)
class Raw:
    source: Path
    row: int
    unit: str  # "line" (JSONL) or "row"
    data: Any = None
    error: str | None = None  # why the row could not be parsed; data is then None
    expected: str | None = None  # what a parseable row looks like, for parse errors
    line: str | None = None  # the original text (JSONL)

    def text(self) -> str:
        if self.line is not None:
            return self.line
        return json.dumps(self.data, ensure_ascii=False, default=str)


# What a column reader asks before its first row: the columns to read, given the file and its schema (the dataset's row
# format picks them, and detects itself from the schema under `format: auto`; tasks/datasets/detect.py).
SelectColumns = Callable[[Path, pa.Schema], list[str]]
