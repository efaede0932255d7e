"""Load prompt and passthrough datasets from JSONL, Parquet or a saved Hugging Face dataset.

Accepted inputs (chosen by path):
- `*.jsonl` / `*.json`: JSON Lines, one object per line, UTF-8. Whitespace-only lines are skipped.
- `*.parquet`: one Parquet file; only the columns a row kind needs are read, batch by batch.
- a directory of `*.parquet` files (top level only, name order; names starting with `.` or `_`
  are ignored).
- a directory written by `datasets.Dataset.save_to_disk` (state.json + data-*.arrow in Arrow
  IPC stream format), read with pyarrow alone; a `DatasetDict` directory (dataset_dict.json)
  contributes its "train" split.

Row kinds:
- generate: optional `id` (string or int), and either `messages` (non-empty list of
  {role: system|user|assistant, content: str}, ending with a user turn) or `prompt` (a non-empty
  string, which becomes one user message). Not both.
- passthrough: optional `id`, and either `messages` with at least one assistant turn (roles
  system|user|assistant|tool: agentic transcripts carry tool results), or `input_ids`
  (non-negative ints) + `loss_mask` (0/1 or bools, same length, at least one 1).

Message content must be a non-empty string, except that `tool` turns and assistant turns carrying
`tool_calls` or `reasoning_content` may have empty content. Keys besides role/content (name,
tool_calls, reasoning_content, ...) are kept when not null; nulls are dropped, because Arrow
fills keys a row lacks with null and the same row must look the same in every format.

A row without `id` gets `stable_id` of its content: generate rows hash {"messages": [...]} (a
`prompt` row hashes as its one user message, so both spellings of a prompt share an id);
passthrough rows hash {"messages": [...]} or {"input_ids": [...], "loss_mask": [0/1 ...]}.

Ids are strings: an int id 7 becomes "7". Each id names one row. A repeat with the same content
(the same messages, or input_ids + loss_mask; other keys are ignored) is a duplicate: dropped and
counted. A repeat with different content, or an int id meeting the same id as a string (7 and "7"),
is a bad row naming both rows; the first occurrence is kept.

Bad rows raise `DatasetError` naming the file, the line (JSONL) or row (1-based), what is wrong
and what is expected; with `on_bad_row="skip"` they become `Reject`s and loading goes on. A
dataset with no usable row left raises `EmptyDatasetError`.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import pyarrow as pa
import pyarrow.parquet as pq


log = logging.getLogger("eagle3.datasets")

Kind = Literal["generate", "passthrough"]
OnBadRow = Literal["fail", "skip"]

GENERATE_ROLES = ("system", "user", "assistant")
PASSTHROUGH_ROLES = ("system", "user", "assistant", "tool")

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
JSONL_EXPECTED = "expected JSON Lines: one JSON object per line, UTF-8"
REPEATED_ID_FIX = (
    "ids must be unique within a dataset: give one of the two rows another id (or remove its id to"
    " get a content hash), or delete the repeat; with on_bad_row: skip the first row is kept and"
    " the repeat goes to rejects"
)
ACCEPTED_FORMATS = (
    "accepted: a .jsonl/.json file (one JSON object per line), a .parquet file, a directory of"
    " *.parquet files, or a directory written by datasets' save_to_disk"
    " (state.json + data-*.arrow, or a DatasetDict with a 'train' split)"
)
_BATCH_ROWS = 1024


# ---------------------------------------------------------------------------------------------
# Public types


class DatasetError(ValueError):
    """A dataset that cannot be read, or one bad row: names the file, the line/row and the fix.

    `path` is the file (or dataset directory) at fault, `row` the 1-based line number for JSONL
    and 1-based row number otherwise (None for file-level problems), `reason` what is wrong.
    """

    def __init__(
        self,
        path: Path | str,
        row: int | None,
        reason: str,
        *,
        expected: str | None = None,
        unit: str = "row",
    ) -> None:
        self.path = Path(path)
        self.row = row
        self.reason = reason
        self.expected = expected
        self.unit = unit
        where = f"{path}" if row is None else f"{path} {unit} {row}"
        message = f"{where}: {reason}"
        if expected:
            message += f" — {expected}"
        super().__init__(message)

    def __str__(self) -> str:
        # OSError (for DatasetNotFoundError) would otherwise format its own way.
        return self.args[0]

    def __reduce__(self):
        return (_rebuild_error, (type(self), self.path, self.row, self.reason, self.expected, self.unit))


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The configured dataset path does not exist."""


