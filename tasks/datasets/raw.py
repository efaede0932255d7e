"""What every file format's reader yields: one `Raw` per row (source, number, parsed value or parse error), and the
columns each row kind reads."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.datasets.errors import DatasetError

# Columns read from Parquet / Arrow per kind; anything else in the file is never read.
COLUMNS: dict[str, tuple[str, ...]] = {
    "generate": ("id", "messages", "prompt"),
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


def columns_for(path: Path, kind: str, names: list[str]) -> list[str]:
    """The needed columns present in the file; a file with no content column is a file error."""
    columns = [c for c in COLUMNS[kind] if c in names]
    if not set(columns) - {"id", "loss_mask"}:
        content = "'messages' or 'prompt'" if kind == "generate" else "'messages' or 'input_ids' + 'loss_mask'"
        raise DatasetError(
            path, None, f"has no {content} column (columns: {', '.join(names) or 'none'})", expected=EXPECTED[kind]
        )
    return columns
