"""The records stage: training records (input_ids, loss_mask) from responses and passthrough rows.

Generated responses become `prompt_ids + output_ids` with the loss on the output ids, stop token
included: the exact ids the target produced, never a re-rendered conversation. Passthrough rows are
either taken as they are (pre-tokenized) or tokenized with the target's chat template with the loss
on assistant turns only (tasks/records/chat_masks.py decides, and refuses to guess).

Each records part is derived from exactly one source part of the same name
(`responses/<ds>/part-000003.parquet` -> `records/<ds>/part-000003.parquet`) and its footer records
the settings it was built with. Re-running converts only the source parts that have no up-to-date
records part, so the stage is resumable and idempotent; records of source parts that no longer
exist (merged by compaction) are removed and rebuilt from the merged part.

Failures stop the stage at once. A write that fails (disk full, read-only, quota) raises
`WriteFailed` naming the file: every part already written stays complete, and a rerun builds only
the missing ones. A part that cannot be read raises `DamagedPart`, which names it, says what is
wrong and what to do (records parts are rebuilt from their source; a damaged responses part is
moved to RUN_DIR/quarantine/ and its prompts are generated again).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from models.common.file_errors import WriteFailed
from models.common.jobs import RecordsJob
from settings.layout import RunLayout
from tasks.datasets import Reject
from tasks.records.chat_masks import MaskError, conversation_records
from tasks.responses.checkpoints import is_whole, live_parts
from tasks.responses.parquet_io import (
    DamagedPart,
    list_parts,
    parquet_atomic_writer,
    read_metadata,
    reading,
    write_parquet_atomic,
)
from tasks.responses.rejects import write_rejects
from tasks.responses.stats import nearest_rank
from tasks.responses.tallies import add_counts

RECORD_SCHEMA = pa.schema(
    {
        "id": pa.string(),
        "input_ids": pa.list_(pa.int32()),  # prompt_ids + output_ids, as the target saw and produced them
        "loss_mask": pa.list_(pa.uint8()),  # 1 on the ids the draft learns to predict
        "num_tokens": pa.int32(),
        "num_loss_tokens": pa.int32(),
        "truncated": pa.bool_(),  # cut at records.max_seq_len
    }
)
META = "eagle3."
RESUME = "make room there, then run the records stage again: complete parts are kept, only the missing ones are built"
REBUILD = "Delete it and run the records stage again: it is rebuilt from its responses or passthrough part"


def _footer(path: Path, advice: str) -> dict[str, str]:
    """`read_metadata(path)`; DamagedPart, with `advice`, when it cannot be read."""
    try:
        return read_metadata(path)
    except DamagedPart as e:
        raise e.with_advice(advice) from None


def _table(path: Path, advice: str, columns: list[str] | None = None) -> pa.Table:
    """`pq.read_table(path)`; DamagedPart, with `advice`, when it cannot be read."""
    try:
        with reading(path):
            return pq.read_table(path, columns=columns)
    except DamagedPart as e:
        raise e.with_advice(advice) from None


def source_advice(kind: str, part: Path) -> str:
    """What to do about a damaged responses or passthrough part (RUN_DIR/<responses|passthrough>/<ds>/part-*)."""
    if kind == "passthrough":
        return "Delete it and run generate again (it is copied again from the dataset file), then the records stage"
    # generate's rule: the part is moved aside, never deleted for the user, and its prompts generated again
    where = RunLayout.of_dataset_dir(part.parent).quarantine(part.parent)
    return (
        f"Move it aside: mkdir -p {where} && mv {part} {where}/ -- then run generate (the prompts it held are "
        "generated again, exactly once) and the records stage again"
    )


@dataclass
class PartReport:
    """What one records part holds and what was left out of it (kept in the part's footer)."""

    records: int = 0
    tokens: int = 0
    loss_tokens: int = 0
    truncated: int = 0
    lengths: list[int] = field(default_factory=list)
    dropped: dict[str, int] = field(default_factory=dict)

    def drop(self, reason: str) -> None:
        self.dropped[reason] = self.dropped.get(reason, 0) + 1

    def add(self, other: PartReport) -> None:
        add_counts(self, other)

    def to_metadata(self) -> dict[str, str]:
        return {f"{META}records_summary": json.dumps(asdict(self), separators=(",", ":"))}

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> PartReport:
        return cls(**json.loads(meta[f"{META}records_summary"]))


@dataclass
class RecordsReport:
    """The records of one dataset after the stage ran."""

    dataset: str
    records: int
    tokens: int
    loss_tokens: int
    truncated: int
    dropped: dict[str, int]
    rejects: int
    parts_built: int
    p50_length: int
    p95_length: int
    max_length: int

    def row(self) -> dict[str, Any]:
        """The report as a table row (artifact, `eagle3 stats`)."""
        row = asdict(self)
        del row["parts_built"]  # a fact of one run of the stage (logged), not of the data
        row["dropped"] = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items()))
        return row


