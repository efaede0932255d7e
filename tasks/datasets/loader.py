"""Loading a dataset: the reader its path calls for, rows read in the dataset's row format and checked, ids unique,
bad rows raised or rejected."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path
from typing import Any, Literal, overload

from settings.dataset import RowFormat
from settings.hub_paths import hub_repo_id, is_hub_path
from tasks.datasets.detect import Resolver
from tasks.datasets.errors import DatasetError, DatasetNotFoundError, EmptyDatasetError
from tasks.datasets.hf_saved import read_hf_saved, train_split
from tasks.datasets.hub import HubDataset, read_hub
from tasks.datasets.jsonl import read_jsonl
from tasks.datasets.parquet import read_parquet
from tasks.datasets.raw import ACCEPTED_FORMATS, COLUMNS, Raw
from tasks.datasets.rows import BUILDERS, BadRow, Kind, LoadedDataset, PassthroughRow, PromptRow, Reject, loose_id, utf8

log = logging.getLogger("eagle3.datasets")

OnBadRow = Literal["fail", "skip"]
DatasetSource = Path | str | HubDataset  # what a loader reads: a local path, or a Hub dataset with its settings
REPEATED_ID_FIX = (
    "ids must be unique within a dataset: give one of the two rows another id (or remove its id to"
    " get a content hash), or delete the repeat; with on_bad_row: skip the first row is kept and"
    " the repeat goes to rejects"
)


def iter_rows(
    path: DatasetSource, kind: Kind, row_format: RowFormat | None = None
) -> Iterator[tuple[int, PromptRow | PassthroughRow | BadRow]]:
    """Each row read in the dataset's row format and checked, with the number errors use for it (JSONL line, else row;
    per file in a directory): the row, or the BadRow that says why it is none. For a sample of a dataset.

    Raises DatasetError for a row that cannot be parsed into a JSON object; ids are not made unique (`load_dataset`
    does). Format and existence are checked before the first row. `row_format`: the dataset's (default: auto).
    """
    _check_kind(kind)
    resolver = Resolver(kind, row_format or RowFormat())
    return _checked_rows(_open_rows(path, resolver), resolver)


def _checked_rows(raws: Iterator[Raw], resolver: Resolver) -> Iterator[tuple[int, PromptRow | PassthroughRow | BadRow]]:
    build = BUILDERS[resolver.kind]
    for raw in raws:
        if raw.error is not None:
            expected = raw.expected or resolver.expected()
            raise DatasetError(raw.source, raw.row, raw.error, expected=expected, unit=raw.unit)
        try:
            yield raw.row, build(resolver.canonical(raw.data))
        except BadRow as bad:
            yield raw.row, bad


# The row type follows `kind`: a variable Kind gets the union (mypy sums the two overloads over it).
@overload
def load_dataset(
    path: DatasetSource, kind: Literal["generate"], *, row_format: RowFormat | None = ..., on_bad_row: OnBadRow = ...
) -> LoadedDataset[PromptRow]: ...
@overload
def load_dataset(
    path: DatasetSource, kind: Literal["passthrough"], *, row_format: RowFormat | None = ..., on_bad_row: OnBadRow = ...
) -> LoadedDataset[PassthroughRow]: ...
def load_dataset(
    path: DatasetSource, kind: Kind, *, row_format: RowFormat | None = None, on_bad_row: OnBadRow = "fail"
) -> LoadedDataset[PromptRow] | LoadedDataset[PassthroughRow]:
    """Read every row in the dataset's row format and validate it; the first occurrence of each id wins.

    row_format: the dataset's format settings (a DatasetConfig is one); None reads with format auto. Every caller
    with a config passes the dataset's, else its format, roles or id_field would be ignored.

    on_bad_row="fail" raises DatasetError on the first bad row; "skip" records a Reject and goes
    on. A repeated id is a bad row unless the repeat has the same content (and the id the same
    type): such duplicates are dropped, counted, and reported in one warning on `eagle3.datasets`.
    Raises EmptyDatasetError when no usable row is left. All rows are held: `stream_dataset` reads the same rows
    one at a time.
    """
    stream = stream_dataset(path, kind, row_format=row_format, on_bad_row=on_bad_row)
    rows = list(stream)
    return LoadedDataset(
        rows=rows, rejects=stream.rejects, duplicates=stream.duplicates, path=stream.path, shape=stream.shape
    )


def stream_dataset(
    path: DatasetSource, kind: Kind, *, row_format: RowFormat | None = None, on_bad_row: OnBadRow = "fail"
) -> DatasetStream:
    """`load_dataset`'s rows one at a time, for a dataset too large to hold (a passthrough set of long records).

    Settings, format and existence are checked here; rows, bad rows and repeats as the iteration reaches them."""
    _check_kind(kind)
    if on_bad_row not in ("fail", "skip"):
        raise ValueError(f"on_bad_row must be 'fail' or 'skip', got {on_bad_row!r}")
    resolver = Resolver(kind, row_format or RowFormat())
    return DatasetStream(path, kind, resolver, on_bad_row, _open_rows(path, resolver))


class DatasetStream:
    """The valid rows of a dataset (the first occurrence of each id), yielded as they are read.

    Once the iteration has ended, `rejects`, `duplicates` and `shape` are final, the warnings are logged, and a
    dataset without a usable row has raised EmptyDatasetError. No row is kept here: a repeated id is compared with
    a digest of its first occurrence's content."""

    def __init__(
        self, source: DatasetSource, kind: Kind, resolver: Resolver, on_bad_row: OnBadRow, raws: Iterator[Raw]
    ) -> None:
        self.path = source.path if isinstance(source, HubDataset) else Path(source)
        self.kind = kind
        self.resolver = resolver
        self.on_bad_row = on_bad_row
        self.raws = raws
        self.rejects: list[Reject] = []
        self.duplicates = 0

    @property
    def shape(self) -> Any:
        return self.resolver.shape

    def __iter__(self) -> Iterator[Any]:
        resolver, on_bad_row, rejects = self.resolver, self.on_bad_row, self.rejects
        build = BUILDERS[self.kind]
        id_field = resolver.fmt.id_field
        # id -> (content digest, source, row number, whether the id was given as an int): enough to compare a
        # repeat with its first occurrence and to name both.
        seen: dict[str, tuple[bytes, Path, int, bool]] = {}
        first_duplicate: tuple[str, Path, int] | None = None
        kept = 0
        for raw in self.raws:
            try:
                if raw.error is not None:
                    raise BadRow(raw.error, raw.expected)
                data = resolver.canonical(raw.data)
                row = build(data)
            except BadRow as bad:
                if on_bad_row == "fail":
                    raise DatasetError(
                        raw.source, raw.row, bad.reason, expected=bad.expected or resolver.expected(), unit=raw.unit
                    ) from None
                rejects.append(Reject(raw.source, raw.row, loose_id(raw.data, id_field), bad.reason, raw.text()))
                continue
            int_id = type(data.get("id")) is int
            first = seen.get(row.id)
            if first is None:
                seen[row.id] = (_content_digest(row), raw.source, raw.row, int_id)
                kept += 1
                yield row
                continue
            conflict = _repeat_conflict(row, int_id, first, raw.source)
            if conflict is None:
                self.duplicates += 1
                if first_duplicate is None:
                    first_duplicate = (row.id, raw.source, raw.row)
                continue
            if on_bad_row == "fail":
                raise DatasetError(raw.source, raw.row, conflict, expected=REPEATED_ID_FIX, unit=raw.unit)
            rejects.append(Reject(raw.source, raw.row, utf8(row.id), conflict, raw.text()))
        self._finish(kept, first_duplicate)

    def _finish(self, kept: int, first_duplicate: tuple[str, Path, int] | None) -> None:
        path, rejects = self.path, self.rejects
        if not kept:  # before the warnings: the error says it all
            raise _empty_dataset(path, rejects, self.resolver)
        if first_duplicate is not None:  # set with the first of the duplicates
            dup_id, dup_source, dup_row = first_duplicate
            log.warning(
                "%s: dropped %d row(s) that repeat an earlier row's id and content (the first occurrence is kept);"
                " first repeat: id %r at %s %s %d",
                path,
                self.duplicates,
                dup_id,
                dup_source,
                "line" if _is_jsonl(dup_source) else "row",
                dup_row,
            )
        if rejects:
            first_reject = rejects[0]
            log.warning(
                "%s: skipped %d bad row(s) (on_bad_row=skip); first: %s %s %d: %s",
                path,
                len(rejects),
                first_reject.path,
                "line" if _is_jsonl(first_reject.path) else "row",
                first_reject.row,
                first_reject.reason,
            )


