"""The lines a rank process prints for the pipeline, defined once: formatted by the ranks, parsed by the tasks.

A protocol line is `MARK name=value name=value ...` on stdout (progress, checkpoints, the end), or
`MARK {json}` on stderr for a failed rank's error report. A launcher may put a prefix before it
(torchrun --tee: `[default1]:`), so a parser looks for the mark anywhere in the line. A line cut
short by a dying process does not parse and is an ordinary log line.

    capture  CAPTURE_PROGRESS rank=R done=a total=b tokens=t       this rank's samples, this launch
             CAPTURE_ERROR {json}
    train    TRAIN_PROGRESS step=S total=N tokens=T [loss=L lr=X]  rank 0, all ranks' tokens
             TRAIN_EVAL step=S acceptance_length=A loss=L
             TRAIN_CHECKPOINT step=S                               a complete checkpoint
             TRAIN_BEST step=S acceptance_length=A dir=DIR         a new best held-out eval, its draft exported
             TRAIN_DONE final=DIR
             TRAIN_ERROR {json}
    eval     EVAL_PROGRESS draft=NAME done=i total=n [new_tokens=T rounds=R accepted=A]
                                                                   prompt i's tokens, verify rounds, accepted drafts
             EVAL_ERROR {json}
    any      RANK_MEMORY rank=R host_peak_rss=B [gpu_peak_allocated=B gpu_peak_reserved=B]
                                                                   every rank as it exits (bytes)

The error report (`error_report`) says enough to raise the same exception in the pipeline
(`reported_error`): a failed write (`WriteFailed`) or a damaged file (`DamagedFile`, `DamagedShard`)
comes back as itself, with the rank's own words; bad input is `kind: invalid` (a retry fails the
same way); anything else is `kind: error`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from models.common.file_errors import DamagedFile, DamagedShard, WriteFailed

# The most telling report of a failed job comes first: a rank's failed write or damaged file is
# the cause when its peers fail too (they lose their connection to it).
KINDS = ("write_failed", "damaged", "invalid", "error")


@dataclass(frozen=True)
class Field:
    """One `name=value` of a protocol line: its type, how it is printed, and whether it may be left out."""

    name: str
    type: type = int
    spec: str = ""  # format spec of the value (".4f")
    optional: bool = False  # only at the end of a line: the ranks may leave it out


@dataclass(frozen=True)
class Line:
    """One kind of protocol line, `MARK name=value ...`: `format` and `parse` follow the same fields."""

    mark: str
    fields: tuple[Field, ...]
    pattern: re.Pattern = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        parts = []
        for i, f in enumerate(self.fields):
            # A str value is one word, except the last field's: it takes the rest of the line (a path).
            value = r"(.+)" if f.type is str and i == len(self.fields) - 1 else r"(\S+)"
            parts.append(f"(?: {f.name}={value})?" if f.optional else f" {f.name}={value}")
        object.__setattr__(self, "pattern", re.compile(re.escape(self.mark) + "".join(parts)))

    def format(self, **values: Any) -> str:
        """The line for `values` (every field that is not optional; optional ones when given)."""
        unknown = set(values) - {f.name for f in self.fields}
        if unknown:
            raise TypeError(f"{self.mark}: unknown fields {sorted(unknown)}")
        words = [self.mark]
        for f in self.fields:
            if f.name not in values:
                if not f.optional:
                    raise TypeError(f"{self.mark}: missing field {f.name!r}")
                continue
            words.append(f"{f.name}={values[f.name]:{f.spec}}")
        return " ".join(words)

    def parse(self, line: str) -> dict[str, Any] | None:
        """The typed values of this kind of line found in `line`, or None (another line, or one cut short)."""
        found = self.pattern.search(line)
        if found is None:
            return None
        values: dict[str, Any] = {}
        for f, text in zip(self.fields, found.groups()):
            if text is None:
                continue  # an optional field left out
            try:
                values[f.name] = f.type(text)
            except ValueError:
                return None
        return values


@dataclass(frozen=True)
class ErrorLine:
    """A failed rank's report, `MARK {json}` (see `error_report`)."""

    mark: str

    def format(self, report: dict[str, Any]) -> str:
        return f"{self.mark} {json.dumps(report)}"

    def parse(self, line: str) -> dict[str, Any] | None:
        """The report in `line` (a launcher may prefix it), or None (another line, or one cut short)."""
        at = line.find(self.mark + " {")
        if at < 0:
            return None
        try:
            report = json.loads(line[at + len(self.mark) + 1 :])
        except ValueError:
            return None
        return report if isinstance(report, dict) else None


@dataclass(frozen=True)
class Message:
    """A protocol line as the pipeline received it: which kind, its values, the line itself."""

    kind: Line | ErrorLine
    values: dict[str, Any]
    line: str