def build_records(
    dataset: str,
    kind: Literal["generate", "passthrough"],
    source_dir: Path,
    records_dir: Path,
    rejects_dir: Path,
    settings: RecordsJob,
    tokenizer: Any = None,
) -> RecordsReport:
    """Bring `records_dir` up to date with the live parts of `source_dir`; return the dataset's totals.

    Raises DamagedPart for a part it cannot read and WriteFailed for one it cannot write; either way
    every part already on disk stays complete.
    """
    try:
        sources = {p.name: p for p in live_parts(source_dir)}
    except DamagedPart as e:
        raise e.with_advice(source_advice(kind, e.path)) from None
    digest = settings.digest()
    for part in list_parts(records_dir):  # records of vanished sources or other settings go
        if part.name not in sources or _footer(part, REBUILD).get(f"{META}settings") != digest:
            part.unlink()
    done = {p.name for p in list_parts(records_dir)}
    built = 0
    for name, source in sorted(sources.items()):
        if name in done:
            continue
        kept = f"{len(done) + built} complete records parts in {records_dir}"
        report = PartReport()
        bad: list[Reject] = []
        try:
            # a row group at a time: a part of long records (a passthrough set's) held whole as Python rows took
            # ~70 B per token
            with parquet_atomic_writer(records_dir / name, RECORD_SCHEMA) as out:
                for first_row, group in _row_groups(source, source_advice(kind, source)):
                    if kind == "generate":
                        rows, part_report = _from_responses(group, settings)
                    else:
                        rows, part_report, group_bad = _from_passthrough(group, settings, tokenizer, source, first_row)
                        bad += group_bad
                    report.add(part_report)
                    out.write(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA))
                if kind == "passthrough":
                    # before the records part: a part on disk means its rejects are too (a rerun skips the part)
                    _write_rejects(bad, rejects_dir, kept=kept)
                out.metadata = {f"{META}settings": digest, f"{META}source": name, **report.to_metadata()}
        except _ReadFailed as e:  # the source, not the write (a missing part: the OS's own error names it)
            raise e.error from None
        except OSError as e:
            raise WriteFailed(records_dir / name, e, kept=kept, resume=RESUME) from None
        built += 1
    records = dataset_report(dataset, records_dir)
    records.parts_built = built
    return records


def _write_rejects(rejects: list[Reject], rejects_dir: Path, kept: str) -> None:
    """`write_rejects` for the records stage, with its failures told as WriteFailed or DamagedPart."""
    try:
        write_rejects(rejects, rejects_dir, "records")
    except DamagedPart as e:  # an earlier rejects part's footer (read to skip a repeat) is unreadable
        where = RunLayout.of_dataset_dir(rejects_dir).quarantine(rejects_dir)
        raise e.with_advice(
            f"Move it aside: mkdir -p {where} && mv {e.path} {where}/ -- then run the stage again "
            "(a rejects part only lists rows left out: nothing trains on it)"
        ) from None
    except OSError as e:
        raise WriteFailed(rejects_dir, e, kept=kept, resume=RESUME) from None


