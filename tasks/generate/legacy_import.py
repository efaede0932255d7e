"""Adopt a legacy `raw_responses.jsonl` (one response of the old inference loop per line) as checkpoints.

The old loop wrote two formats over its life; every line may be either, and both become rows of
`tasks.responses.checkpoints.RESPONSE_SCHEMA` in RUN_DIR/responses/<dataset>/, written with `write_part`.

The line formats and their field mapping: tasks/generate/legacy_lines.py.

Lines: blank lines are ignored. A last line that is not valid JSON (the old loop was killed
mid-write: no trailing newline and/or truncated JSON) is skipped with a warning and reported as
`partial_last_line`; a complete last line without a trailing newline is imported. Any other bad
line raises DatasetError naming the file and line, and nothing of the file is imported; or, with
on_bad_line="skip", it is counted and written to RUN_DIR/rejects/<dataset>/ with stage "import".
The bad lines an import finds in a file replace those earlier imports of that file recorded, so a
line fixed since is no longer listed (and was imported, once).

All or nothing per file, in two phases. Phase 1 reads the whole file once, validates and maps
every line and writes the rows as staged parts: hidden temporary files in the dataset directory
(`.import-*.tmp`, never listed as parts). Phase 2 renames the staged parts into place as the next
part numbers. So a bad line (under "fail"), a write failure or a kill during phase 1 leaves the
dataset's responses as they were (what a kill leaves staged, the next writer's
`clean_stale_temps` removes), and a kill during phase 2 leaves whole parts, which a rerun
completes exactly once because ids already present are skipped. Staging rather than holding the
rows keeps memory bounded for big files (10k lines of 16k-token outputs are ~160M token ids):
only one part's rows are in memory, a part being cut at `flush_every` rows or `flush_tokens`
prompt + output ids, whichever comes first. Renames need no extra disk space.

Failures: a write that the storage refuses (disk full, read-only, quota) raises
models.common.file_errors.WriteFailed naming the path, what was kept and how to resume. A part already
in RUN_DIR/responses/<dataset>/ that cannot be read raises tasks.responses.parquet_io.DamagedPart naming it
and where to move it; nothing is imported until it is moved. The import holds the run
directory's write lock (tasks.runtime.run_lock) for its whole run: a second writer gets RunDirLocked.

Exactly once: ids already in RUN_DIR/responses/<dataset>/ are skipped, a repeated id inside the
file keeps its first line, so importing the same file again adds nothing.
"""

from __future__ import annotations

import logging
import os
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq

from models.common.atomic import TMP_SUFFIX, fsync_dir
from models.common.file_errors import WriteFailed
from settings.layout import RunLayout
from tasks.datasets import DatasetError, Reject
from tasks.generate.legacy_lines import BadLine, LegacyLine, legacy_id_or_none, parse_line, read_lines
from tasks.responses.checkpoints import PartSummary, done_ids, finish_compaction, live_parts, responses_table
from tasks.responses.parquet_io import (
    DamagedPart,
    clean_stale_temps,
    next_part_path,
    read_metadata,
    reading,
    write_parquet_atomic,
)
from tasks.responses.rejects import write_rejects
from tasks.runtime.run_lock import run_lock

log = logging.getLogger("eagle3.legacy_import")

OnBadLine = Literal["fail", "skip"]

# A staged part's rows are Python lists until written (~36 bytes an id): 2M ids is ~70 MB.
FLUSH_TOKENS = 2_000_000
EXPECTED = (
    "expected one JSON object per line: a response of the old loop, flat (output_ids, completion_tokens,"
    " prompt_tokens, finish_reason, text) or nested (usage.completion_tokens, messages, the answer in"
    " response/content/choices[0].message.content)"
)
RESUME = "fix that (free space, permissions) and run the same import again: ids already imported are skipped"


@dataclass
class ImportReport:
    """What one import did. lines == imported + skipped_existing + duplicates + aborted + bad_lines
    + partial_last_line."""

    file: Path
    dataset: str
    lines: int = 0  # non-blank lines read, a partial last line included
    imported: int = 0
    skipped_existing: int = 0  # already in RUN_DIR/responses/<dataset>/
    duplicates: int = 0  # an earlier line of the file had the same id
    partial_last_line: bool = False
    retokenized: int = 0  # imported rows whose prompt_ids or output_ids were re-tokenised
    completion_tokens: int = 0  # of the imported rows
    aborted: int = 0  # finish_reason "abort": not a response, left for generation
    bad_lines: int = 0  # rejected under on_bad_line="skip"
    parts: list[Path] = field(default_factory=list)
    rejects_part: Path | None = None

    def summary(self) -> str:
        """One line for the user: what was read, imported, skipped and where it went."""
        text = (
            f"{self.file}: {self.lines} line(s); {self.imported} imported into {len(self.parts)} part(s),"
            f" {self.skipped_existing} already there, {self.duplicates} duplicate id(s), {self.aborted} aborted"
        )
        if self.partial_last_line:
            text += ", a partial last line skipped"
        if self.bad_lines:
            text += f", {self.bad_lines} bad line(s) skipped (listed in {self.rejects_part})"
        if self.retokenized:
            text += f"; {self.retokenized} re-tokenised (no token ids in the file)"
        return text