class EmptyDatasetError(DatasetError):
    """A dataset with no usable row: no rows at all, or every row bad (under on_bad_row="skip").

    `rejects` holds the bad rows, so that `eagle3 validate` can list them (empty after pickling).
    """

    rejects: tuple[Reject, ...] = ()


def _rebuild_error(cls, path, row, reason, expected, unit):
    return cls(path, row, reason, expected=expected, unit=unit)


@dataclass(slots=True)
class PromptRow:
    """A prompt to send to the target: the conversation so far, ending with a user turn."""

    id: str
    messages: list[dict]


@dataclass(slots=True)
class PassthroughRow:
    """A finished example: either a conversation with assistant turns, or token ids + mask."""

    id: str
    messages: list[dict] | None = None
    input_ids: list[int] | None = None
    loss_mask: list[int] | None = None


@dataclass(slots=True)
class Reject:
    """A row skipped under on_bad_row="skip": where it was, its id if it had one, and why."""

    path: Path
    row: int
    id: str | None
    reason: str
    raw: str
    cause: str | None = None  # tasks.rejects.CAUSES; None: derived from the stage and reason

    @property
    def location(self) -> str:
        """`file line N` for JSON Lines, `file row N` otherwise, as DatasetError says it."""
        unit = "line" if Path(self.path).suffix in (".jsonl", ".json") else "row"
        return f"{self.path} {unit} {self.row}"


@dataclass
class LoadedDataset:
    """Valid rows (first occurrence of each id), the rejects, and how many duplicates were dropped."""

    rows: list[PromptRow] | list[PassthroughRow]
    rejects: list[Reject]
    duplicates: int
    path: Path


# ---------------------------------------------------------------------------------------------
# Public functions


