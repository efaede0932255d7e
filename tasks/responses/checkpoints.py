"""Generation checkpoints: responses as atomic Parquet parts, resumable by prompt id.

`RUN_DIR/responses/<dataset>/part-*.parquet` holds every finished response of a dataset. Each
part's footer carries the figures that resume and `eagle3 stats` need (rows, token sums, finish
reasons, the completion lengths), so neither has to read row data: resume reads only the `id`
column, stats only footers.

Compaction merges many small parts into one without ever exposing a partial file and without a
moment where a reader could count a response twice: the merged part lists the parts it replaces in
its footer (`eagle3.replaces`), and readers skip replaced parts until they are deleted.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from settings.layout import RunLayout
from tasks.responses.parquet_io import (
    DamagedPart,
    clean_stale_temps,
    list_parts,
    next_part_path,
    read_metadata,
    reading,
    write_parquet_atomic,
)
from tasks.responses.tallies import add_counts
from tasks.responses.turn_ids import is_later_turn, split_turn_id
from tasks.runtime.threads import run_to_the_end

RESPONSE_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("prompt_ids", pa.list_(pa.int32())),
        ("output_ids", pa.list_(pa.int32())),
        ("prompt_tokens", pa.int32()),
        ("completion_tokens", pa.int32()),
        ("finish_reason", pa.string()),
        ("text", pa.string()),
        ("latency", pa.float64()),  # seconds from send to answer, as the client saw it
        ("cached_tokens", pa.int32()),
        ("reasoning_tokens", pa.int32()),
        ("finished_at", pa.float64()),  # unix time the answer arrived
    ]
)

META = "eagle3."  # prefix of our footer keys


@dataclass
class PartSummary:
    """What one part's footer says about its responses."""

    rows: int = 0
    completion_tokens: int = 0
    prompt_tokens: int = 0
    finish_reasons: dict[str, int] = field(default_factory=dict)
    lengths: list[int] = field(default_factory=list)  # completion tokens per response
    first_finished_at: float | None = None
    last_finished_at: float | None = None
    later_turns: int = 0  # responses to a conversation's turn after its first (tasks.responses.turn_ids)

    @property
    def conversations(self) -> int:
        """Conversations with a response: each has its first turn on disk, or is a single prompt."""
        return self.rows - self.later_turns

    def add(self, other: PartSummary) -> None:
        add_counts(self, other)
        firsts = [t for t in (self.first_finished_at, other.first_finished_at) if t is not None]
        lasts = [t for t in (self.last_finished_at, other.last_finished_at) if t is not None]
        self.first_finished_at = min(firsts) if firsts else None
        self.last_finished_at = max(lasts) if lasts else None

    @classmethod
    def of_table(cls, table: pa.Table) -> PartSummary:
        lengths = table.column("completion_tokens").to_pylist()
        reasons: dict[str, int] = {}
        for reason in table.column("finish_reason").to_pylist():
            reasons[reason] = reasons.get(reason, 0) + 1
        finished = [t for t in table.column("finished_at").to_pylist() if t is not None]
        return cls(
            rows=table.num_rows,
            completion_tokens=sum(lengths),
            prompt_tokens=sum(table.column("prompt_tokens").to_pylist()),
            finish_reasons=reasons,
            lengths=lengths,
            first_finished_at=min(finished) if finished else None,
            last_finished_at=max(finished) if finished else None,
            later_turns=sum(map(is_later_turn, table.column("id").to_pylist())),
        )

    def to_metadata(self) -> dict[str, str]:
        return {
            f"{META}rows": str(self.rows),
            f"{META}completion_tokens": str(self.completion_tokens),
            f"{META}prompt_tokens": str(self.prompt_tokens),
            f"{META}finish_reasons": json.dumps(self.finish_reasons, sort_keys=True),
            f"{META}lengths": json.dumps(self.lengths, separators=(",", ":")),
            f"{META}first_finished_at": json.dumps(self.first_finished_at),
            f"{META}last_finished_at": json.dumps(self.last_finished_at),
            f"{META}later_turns": str(self.later_turns),
        }

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> PartSummary:
        return cls(
            rows=int(meta[f"{META}rows"]),
            completion_tokens=int(meta[f"{META}completion_tokens"]),
            prompt_tokens=int(meta[f"{META}prompt_tokens"]),
            finish_reasons=json.loads(meta[f"{META}finish_reasons"]),
            lengths=json.loads(meta[f"{META}lengths"]),
            first_finished_at=json.loads(meta[f"{META}first_finished_at"]),
            last_finished_at=json.loads(meta[f"{META}last_finished_at"]),
            later_turns=int(meta.get(f"{META}later_turns", "0")),  # parts from before multi-turn: single turns
        )


