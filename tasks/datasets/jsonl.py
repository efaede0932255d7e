"""The JSON Lines reader: one JSON object per line, UTF-8, decoded line by line so a bad byte names its line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

from tasks.datasets.raw import Raw
from tasks.datasets.rows import type_name

JSONL_EXPECTED = "expected JSON Lines: one JSON object per line, UTF-8"


def read_jsonl(path: Path) -> Iterator[Raw]:
    # Bytes, decoded per line: one bad byte sequence is reported with its line number, and
    # only b"\n" splits lines (str splitting would also break at U+2028 and friends).
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield Raw(
                    path,
                    lineno,
                    "line",
                    error=f"not valid UTF-8 (byte 0x{line[e.start]:02x} at byte {e.start + 1} of the line)",
                    expected=JSONL_EXPECTED,
                    line=line.decode("utf-8", "replace").rstrip("\r\n"),
                )
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            text = text.rstrip("\r\n")
            try:
                data = json.loads(text)
            except json.JSONDecodeError as e:
                error = f"invalid JSON ({e.msg} at column {e.colno})"
                if lineno == 1 and text.lstrip().startswith("["):
                    error += "; the file looks like one JSON array, but this reader takes JSON Lines"
                yield Raw(path, lineno, "line", error=error, expected=JSONL_EXPECTED, line=text)
                continue
            if not isinstance(data, dict):
                yield Raw(
                    path,
                    lineno,
                    "line",
                    error=f"expected a JSON object, got {type_name(data)}",
                    line=text,
                )
                continue
            yield Raw(path, lineno, "line", data=data, line=text)