@dataclass(frozen=True)
class Protocol:
    """Every line one kind of rank process prints for the pipeline."""

    name: str  # "capture": also how the rank names itself in words ("capture rank 1 failed: ...")
    error: ErrorLine
    progress: Line  # frequent: the pipeline shows a summary of these rather than each line
    events: tuple[Line, ...] = ()  # rare: each one worth a line in the log

    def parse(self, line: str) -> Message | None:
        """The protocol line in `line`, or None for any other output."""
        kinds: tuple[Line | ErrorLine, ...] = (self.error, self.progress, *self.events)
        for kind in kinds:
            values = kind.parse(line)
            if values is not None:
                return Message(kind, values, line)
        return None


CAPTURE_PROGRESS = Line("CAPTURE_PROGRESS", (Field("rank"), Field("done"), Field("total"), Field("tokens")))
CAPTURE = Protocol("capture", ErrorLine("CAPTURE_ERROR"), CAPTURE_PROGRESS)

TRAIN_PROGRESS = Line(
    "TRAIN_PROGRESS",
    (
        Field("step"),
        Field("total"),
        Field("tokens"),
        Field("loss", float, ".4f", optional=True),
        Field("lr", float, ".3g", optional=True),
    ),
)
TRAIN_EVAL = Line("TRAIN_EVAL", (Field("step"), Field("acceptance_length", float, ".3f"), Field("loss", float, ".4f")))
TRAIN_CHECKPOINT = Line("TRAIN_CHECKPOINT", (Field("step"),))
TRAIN_BEST = Line("TRAIN_BEST", (Field("step"), Field("acceptance_length", float, ".3f"), Field("dir", str)))
TRAIN_DONE = Line("TRAIN_DONE", (Field("final", str),))
TRAIN = Protocol(
    "train", ErrorLine("TRAIN_ERROR"), TRAIN_PROGRESS, (TRAIN_EVAL, TRAIN_CHECKPOINT, TRAIN_BEST, TRAIN_DONE)
)

# After each prompt, its figures (optional: a parser of the first three reads these lines too):
# new tokens, verify rounds, accepted draft tokens; a stopped eval still tells what it measured.
EVAL_PROGRESS = Line(
    "EVAL_PROGRESS",
    (
        Field("draft", str),
        Field("done"),
        Field("total"),
        Field("new_tokens", optional=True),
        Field("rounds", optional=True),
        Field("accepted", optional=True),
    ),
)
EVAL = Protocol("eval", ErrorLine("EVAL_ERROR"), EVAL_PROGRESS)

# Printed by every rank of every entry point as it exits (models/ranks/harness.py `serve`): the peak resident
# memory of the process and, where it used CUDA, the allocator's peaks on its busiest GPU. Not part of
# a stage's protocol: the pipeline logs it as an ordinary line; the GPU check (tools/gpu_check.py) reads it.
RANK_MEMORY = Line(
    "RANK_MEMORY",
    (
        Field("rank"),
        Field("host_peak_rss"),
        Field("gpu_peak_allocated", optional=True),
        Field("gpu_peak_reserved", optional=True),
    ),
)


# --- the error report ---------------------------------------------------------------------------------


def error_report(error: BaseException, rank: int) -> dict[str, Any]:
    """What a failed rank tells the pipeline: enough to raise the same exception there (one JSON line)."""
    report: dict[str, Any] = {"rank": rank, "type": type(error).__name__, "message": str(error)}
    if isinstance(error, WriteFailed):
        report.update(
            kind="write_failed",
            path=str(error.path),
            errno=error.errno,
            error=getattr(error.error, "strerror", None) or str(error.error),
            kept=error.kept,
            resume=error.resume,
        )
    elif isinstance(error, DamagedFile):
        report.update(kind="damaged", path=str(error.path), problem=error.problem, advice=error.advice)
    elif isinstance(error, (ValueError, FileNotFoundError)):
        report.update(kind="invalid")  # bad job, records or settings: the same again on a retry
    else:
        report.update(kind="error")
    return report


def most_telling(reports: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The report that explains a failed job best (see KINDS), or None when there is none."""
    return min(reports, key=lambda r: KINDS.index(r["kind"]) if r.get("kind") in KINDS else len(KINDS), default=None)


def reported_error(report: dict[str, Any], known: Iterable[type[Exception]] = ()) -> Exception | None:
    """The rank's own exception, rebuilt from its report: a failed write, a damaged file, or one of `known`
    (exception classes taking one message, matched by name); None for anything else.
    """
    message = report.get("message", "")
    if report.get("kind") == "write_failed":
        code, text = report.get("errno"), report.get("error", "")
        cause = OSError(code, text) if code is not None else OSError(text)
        error = WriteFailed(report["path"], cause, kept=report.get("kept", ""), resume=report.get("resume", ""))
        if message:
            error.args = (message,)  # the rank's words: the free space it saw when the write failed
        return error
    if report.get("kind") == "damaged":
        damaged = DamagedShard if report.get("type") == DamagedShard.__name__ else DamagedFile
        return damaged(report["path"], report["problem"], report["advice"])
    for cls in known:
        if report.get("type") == cls.__name__:
            return cls(message)
    return None