def responses_table(rows: Iterable[dict[str, Any]]) -> pa.Table:
    """Rows (dicts with RESPONSE_SCHEMA's columns) as a table in that schema."""
    rows = list(rows)
    return pa.Table.from_pylist(rows, schema=RESPONSE_SCHEMA)


def write_part(directory: Path, table: pa.Table, *, replaces: list[str] | None = None) -> Path:
    """Write `table` as the next part of `directory`, its summary in the footer."""
    meta = PartSummary.of_table(table).to_metadata()
    if replaces:
        meta[f"{META}replaces"] = json.dumps(replaces)
    return write_parquet_atomic(table, next_part_path(directory), meta)


def live_parts(directory: Path) -> list[Path]:
    """Parts that count: complete ones not replaced by a complete compacted part."""
    parts = list_parts(directory)
    replaced: set[str] = set()
    for part in parts:
        listed = read_metadata(part).get(f"{META}replaces")
        if listed:
            replaced.update(json.loads(listed))
    return [p for p in parts if p.name not in replaced]


def finish_compaction(directory: Path) -> list[Path]:
    """Delete parts that a complete compacted part replaces (left behind by a crash); return them."""
    live = set(live_parts(directory))
    stale = [p for p in list_parts(directory) if p not in live]
    for p in stale:
        p.unlink(missing_ok=True)
    return stale


def summarize(directory: Path) -> PartSummary:
    """Totals of a dataset's responses from part footers only."""
    total = PartSummary()
    for part in live_parts(directory):
        total.add(part_summary(part))
    return total


def part_summary(part: Path) -> PartSummary:
    """The summary in one part's footer; DamagedPart when the file or its summary cannot be read."""
    meta = read_metadata(part)
    try:
        return PartSummary.from_metadata(meta)
    except (KeyError, ValueError, TypeError) as exc:
        raise DamagedPart(
            part, f"its footer has no valid eagle3 summary ({exc!r}); response parts are written by eagle3 only"
        ) from None


def is_whole(output_ids: list[int], finish_reason: str, stop_ids: Iterable[int]) -> bool:
    """A whole answer: the server said `stop`, or `length` with a stop id last (SGLang 0.4 checks the length cap
    before the stop token; models.common.jobs.RecordsJob.stop_token_ids). Records keep only these (unless
    records.keep_truncated), and with turns: all only these are followed by the next turn."""
    if finish_reason == "stop":
        return True
    return finish_reason == "length" and bool(output_ids) and output_ids[-1] in set(stop_ids)


def turn_finishes(directory: Path) -> dict[str, tuple[int | None, str]]:
    """(last output id, finish_reason) of every response on disk whose id names a conversation's turn
    (tasks.generate.conversations): what a `turns: all` dataset needs to know where each conversation stands
    (`is_whole`). The answers' tokens are not read (`turn_answers` reads those a resume continues from)."""
    import pyarrow.compute as pc

    out: dict[str, tuple[int | None, str]] = {}
    for part in live_parts(directory):
        with reading(part):
            table = pq.read_table(part, columns=["id", "output_ids", "finish_reason"])
        lengths = pc.list_value_length(table["output_ids"]).to_numpy(zero_copy_only=False)
        flat = pc.list_flatten(table["output_ids"]).to_numpy(zero_copy_only=False)
        ends = lengths.cumsum()
        reasons = table["finish_reason"].to_pylist()
        for row, rid in enumerate(table["id"].to_pylist()):
            if split_turn_id(rid) is not None:
                out[rid] = (int(flat[ends[row] - 1]) if lengths[row] else None, reasons[row])
    return out


def turn_answers(directory: Path, ids: set[str]) -> dict[str, list[int]]:
    """The output_ids of the responses named in `ids`, read only for those rows."""
    import pyarrow.compute as pc

    out: dict[str, list[int]] = {}
    if not ids:
        return out
    wanted = pa.array(sorted(ids), pa.string())
    for part in live_parts(directory):
        with reading(part):
            table = pq.read_table(part, columns=["id", "output_ids"])
        table = table.filter(pc.is_in(table["id"], value_set=wanted))
        out.update(zip(table["id"].to_pylist(), table["output_ids"].to_pylist()))
    return out