def import_jsonl(
    run_dir: Path,
    dataset: str,
    file: Path,
    *,
    tokenizer: Any,
    flush_every: int = 10_000,
    flush_tokens: int = FLUSH_TOKENS,
    on_bad_line: OnBadLine = "fail",
) -> ImportReport:
    """Import the responses in legacy JSONL `file` into RUN_DIR/responses/<dataset>/, each id once.

    `tokenizer` (the target's) is needed only for lines without token ids; None is accepted when
    every line has them. A part holds at most `flush_every` rows and about `flush_tokens` ids.
    Holds RUN_DIR's write lock throughout (RunDirLocked if another process has it).
    """
    if on_bad_line not in ("fail", "skip"):
        raise ValueError(f"on_bad_line must be 'fail' or 'skip', got {on_bad_line!r}")
    if flush_every < 1 or flush_tokens < 1:
        raise ValueError(f"flush_every and flush_tokens must be at least 1, got {flush_every}, {flush_tokens}")
    if not dataset or dataset.startswith(".") or Path(dataset).name != dataset:
        raise ValueError(f"dataset {dataset!r} cannot be a directory name under responses/")
    run_dir, file = Path(run_dir), Path(file)
    if not file.is_file():
        raise DatasetError(file, None, "does not exist or is not a file", expected=EXPECTED)
    if run_dir.exists() and not run_dir.is_dir():
        raise DatasetError(run_dir, None, "is not a directory: give the run directory to import into")
    with ExitStack() as stack:
        try:
            stack.enter_context(run_lock(run_dir, f"import-jsonl {dataset}"))
        except OSError as e:  # cannot even create RUN_DIR/.lock: read-only, permissions, full
            raise WriteFailed(RunLayout(run_dir).lock, e, kept="nothing was imported", resume=RESUME) from None
        return _import(RunLayout(run_dir), dataset, file, tokenizer, flush_every, flush_tokens, on_bad_line)


def _import(layout, dataset, file, tokenizer, flush_every, flush_tokens, on_bad_line) -> ImportReport:
    """The import itself, under the lock: stage the whole file, then commit, then record the rejects."""
    directory = layout.responses(dataset)
    existing = _existing_ids(directory, layout, file)
    report = ImportReport(file=file, dataset=dataset)
    staged: list[Path] = []
    try:
        rejects = _stage(file, directory, existing, tokenizer, flush_every, flush_tokens, on_bad_line, report, staged)
    except BaseException:
        _remove(staged)  # nothing of this file goes in: a bad line, a failed write, an interrupt
        raise
    report.parts = _commit(directory, staged, file)
    report.rejects_part = _record_rejects(rejects, layout.rejects(dataset), file, report)

    if report.duplicates:
        log.warning("%s: %d line(s) repeat an earlier line's id; the first is kept", file, report.duplicates)
    if report.retokenized:
        log.warning(
            "%s: %d imported row(s) had no token ids and were re-tokenised; those ids may differ from"
            " what the target generated",
            file,
            report.retokenized,
        )
    log.info(
        "%s -> %s: %d line(s), %d imported, %d already there, %d duplicate(s), %d aborted, %d bad",
        file,
        directory,
        report.lines,
        report.imported,
        report.skipped_existing,
        report.duplicates,
        report.aborted,
        report.bad_lines,
    )
    return report


def _record_rejects(rejects: list[Reject], directory: Path, file: Path, report: ImportReport) -> Path | None:
    """This import's bad lines of `file` replace the ones earlier imports of `file` recorded; the part.

    So a line fixed since is no longer listed, and importing the same file again writes nothing new.
    """
    try:
        earlier = [
            p for p in live_parts(directory) if read_metadata(p).get("stage") == "import" and _only_from(p, file)
        ]
        return write_rejects(rejects, directory, "import", replaces=earlier)
    except DamagedPart as damaged:
        where = RunLayout.of_dataset_dir(directory).quarantine(directory)
        raise damaged.with_advice(
            f"The {report.imported} response(s) are imported; the bad lines are not listed yet. Move it aside:"
            f" mkdir -p {where} && mv {damaged.path} {where}/ -- then run the import again"
        ) from None
    except OSError as e:
        raise WriteFailed(
            directory,
            e,
            kept=f"all {report.imported} imported response(s) from {file}; "
            f"its bad lines are not listed in {directory} yet",
            resume=RESUME + " (that lists the bad lines)",
        ) from None