def stable_id(content: Mapping[str, Any]) -> str:
    """First 16 hex chars of sha256 over the canonical JSON of a row's content fields."""
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    # surrogatepass: never crash on a lone surrogate hiding in an extra message key.
    return hashlib.sha256(canonical.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def iter_rows(path: Path | str, kind: Kind) -> Iterator[tuple[int, dict]]:
    """Raw rows with the number errors use for them (JSONL line, else row; per file in a directory).

    Raises DatasetError for a row that cannot be parsed into a JSON object; does not validate
    fields (`load_dataset` does). Format and existence are checked before the first row.
    """
    _check_kind(kind)
    return _parsed_rows(_open(Path(path), kind), kind)


def _parsed_rows(raws: Iterator[_Raw], kind: str) -> Iterator[tuple[int, dict]]:
    for raw in raws:
        if raw.error is not None:
            expected = raw.expected or EXPECTED[kind]
            raise DatasetError(raw.source, raw.row, raw.error, expected=expected, unit=raw.unit)
        yield raw.row, raw.data


def load_dataset(
    path: Path | str, kind: Kind, *, on_bad_row: OnBadRow = "fail"
) -> LoadedDataset:
    """Read and validate every row; the first occurrence of each id wins.

    on_bad_row="fail" raises DatasetError on the first bad row; "skip" records a Reject and goes
    on. A repeated id is a bad row unless the repeat has the same content (and the id the same
    type): such duplicates are dropped, counted, and reported in one warning on `eagle3.datasets`.
    Raises EmptyDatasetError when no usable row is left.
    """
    _check_kind(kind)
    if on_bad_row not in ("fail", "skip"):
        raise ValueError(f"on_bad_row must be 'fail' or 'skip', got {on_bad_row!r}")
    path = Path(path)
    build = _BUILDERS[kind]
    rows: list = []
    rejects: list[Reject] = []
    # id -> (index in rows, source, row number, whether the id was given as an int): enough to
    # compare a repeat with its first occurrence and to name both.
    seen: dict[str, tuple[int, Path, int, bool]] = {}
    duplicates = 0
    first_duplicate: tuple[str, Path, int] | None = None

    for raw in _open(path, kind):
        try:
            if raw.error is not None:
                raise BadRow(raw.error, raw.expected)
            row = build(raw.data)
        except BadRow as bad:
            if on_bad_row == "fail":
                raise DatasetError(
                    raw.source, raw.row, bad.reason, expected=bad.expected or EXPECTED[kind], unit=raw.unit
                ) from None
            rejects.append(Reject(raw.source, raw.row, _loose_id(raw.data), bad.reason, raw.text()))
            continue
        int_id = type(raw.data.get("id")) is int
        first = seen.get(row.id)
        if first is None:
            seen[row.id] = (len(rows), raw.source, raw.row, int_id)
            rows.append(row)
            continue
        conflict = _repeat_conflict(row, int_id, rows[first[0]], first, raw.source)
        if conflict is None:
            duplicates += 1
            if first_duplicate is None:
                first_duplicate = (row.id, raw.source, raw.row)
            continue
        if on_bad_row == "fail":
            raise DatasetError(raw.source, raw.row, conflict, expected=REPEATED_ID_FIX, unit=raw.unit)
        rejects.append(Reject(raw.source, raw.row, _utf8(row.id), conflict, raw.text()))

    if not rows:  # before the warnings: the error says it all
        raise _empty_dataset(path, rejects)
    if duplicates:
        dup_id, dup_source, dup_row = first_duplicate
        log.warning(
            "%s: dropped %d row(s) that repeat an earlier row's id and content (the first occurrence is kept);"
            " first repeat: id %r at %s %s %d",
            path, duplicates, dup_id, dup_source, "line" if _is_jsonl(dup_source) else "row", dup_row,
        )
    if rejects:
        first = rejects[0]
        log.warning(
            "%s: skipped %d bad row(s) (on_bad_row=skip); first: %s %s %d: %s",
            path, len(rejects), first.path, "line" if _is_jsonl(first.path) else "row", first.row, first.reason,
        )
    return LoadedDataset(rows=rows, rejects=rejects, duplicates=duplicates, path=path)


def _repeat_conflict(
    row: PromptRow | PassthroughRow, int_id: bool, first_row: Any, first: tuple[int, Path, int, bool], source: Path
) -> str | None:
    """Why a row whose id was seen before is bad, or None when it is a plain duplicate."""
    _, first_source, first_number, first_int = first
    where = f"{'line' if _is_jsonl(first_source) else 'row'} {first_number}"
    if first_source != source:
        where = f"{first_source} {where}"
    if int_id != first_int:
        # str() made both "7": a file that mixes them means two different rows or a typo.
        quoted = json.dumps(row.id, ensure_ascii=False)
        shown, first_shown = (row.id, quoted) if int_id else (quoted, row.id)
        return (
            f"id {_utf8(shown)} collides with id {_utf8(first_shown)} at {where}: ids are compared as"
            " strings, so an int id and the same digits as a string are the same id"
        )
    if row != first_row:  # same id, so this compares the content
        return f"id {_utf8(row.id)!r} repeats {where} with different content"
    return None


def _empty_dataset(path: Path, rejects: list[Reject]) -> EmptyDatasetError:
    """The error for a dataset without a usable row: says whether it had rows at all."""
    if rejects:
        first = rejects[0]
        error = EmptyDatasetError(
            path,
            None,
            f"has no usable row: all {len(rejects)} row(s) are bad (first: {first.location}: {first.reason})",
            expected="fix the rows (`eagle3 validate CONFIG` lists them), or remove the dataset from the config",
        )
        error.rejects = tuple(rejects)
        return error
    return EmptyDatasetError(
        path,
        None,
        "has no rows",
        expected="a dataset needs at least one row: check that datasets[i].path names the right file,"
        " or remove the dataset from the config",
    )


# ---------------------------------------------------------------------------------------------
# Reading: every format becomes a stream of _Raw (source, number, parsed value or parse error)


@dataclass(slots=True)
class _Raw:
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


def _open(path: Path, kind: str) -> Iterator[_Raw]:
    """Pick the reader for `path`; format and existence errors raise here, not at first row."""
    if not path.exists():
        raise DatasetNotFoundError(
            path,
            None,
            "does not exist",
            expected=(
                "the dataset is the user's to provide: set datasets[i].path in the run config to an"
                " existing JSONL/Parquet file or dataset directory"
            ),
        )
    if path.is_file():
        suffix = path.suffix.lower()
        if suffix in (".jsonl", ".json"):
            return _iter_jsonl(path)
        if suffix == ".parquet":
            return _iter_parquet(path, kind)
        raise DatasetError(path, None, f"unsupported file type {suffix or '(no suffix)'!r}", expected=ACCEPTED_FORMATS)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return _open(_train_split(path), kind)
        if (path / "state.json").is_file():
            return _iter_hf_saved(path, kind)
        parts = sorted(
            p for p in path.glob("*.parquet") if p.is_file() and not p.name.startswith((".", "_"))
        )
        if parts:
            return _chain([_iter_parquet(p, kind) for p in parts])
        raise DatasetError(
            path, None, "directory has no *.parquet files and no state.json (save_to_disk)", expected=ACCEPTED_FORMATS
        )
    raise DatasetError(path, None, "is neither a file nor a directory", expected=ACCEPTED_FORMATS)


def _chain(readers) -> Iterator[_Raw]:
    for reader in readers:
        yield from reader


def _iter_jsonl(path: Path) -> Iterator[_Raw]:
    # Bytes, decoded per line: one bad byte sequence is reported with its line number, and
    # only b"\n" splits lines (str splitting would also break at U+2028 and friends).
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                text = line.decode("utf-8")
            except UnicodeDecodeError as e:
                yield _Raw(
                    path, lineno, "line",
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
                yield _Raw(path, lineno, "line", error=error, expected=JSONL_EXPECTED, line=text)
                continue
            if not isinstance(data, dict):
                yield _Raw(
                    path, lineno, "line",
                    error=f"expected a JSON object, got {_type_name(data)}",
                    line=text,
                )
                continue
            yield _Raw(path, lineno, "line", data=data, line=text)


def _iter_parquet(path: Path, kind: str) -> Iterator[_Raw]:
    """Rows of one Parquet file; the footer and columns are checked before the first row."""
    try:
        pf = pq.ParquetFile(path)
        names = pf.schema_arrow.names
    except (pa.ArrowException, OSError) as e:
        raise DatasetError(path, None, f"not a readable Parquet file ({e})", expected=ACCEPTED_FORMATS) from None
    return _parquet_rows(path, pf, _columns_for(path, kind, names))


def _parquet_rows(path: Path, pf: pq.ParquetFile, columns: list[str]) -> Iterator[_Raw]:
    row = 0
    for batch in pf.iter_batches(batch_size=_BATCH_ROWS, columns=columns):
        for data in batch.to_pylist():
            row += 1
            yield _Raw(path, row, "row", data=data)


def _iter_hf_saved(directory: Path, kind: str) -> Iterator[_Raw]:
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
    columns = _columns_for(directory, kind, _arrow_schema(files[0]).names)
    return _hf_rows(directory, files, columns)


def _hf_rows(directory: Path, files: list[Path], columns: list[str]) -> Iterator[_Raw]:
    row = 0
    for file in files:
        for batch in _arrow_batches(file):
            for data in batch.select(columns).to_pylist():
                row += 1
                yield _Raw(directory, row, "row", data=data)


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


def _train_split(directory: Path) -> Path:
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


def _columns_for(path: Path, kind: str, names: list[str]) -> list[str]:
    """The needed columns present in the file; a file with no content column is a file error."""
    columns = [c for c in COLUMNS[kind] if c in names]
    if not set(columns) - {"id", "loss_mask"}:
        content = "'messages' or 'prompt'" if kind == "generate" else "'messages' or 'input_ids' + 'loss_mask'"
        raise DatasetError(
            path, None, f"has no {content} column (columns: {', '.join(names) or 'none'})", expected=EXPECTED[kind]
        )
    return columns


# ---------------------------------------------------------------------------------------------
# Validation: a parsed row becomes a PromptRow / PassthroughRow, or raises BadRow(reason)


class BadRow(Exception):
    """One row is not valid: why, and what a valid row looks like (the loader adds the file and row)."""

    def __init__(self, reason: str, expected: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.expected = expected


def build_prompt(data: dict) -> PromptRow:
    """A prompt row from a parsed object (normalised messages, stable id); BadRow if it is not one."""
    messages, prompt = data.get("messages"), data.get("prompt")
    if messages is not None and prompt is not None:
        raise BadRow("has both 'messages' and 'prompt'; give one")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise BadRow(f"'prompt' must be a string, got {_type_name(prompt)}")
        if not prompt.strip():
            raise BadRow("'prompt' is empty")
        _check_unicode(prompt, "'prompt'")
        messages = [{"role": "user", "content": prompt}]
    elif messages is not None:
        messages = _messages(messages, GENERATE_ROLES)
        if messages[-1]["role"] != "user":
            raise BadRow(
                f"'messages' must end with a user turn (the prompt to answer), got {messages[-1]['role']!r} last"
            )
    else:
        raise BadRow(f"missing 'messages' or 'prompt'{_keys_note(data)}")
    row_id = _given_id(data)
    return PromptRow(id=row_id if row_id is not None else stable_id({"messages": messages}), messages=messages)


def build_passthrough(data: dict) -> PassthroughRow:
    """A passthrough row from a parsed object (messages, or input_ids + loss_mask); BadRow if it is not one."""
    has_messages = data.get("messages") is not None
    has_ids = data.get("input_ids") is not None
    has_mask = data.get("loss_mask") is not None
    if has_messages and (has_ids or has_mask):
        raise BadRow("has both 'messages' and 'input_ids'/'loss_mask'; give one")
    if has_messages:
        messages = _messages(data["messages"], PASSTHROUGH_ROLES)
        if not any(m["role"] == "assistant" for m in messages):
            raise BadRow("'messages' has no assistant turn; a passthrough row must already hold the response")
        row_id = _given_id(data)
        return PassthroughRow(
            id=row_id if row_id is not None else stable_id({"messages": messages}), messages=messages
        )
    if not has_ids and not has_mask:
        raise BadRow(f"missing 'messages' or 'input_ids' + 'loss_mask'{_keys_note(data)}")
    if not has_ids:
        raise BadRow("'input_ids' is missing; a 'loss_mask' needs the token ids it masks")
    if not has_mask:
        raise BadRow("'loss_mask' is missing; 'input_ids' needs a 'loss_mask' of the same length (1 = train on it)")
    input_ids = _token_ids(data["input_ids"])
    loss_mask = _loss_mask(data["loss_mask"], len(input_ids))
    row_id = _given_id(data)
    if row_id is None:
        row_id = stable_id({"input_ids": input_ids, "loss_mask": loss_mask})
    return PassthroughRow(id=row_id, input_ids=input_ids, loss_mask=loss_mask)


_BUILDERS: dict[str, Callable[[dict], Any]] = {"generate": build_prompt, "passthrough": build_passthrough}


def _messages(value: Any, roles: tuple[str, ...]) -> list[dict]:
    if not isinstance(value, list):
        raise BadRow(f"'messages' must be a list of {{role, content}} objects, got {_type_name(value)}")
    if not value:
        raise BadRow("'messages' is empty")
    out = []
    for i, m in enumerate(value):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise BadRow(f"'{where}' must be an object {{role, content}}, got {_type_name(m)}")
        role = _string_key(m, where, "role")
        if role not in roles:
            raise BadRow(f"'{where}.role' must be one of {', '.join(roles)}, got {role!r}")
        content = _string_key(m, where, "content")
        empty_ok = role == "tool" or (role == "assistant" and bool(m.get("tool_calls") or m.get("reasoning_content")))
        if not empty_ok and not content.strip():
            raise BadRow(f"'{where}.content' is empty")
        _check_unicode(content, f"'{where}.content'")
        message = {"role": role, "content": content}
        message.update((k, v) for k, v in m.items() if k not in message and v is not None)
        out.append(message)
    return out


def _string_key(message: dict, where: str, key: str) -> str:
    """`message[key]`, which must be there and be a string."""
    if key not in message:
        raise BadRow(f"'{where}.{key}' is missing")
    value = message[key]
    if not isinstance(value, str):
        raise BadRow(f"'{where}.{key}' must be a string, got {_type_name(value)}")
    return value


def _token_ids(value: Any) -> list[int]:
    if not isinstance(value, list):
        raise BadRow(f"'input_ids' must be a list of ints, got {_type_name(value)}")
    if not value:
        raise BadRow("'input_ids' is empty")
    # set(map(type, ...)) and min() run in C: these lists can be 100k tokens long.
    if set(map(type, value)) != {int}:
        i = next(i for i, x in enumerate(value) if type(x) is not int)
        raise BadRow(f"'input_ids[{i}]' must be a non-negative int, got {_type_name(value[i])}")
    if min(value) < 0:
        i = next(i for i, x in enumerate(value) if x < 0)
        raise BadRow(f"'input_ids[{i}]' must be a non-negative int, got {value[i]}")
    return value


def _loss_mask(value: Any, length: int) -> list[int]:
    if not isinstance(value, list):
        raise BadRow(f"'loss_mask' must be a list of 0/1, got {_type_name(value)}")
    if len(value) != length:
        raise BadRow(f"'loss_mask' has {len(value)} entries but 'input_ids' has {length}; they must be the same length")
    types = set(map(type, value))
    if not types <= {int, bool}:
        i = next(i for i, x in enumerate(value) if type(x) not in (int, bool))
        raise BadRow(f"'loss_mask[{i}]' must be 0 or 1, got {_type_name(value[i])}")
    if not set(value) <= {0, 1}:
        i = next(i for i, x in enumerate(value) if x not in (0, 1))
        raise BadRow(f"'loss_mask[{i}]' must be 0 or 1, got {value[i]!r}")
    if not any(value):
        raise BadRow("'loss_mask' has no 1s; at least one token must carry the loss")
    # Bools become 0/1 so that a mask hashes and stores the same from JSON and from Arrow.
    return list(map(int, value)) if bool in types else value


def _given_id(data: dict) -> str | None:
    value = data.get("id")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        raise BadRow(f"'id' must be a string or int, got {_type_name(value)}")
    text = str(value)
    if not text.strip():
        raise BadRow("'id' is empty; leave it out to get a content hash")
    return text


def _loose_id(data: Any) -> str | None:
    """The id of a rejected row, if it had a usable one."""
    if isinstance(data, dict):
        value = data.get("id")
        if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value).strip():
            return _utf8(str(value))
    return None


def _check_unicode(text: str, where: str) -> None:
    # json.loads accepts lone surrogate escapes ("\ud83d"), which no tokenizer or Parquet
    # writer accepts later: reject them here, with the row.
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise BadRow(f"{where} is not valid Unicode (unpaired surrogate at character {e.start})") from None


def _keys_note(data: dict) -> str:
    present = [k for k, v in data.items() if v is not None]
    return f" (row has: {', '.join(map(str, present))})" if present else ""


def _type_name(value: Any) -> str:
    if value is None:
        return "null"
    return {bool: "bool", int: "int", float: "float", str: "string", list: "list", dict: "object"}.get(
        type(value), type(value).__name__
    )


def _utf8(text: str) -> str:
    return text.encode("utf-8", "replace").decode("utf-8") if _has_surrogates(text) else text


def _has_surrogates(text: str) -> bool:
    try:
        text.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json")


def _check_kind(kind: str) -> None:
    if kind not in COLUMNS:
        raise ValueError(f"kind must be 'generate' or 'passthrough', got {kind!r}")
