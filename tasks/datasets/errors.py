"""The errors of dataset loading: a file that cannot be read, or a bad row, named with its line or row and the fix."""

from __future__ import annotations

from pathlib import Path

from tasks.datasets.rows import Reject, RowShape


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

    `rejects` holds the bad rows, so that `eagle3 validate` can list them, and `shape` the row format the rows were
    read in (formats.Shape, as rows.RowShape; None if none was detected); both are lost in pickling.
    """

    rejects: tuple[Reject, ...] = ()
    shape: RowShape | None = None


def _rebuild_error(cls, path, row, reason, expected, unit):
    return cls(path, row, reason, expected=expected, unit=unit)