def summarize_records(records_dir: Path) -> PartReport:
    """Totals of a dataset's records from part footers only; DamagedPart names a part it cannot read."""
    total = PartReport()
    for part in list_parts(records_dir):
        meta = _footer(part, REBUILD)
        try:
            total.add(PartReport.from_metadata(meta))
        except (KeyError, TypeError, ValueError) as e:
            raise DamagedPart(
                part,
                f"its footer has no valid records summary ({e!r}); records parts are written by eagle3 only",
                REBUILD,
            ) from None
    return total


GROUP_ROWS = 256  # rows read, converted and written at a time


class _ReadFailed(Exception):
    """The OS refused to read a source part: its error, told apart from a failed write of the records part."""

    def __init__(self, error: OSError) -> None:
        self.error = error


def _row_groups(path: Path, advice: str) -> Iterator[tuple[int, pa.Table]]:
    """(number of the first row, counted from 1; GROUP_ROWS rows) of a source part; DamagedPart, with `advice`, when
    it cannot be read."""
    try:
        with reading(path):
            batches = pq.ParquetFile(path).iter_batches(batch_size=GROUP_ROWS)
            first = 1
            while (batch := next(batches, None)) is not None:
                table = pa.Table.from_batches([batch])
                first += batch.num_rows
                yield first - batch.num_rows, table
    except DamagedPart as e:
        raise e.with_advice(advice) from None
    except OSError as e:
        raise _ReadFailed(e) from None


def _from_responses(table: pa.Table, settings: RecordsJob) -> tuple[list[dict], PartReport]:
    report = PartReport()
    rows: list[dict] = []
    columns = table.select(["id", "prompt_ids", "output_ids", "finish_reason"]).to_pylist()
    for r in columns:
        if not is_whole(r["output_ids"], r["finish_reason"], settings.stop_token_ids) and not settings.keep_truncated:
            report.drop(f"finish_{r['finish_reason']}")  # ended by length/abort: not a whole answer
            continue
        ids = r["prompt_ids"] + r["output_ids"]
        mask = [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])
        _keep(r["id"], ids, mask, settings, report, rows)
    return rows, report


def _from_passthrough(
    table: pa.Table, settings: RecordsJob, tokenizer: Any, source: Path, first_row: int = 1
) -> tuple[list[dict], PartReport, list[Reject]]:
    report = PartReport()
    rows: list[dict] = []
    rejects: list[Reject] = []
    for n, r in enumerate(table.to_pylist(), first_row):
        if r["messages"] is None:  # pre-tokenized: validate, take as is
            problem = _check_tokenized(r["input_ids"], r["loss_mask"], settings.vocab_size)
            if problem:
                report.drop("rejected")
                rejects.append(Reject(path=source, row=n, id=r["id"], reason=problem, raw=""))
                continue
            _keep(r["id"], r["input_ids"], r["loss_mask"], settings, report, rows)
            continue
        messages = json.loads(r["messages"])
        try:
            turns = conversation_records(r["id"], messages, tokenizer, on_rewrite=settings.on_rewrite)
        except MaskError as exc:
            report.drop("rejected")
            rejects.append(Reject(path=source, row=n, id=r["id"], reason=exc.reason, raw=r["messages"]))
            continue
        for turn in turns:
            _keep(turn.id, turn.input_ids, turn.loss_mask, settings, report, rows)
    return rows, report, rejects


def _check_tokenized(input_ids: list[int], loss_mask: list[int], vocab_size: int) -> str | None:
    if len(input_ids) != len(loss_mask):
        return f"input_ids has {len(input_ids)} tokens but loss_mask has {len(loss_mask)}; they must be equally long"
    bad = [t for t in input_ids if not 0 <= t < vocab_size]
    if bad:
        return (
            f"token id {bad[0]} is outside the target's vocabulary (0..{vocab_size - 1}); "
            "were these ids made with another tokenizer?"
        )
    if not any(loss_mask):
        return "loss_mask has no 1: nothing to train on"
    return None


