"""Format auto: which row format a dataset is in, from its columns (Parquet, Arrow) or its first row (JSONL).

The keys looked at are a column reader's columns, or a JSONL row's keys that are not null. A dataset fits
- messages: with `messages`, or `prompt` (generate), or `input_ids` / `loss_mask` (passthrough);
- sharegpt: with `conversations`;
- ultrachat: with `data` holding a list of strings;
- alpaca: with `instruction`;
- glaive: with `system` and `chat` (glaive-function-calling-v2);
- columns: with a known pair of prompt and response columns (KNOWN_COLUMNS, first match): problem + solution
  (Magicoder-OSS-Instruct), problem + generated_solution (OpenMathInstruct-2), question + generated_solution
  (OpenMathInstruct-1), input + output without an instruction (OpenCodeInstruct).
Keys that fit none, or more than one, are refused with the keys and the config line that reads them. The first row
that fits decides for the whole dataset (`Resolver`); a later row of another shape is a bad row of that format.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa

from settings.dataset import RowFormat
from tasks.datasets.errors import DatasetError
from tasks.datasets.formats import Shape
from tasks.datasets.raw import EXPECTED
from tasks.datasets.rows import BadRow, Kind

KNOWN_COLUMNS = (
    ("problem", "solution"),
    ("problem", "generated_solution"),
    ("question", "generated_solution"),
    ("input", "output"),
)
MESSAGES_KEYS = {"generate": ("messages", "prompt"), "passthrough": ("messages", "input_ids", "loss_mask")}
# Column names a prompt or a response often has, for the hint of a shape that fits no format (first match wins).
PROMPT_NAMES = ("prompt", "problem", "question", "query", "instruction", "input", "user", "text")
RESPONSE_NAMES = (
    "response",
    "solution",
    "generated_solution",
    "answer",
    "output",
    "completion",
    "assistant",
    "chosen",
    "target",
)
SYSTEM_NAMES = ("system", "system_prompt")
FORMATS_DOC = (
    "row formats: messages, sharegpt, alpaca, columns, ultrachat, glaive (docs/run-a-pipeline.md#row-formats: the "
    "config lines of each)"
)


def detect(
    kind: Kind, keys: Sequence[str], strings: Callable[[str], bool], fmt: RowFormat, *, what: str = "keys"
) -> Shape:
    """The one format `keys` fit (`strings(key)`: whether that key holds a list of strings); BadRow with the hint if
    they fit none or several. `what` names the keys in the error (keys of a row, columns of a file)."""
    present = set(keys)
    found: list[Shape] = []
    if present & set(MESSAGES_KEYS[kind]):
        found.append(Shape.of(fmt, "messages"))
    if "conversations" in present:
        found.append(Shape.of(fmt, "sharegpt"))
    if "data" in present and strings("data"):
        found.append(Shape.of(fmt, "ultrachat"))
    if "instruction" in present:
        found.append(Shape.of(fmt, "alpaca"))
    if "chat" in present and "system" in present:
        found.append(Shape.of(fmt, "glaive"))
    for prompt, response in KNOWN_COLUMNS:
        if prompt in present and response in present and not (prompt == "input" and "instruction" in present):
            found.append(Shape.of(fmt, "columns", prompt_field=prompt, response_field=response))
            break
    if len(found) == 1:
        return found[0]
    # The config line is part of the reason: it reaches the rejects and `eagle3 validate`, which keep no `expected`.
    shown = f"has {what} [{', '.join(map(str, keys))}]" if keys else f"has no {what}"
    if not found:
        raise BadRow(
            f"{shown}, which fit no row format; set {hint(kind, keys)} in the dataset's config", expected=FORMATS_DOC
        )
    lines = " or ".join(config_line(shape) for shape in found)
    raise BadRow(
        f"{shown}, which fit more than one row format ({', '.join(s.format for s in found)}); set {lines} in "
        "the dataset's config",
        expected=FORMATS_DOC,
    )


def config_line(shape: Shape) -> str:
    """The config keys that select `shape`: `format: columns, prompt_field: problem, response_field: solution`."""
    line = f"format: {shape.format}"
    for key in ("prompt_field", "response_field", "system_field"):
        if getattr(shape, key):
            line += f", {key}: {getattr(shape, key)}"
    return line


def hint(kind: str, keys: Sequence[str]) -> str:
    """The config line that would read rows with `keys`, guessed from the names of their columns (else placeholders)."""
    by_name = {str(k).lower(): str(k) for k in keys}
    prompt = next((by_name[n] for n in PROMPT_NAMES if n in by_name), None)
    response = next((by_name[n] for n in RESPONSE_NAMES if n in by_name and by_name[n] != prompt), None)
    system = next((by_name[n] for n in SYSTEM_NAMES if n in by_name), None)
    line = f"format: columns, prompt_field: {prompt or 'COLUMN'}"
    if response or kind == "passthrough":
        line += f", response_field: {response or 'COLUMN'}"
    if system:
        line += f", system_field: {system}"
    return line


class Resolver:
    """One dataset's row format while it is read: the configured one, or auto's pick, made once and kept."""

    def __init__(self, kind: Kind, fmt: RowFormat) -> None:
        self.kind = kind
        self.fmt = fmt
        self.shape: Shape | None = None if fmt.format == "auto" else Shape.of(fmt)

    def columns(self, source: Path, schema: pa.Schema) -> list[str]:
        """The columns a column reader reads (raw.SelectColumns); auto detects from the schema (a file error if none
        fits)."""
        if self.shape is None:
            try:
                self.shape = detect(
                    self.kind, schema.names, lambda n: _string_list(schema.field(n).type), self.fmt, what="columns"
                )
            except BadRow as bad:
                raise DatasetError(source, None, bad.reason, expected=bad.expected) from None
        return self.shape.columns(source, self.kind, schema)

    def canonical(self, data: dict) -> dict:
        """`data` as the canonical row; auto detects from the first row that fits a format. BadRow if it can't."""
        if self.shape is None:
            keys = [k for k, v in data.items() if v is not None]
            self.shape = detect(self.kind, keys, lambda k: _strings(data[k]), self.fmt)
        return self.shape.convert(data, self.kind)

    def expected(self) -> str:
        """What a row looks like, for errors that carry no hint of their own."""
        return self.shape.expected(self.kind) if self.shape is not None else EXPECTED[self.kind]


def _strings(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _string_list(type_: pa.DataType) -> bool:
    list_type = pa.types.is_list(type_) or pa.types.is_large_list(type_)
    return list_type and (pa.types.is_string(type_.value_type) or pa.types.is_large_string(type_.value_type))