def _content_digest(row: PromptRow | PassthroughRow) -> bytes:
    """A digest of a row's content, equal for rows that compare equal (dict keys in any order)."""
    content = json.dumps([getattr(row, f.name) for f in fields(row)], sort_keys=True, ensure_ascii=False, default=repr)
    return hashlib.blake2b(content.encode("utf-8", "surrogatepass"), digest_size=16).digest()


def _repeat_conflict(
    row: PromptRow | PassthroughRow, int_id: bool, first: tuple[bytes, Path, int, bool], source: Path
) -> str | None:
    """Why a row whose id was seen before is bad, or None when it is a plain duplicate."""
    first_digest, first_source, first_number, first_int = first
    where = f"{'line' if _is_jsonl(first_source) else 'row'} {first_number}"
    if first_source != source:
        where = f"{first_source} {where}"
    if int_id != first_int:
        # str() made both "7": a file that mixes them means two different rows or a typo.
        quoted = json.dumps(row.id, ensure_ascii=False)
        shown, first_shown = (row.id, quoted) if int_id else (quoted, row.id)
        return (
            f"id {utf8(shown)} collides with id {utf8(first_shown)} at {where}: ids are compared as"
            " strings, so an int id and the same digits as a string are the same id"
        )
    if _content_digest(row) != first_digest:  # same id, so this compares the content
        return f"id {utf8(row.id)!r} repeats {where} with different content"
    return None