def _keep(
    row_id: str, ids: list[int], mask: list[int], settings: RecordsJob, report: PartReport, rows: list[dict]
) -> None:
    """Apply max_seq_len and min_loss_tokens, then append the record (or count why not)."""
    truncated = False
    if settings.max_seq_len is not None and len(ids) > settings.max_seq_len:
        if settings.overflow == "drop":
            report.drop("too_long")
            return
        ids, mask, truncated = ids[: settings.max_seq_len], mask[: settings.max_seq_len], True
    loss = int(sum(mask))
    if loss < settings.min_loss_tokens:
        report.drop("few_loss_tokens")
        return
    rows.append(
        {
            "id": row_id,
            "input_ids": ids,
            "loss_mask": mask,
            "num_tokens": len(ids),
            "num_loss_tokens": loss,
            "truncated": truncated,
        }
    )
    report.records += 1
    report.tokens += len(ids)
    report.loss_tokens += loss
    report.truncated += truncated
    report.lengths.append(len(ids))


def count_tokens(records_dirs: Iterable[Path], out_path: Path, vocab_size: int) -> tuple[int, np.ndarray]:
    """Write per-token counts over loss-masked tokens of all records; return (total, counts by id)."""
    counts = np.zeros(vocab_size, dtype=np.int64)
    for directory in records_dirs:
        for part in list_parts(directory):
            table = _table(part, REBUILD, columns=["input_ids", "loss_mask"])
            ids = pc.list_flatten(table.column("input_ids")).to_numpy()
            mask = pc.list_flatten(table.column("loss_mask")).to_numpy().astype(bool)
            counts += np.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
    order = np.argsort(-counts, kind="stable")
    nonzero = order[counts[order] > 0]
    table = pa.table({"token_id": pa.array(nonzero, pa.int32()), "count": pa.array(counts[nonzero], pa.int64())})
    total = int(counts.sum())
    try:
        write_parquet_atomic(table, out_path, {f"{META}loss_tokens": total, f"{META}vocab_size": vocab_size})
    except OSError as e:
        raise WriteFailed(
            out_path, e, kept="every records part (complete; only the token counts are missing)", resume=RESUME
        ) from None
    return total, counts


def coverage(counts: np.ndarray, k: int) -> float:
    """Share of loss tokens whose token is among the `k` most frequent."""
    total = counts.sum()
    return float(np.sort(counts)[::-1][:k].sum() / total) if total else 0.0


def dataset_report(dataset: str, records_dir: Path) -> RecordsReport:
    """One dataset's data report from its records' footers only."""
    total = summarize_records(records_dir)
    lengths = sorted(total.lengths)
    return RecordsReport(
        dataset=dataset,
        records=total.records,
        tokens=total.tokens,
        loss_tokens=total.loss_tokens,
        truncated=total.truncated,
        dropped=total.dropped,
        rejects=total.dropped.get("rejected", 0),
        parts_built=0,
        p50_length=nearest_rank(lengths, 50) or 0,
        p95_length=nearest_rank(lengths, 95) or 0,
        max_length=lengths[-1] if lengths else 0,
    )


def record_stats(run_dir: Path, on_damaged: Callable[[str, DamagedPart], None] | None = None) -> list[RecordsReport]:
    """The data report of every dataset with records (footers only).

    A dataset with a damaged part raises DamagedPart, or with `on_damaged` is passed to it and left
    out, so a report of the others still comes out (`eagle3 stats`).
    """
    root = RunLayout(run_dir).records_root
    directories = sorted(p for p in root.iterdir() if p.is_dir()) if root.is_dir() else []
    reports = []
    for d in directories:
        try:
            reports.append(dataset_report(d.name, d))
        except DamagedPart as e:
            if on_damaged is None:
                raise
            on_damaged(d.name, e)
    return reports