def done_ids(directory: Path) -> set[str]:
    """Ids of every response (or reject) already on disk, reading only the `id` column."""
    ids: set[str] = set()
    for part in live_parts(directory):
        with reading(part):
            ids.update(pq.read_table(part, columns=["id"]).column("id").to_pylist())
    return ids


def compact(directory: Path, *, min_parts: int = 16, max_rows: int = 50_000) -> Path | None:
    """Merge the leading run of small parts into one part; None if fewer than `min_parts` qualify.

    Only parts below `max_rows` rows are merged and the merged part stays below it, so the work
    per compaction is bounded and large parts are never rewritten. A part that is itself a merge is
    never merged again: the writer compacts every `min_parts` flushes, and a merged part taken into
    the next merge would be rewritten each time, all of a dataset's rows again and again over a long
    run whose parts trickle in by time (a part per flush_interval_s), bytes in the square of the rows.
    """
    chosen: list[Path] = []
    rows = 0
    for part in live_parts(directory):
        meta = read_metadata(part)
        n = int(meta.get(f"{META}rows", "0"))
        if n >= max_rows or rows + n > max_rows or f"{META}replaces" in meta:
            if len(chosen) >= min_parts:
                break
            chosen, rows = [], 0
            continue
        chosen.append(part)
        rows += n
    if len(chosen) < min_parts:
        return None
    tables = []
    for p in chosen:
        with reading(p):
            tables.append(pq.read_table(p, schema=RESPONSE_SCHEMA))
    table = pa.concat_tables(tables)
    merged = write_part(directory, table, replaces=[p.name for p in chosen])
    for part in chosen:  # after the merged part is durable; a crash here is finished by finish_compaction
        part.unlink(missing_ok=True)
    return merged


class ResponseWriter:
    """Buffers finished responses and flushes them as parts every `flush_every` rows or `flush_interval_s`.

    A kill loses at most the unflushed buffer, which resume then regenerates: those prompts are
    not in any part, so they are not done.
    """

    def __init__(
        self, directory: Path, *, flush_every: int = 256, flush_interval_s: float = 60.0, compact_min_parts: int = 64
    ):
        self.directory = Path(directory)
        self.flush_every = flush_every
        self.flush_interval_s = flush_interval_s
        self.compact_min_parts = compact_min_parts
        self._buffer: list[dict[str, Any]] = []
        self._oldest: float | None = None
        self._lock = asyncio.Lock()
        self.parts_written = 0
        clean_stale_temps(self.directory)
        finish_compaction(self.directory)

    def add(self, row: dict[str, Any]) -> None:
        if not self._buffer:
            self._oldest = time.monotonic()
        self._buffer.append(row)

    @property
    def pending(self) -> int:
        return len(self._buffer)

    def due(self) -> bool:
        if not self._buffer:
            return False
        return len(self._buffer) >= self.flush_every or time.monotonic() - (self._oldest or 0) >= self.flush_interval_s

    async def maybe_flush(self) -> None:
        if self.due():
            await self.flush()

    async def flush(self) -> Path | None:
        """Write the buffer as one part (off the event loop); None when there is nothing to write."""
        async with self._lock:
            if not self._buffer:
                return None
            rows, oldest = self._buffer, self._oldest
            self._buffer, self._oldest = [], None
            try:  # to the end even when cancelled: the buffer must say what is on disk
                path, cancelled = await run_to_the_end(write_part, self.directory, responses_table(rows))
            except BaseException:
                # e.g. a full disk: keep the rows so a later flush (or the final one) can retry
                self._buffer, self._oldest = rows + self._buffer, oldest
                raise
            self.parts_written += 1
            if self.parts_written % self.compact_min_parts == 0:  # under the lock until the merge is renamed
                _, stopped = await run_to_the_end(compact, self.directory, min_parts=self.compact_min_parts)
                cancelled = cancelled or stopped
            if cancelled:
                raise asyncio.CancelledError
            return path


def quarantine_advice(part: Path, responses_dir: Path) -> str:
    """What to do about a damaged part of `responses_dir` or of its rejects: move it aside
    (never deleted for the user), run again."""
    where = RunLayout.of_dataset_dir(responses_dir).quarantine(part.parent)
    held = "responses" if part.parent == Path(responses_dir) else "rejects"
    return (
        f"Nothing was sent. Parts are written whole (temp file, fsync, rename), so this one was damaged later "
        f"(a disk fault, a partial copy, an edit). Move it aside: mkdir -p {where} && mv {part} {where}/ "
        f"-- then run again: the prompts whose {held} it held are generated (or checked) again, exactly once"
    )