def _only_from(part: Path, file: Path) -> bool:
    with reading(part):
        sources = set(pq.read_table(part, columns=["source"]).column("source").to_pylist())
    return all(Path(s).resolve() == file.resolve() for s in sources)


def _existing_ids(directory: Path, layout: RunLayout, file: Path) -> set[str]:
    """Ids already imported or generated; DamagedPart, with what to do, when a part cannot be read."""
    clean_stale_temps(directory)  # staged parts of an import that was killed: never committed
    try:
        finish_compaction(directory)
        return done_ids(directory)
    except DamagedPart as damaged:
        where = layout.quarantine(directory)
        raise damaged.with_advice(
            f"Nothing was imported. Move it aside: mkdir -p {where} && mv {damaged.path} {where}/ -- then run the"
            f" import again: the responses it held count as not done, so those in {file.name} are imported again,"
            " exactly once"
        ) from None


def _stage(
    file, directory, existing, tokenizer, flush_every, flush_tokens, on_bad_line, report, staged
) -> list[Reject]:
    """Phase 1: read, validate and map every line, writing the rows as staged parts; the rejects."""
    fallback_time = file.stat().st_mtime
    seen: set[str] = set()
    buffer: list[dict[str, Any]] = []
    buffered_tokens = 0
    rejects: list[Reject] = []

    def flush() -> None:
        nonlocal buffered_tokens
        if buffer:
            staged.append(_write_staged(directory, responses_table(buffer), file))
            buffer.clear()
            buffered_tokens = 0

    for lineno, raw, is_last in read_lines(file):
        report.lines += 1
        try:
            data = parse_line(raw, lineno)
        except BadLine as bad:
            if is_last and bad.unreadable:
                report.partial_last_line = True
                log.warning(
                    "%s line %d: skipped a partial last line (%s); the old loop was probably killed"
                    " while writing it, so its prompt is not done",
                    file,
                    lineno,
                    bad.reason,
                )
                continue
            _bad_line(file, lineno, raw, None, bad, on_bad_line, report, rejects)
            continue
        try:
            legacy = LegacyLine.of(data, fallback_time)
            if legacy.finish_reason == "abort":
                report.aborted += 1
                continue
            if legacy.id in seen:
                report.duplicates += 1
                continue
            seen.add(legacy.id)
            if legacy.id in existing:
                report.skipped_existing += 1
                continue
            row, retokenized = legacy.response_row(tokenizer, lineno)
        except BadLine as bad:
            _bad_line(file, lineno, raw, legacy_id_or_none(data), bad, on_bad_line, report, rejects)
            continue
        buffer.append(row)
        buffered_tokens += len(row["prompt_ids"]) + len(row["output_ids"])
        report.imported += 1
        report.retokenized += retokenized
        report.completion_tokens += row["completion_tokens"]
        if len(buffer) >= flush_every or buffered_tokens >= flush_tokens:
            flush()
    flush()
    return rejects


def _write_staged(directory: Path, table: pa.Table, file: Path) -> Path:
    # A hidden .tmp name: not a part for any reader, and removed by the next writer if we die.
    path = directory / f".import-{os.getpid()}-{uuid.uuid4().hex[:8]}{TMP_SUFFIX}"
    try:
        return write_parquet_atomic(table, path, PartSummary.of_table(table).to_metadata())
    except OSError as e:
        raise WriteFailed(
            directory, e, kept=f"nothing of {file} was imported; {directory} is as it was", resume=RESUME
        ) from None


def _commit(directory: Path, staged: list[Path], file: Path) -> list[Path]:
    """Phase 2: rename the staged parts into place as the next part numbers; the parts."""
    parts: list[Path] = []
    for i, path in enumerate(staged):
        final = next_part_path(directory)
        try:
            os.replace(path, final)
        except BaseException as e:
            _remove(staged[i:])
            if not isinstance(e, OSError):
                raise
            raise WriteFailed(
                final,
                e,
                kept=f"{len(parts)} of the {len(staged)} part(s) of {file} are in place, whole; the rest is not",
                resume=RESUME,
            ) from None
        parts.append(final)
    fsync_dir(directory)
    return parts


def _remove(paths: list[Path]) -> None:
    for path in paths:
        try:
            path.unlink(missing_ok=True)
        except OSError:  # best effort: clean_stale_temps removes it on the next run
            pass


def _bad_line(file, lineno, raw, row_id, bad, on_bad_line, report, rejects) -> None:
    if on_bad_line == "fail":
        raise DatasetError(file, lineno, bad.reason, expected=EXPECTED, unit="line") from None
    report.bad_lines += 1
    rejects.append(Reject(file, lineno, row_id, bad.reason, raw.decode("utf-8", "replace").rstrip("\r\n")))
    log.warning("%s line %d: skipped (on_bad_line=skip): %s", file, lineno, bad.reason)