def _empty_dataset(path: Path, rejects: list[Reject], resolver: Resolver) -> EmptyDatasetError:
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
        error.shape = resolver.shape
        return error
    return EmptyDatasetError(
        path,
        None,
        "has no rows",
        expected="a dataset needs at least one row: check that datasets[i].path names the right file,"
        " or remove the dataset from the config",
    )


def _open_rows(source: DatasetSource, resolver: Resolver) -> Iterator[Raw]:
    """Pick the reader for `source`; format and existence errors raise here, not at first row. A bare `hf:ORG/NAME`
    path reads the Hub dataset's train split and records nothing (a HubDataset says more)."""
    if isinstance(source, HubDataset):
        return read_hub(source, resolver.columns)
    if is_hub_path(source):
        try:
            repo_id = hub_repo_id(source)
        except ValueError as e:
            raise DatasetError(source, None, str(e)) from None
        return read_hub(HubDataset(repo_id), resolver.columns)
    path = Path(source)
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
            return read_jsonl(path)
        if suffix == ".parquet":
            return read_parquet(path, resolver.columns)
        raise DatasetError(path, None, f"unsupported file type {suffix or '(no suffix)'!r}", expected=ACCEPTED_FORMATS)
    if path.is_dir():
        if (path / "dataset_dict.json").is_file():
            return _open_rows(train_split(path), resolver)
        if (path / "state.json").is_file():
            return read_hf_saved(path, resolver.columns)
        parts = sorted(p for p in path.glob("*.parquet") if p.is_file() and not p.name.startswith((".", "_")))
        if parts:
            return _chain([read_parquet(p, resolver.columns) for p in parts])
        raise DatasetError(
            path, None, "directory has no *.parquet files and no state.json (save_to_disk)", expected=ACCEPTED_FORMATS
        )
    raise DatasetError(path, None, "is neither a file nor a directory", expected=ACCEPTED_FORMATS)


def _chain(readers) -> Iterator[Raw]:
    for reader in readers:
        yield from reader


def _is_jsonl(path: Path) -> bool:
    return path.suffix.lower() in (".jsonl", ".json")


def _check_kind(kind: str) -> None:
    if kind not in COLUMNS:
        raise ValueError(f"kind must be 'generate' or 'passthrough', got {kind!r}")
