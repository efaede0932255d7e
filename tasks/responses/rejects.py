"""Rejected rows and prompts: RUN_DIR/rejects/<dataset>/part-*.parquet, each with its cause.

A reject is kept only while its cause may still hold, so that a fix is picked up by the next
run, exactly once:

  bad_row   a dataset row that failed validation at load. The rejects of the LATEST load replace
            the earlier ones: a row fixed in the file is simply a good row on the next run.
  too_long  a prompt over the server's context (our check against max_req_input_len, or the
            server's own 400 saying so). Checked again on every run: after the server's context
            grows, the prompt is generated.
  refused   the server answered 400 for another reason. Skipped on later runs (sending it again
            would fail the same way) unless the user asks: `eagle3 generate --retry-rejects`.
  aborted   the server aborted the request on its own more than generate.max_requeues times
            (a restart, an operator's abort, a timeout of its own). Checked again on every run.
  bad_line  a line `eagle3 import-jsonl --on-bad-line skip` could not adopt. An import of the same
            file replaces them: a line fixed in the file is imported and no longer listed.
  record    a finished conversation the records stage could not mask (kept as a record).

Parts are replaced the way response parts are compacted: the new part lists the parts it
replaces in its footer (`eagle3.replaces`), readers skip those (tasks.responses.checkpoints.live_parts),
and they are deleted after the new part is durable. Each part's footer counts its rows by cause,
so `eagle3 stats` reads footers only.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tasks.datasets import Reject
from tasks.responses.checkpoints import META, live_parts
from tasks.responses.parquet_io import next_part_path, read_metadata, write_parquet_atomic

CAUSES = ("bad_row", "too_long", "refused", "aborted", "bad_line", "record")
RETRIED_EVERY_RUN = ("too_long", "aborted")  # a generate-stage cause that a later run checks again on its own
STAGE_CAUSE = {"load": "bad_row", "import": "bad_line", "records": "record"}
# SGLang's words for a prompt over its limits (0.4.x and 0.5.23): the tokenizer manager's "The input (N tokens)
# is longer than the model's context length", "Requested token count exceeds the model's maximum context length",
# and the scheduler's "Input length (N tokens) exceeds the maximum allowed length (M tokens)" (max_req_input_len).
TOO_LONG_PHRASES = ("context length", "longer than", "max_req_input_len", "exceeds the maximum allowed length")

REJECTS_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=True),
        pa.field("source", pa.string()),
        pa.field("row", pa.int64()),
        pa.field("stage", pa.string()),
        pa.field("cause", pa.string()),
        pa.field("reason", pa.string()),
        pa.field("raw", pa.string()),
    ]
)
CAUSES_KEY = f"{META}causes"


def says_too_long(message: str) -> bool:
    """Whether a server's refusal says the prompt is over its context (a bigger server may take it later)."""
    text = message.lower()
    return any(phrase in text for phrase in TOO_LONG_PHRASES)


def reject_cause(stage: str, reason: str) -> str:
    """The cause of a reject written without one (parts from before causes were stored)."""
    if stage in STAGE_CAUSE:
        return STAGE_CAUSE[stage]
    if says_too_long(reason):
        return "too_long"
    return "refused"


def write_rejects(
    rejects: list[Reject], directory: Path | str, stage: str = "load", *, replaces: Iterable[Path] = ()
) -> Path | None:
    """Write rejects as one atomic part in `directory`; None when there are none.

    Idempotent across resumes: if a live part with the same stage and the same rejects exists
    already (compared by a fingerprint in the footer), that part is returned instead. Parts in
    `replaces` stop counting once the new part is written, and are then deleted.
    """
    directory = Path(directory)
    replaced = [Path(p) for p in replaces]
    if not rejects:
        _delete(replaced)
        return None
    causes = [r.cause or reject_cause(stage, r.reason) for r in rejects]
    fingerprint = hashlib.sha256(
        json.dumps(
            [[str(r.path), r.row, r.id, c, r.reason] for r, c in zip(rejects, causes)], ensure_ascii=False
        ).encode("utf-8", "surrogatepass")
    ).hexdigest()[:16]
    for part in live_parts(directory):
        meta = read_metadata(part)
        if meta.get("stage") == stage and meta.get("rejects_fingerprint") == fingerprint:
            _delete([p for p in replaced if p != part])
            return part
    table = pa.table(
        {
            "id": [r.id for r in rejects],
            "source": [str(r.path) for r in rejects],
            "row": [r.row for r in rejects],
            "stage": [stage] * len(rejects),
            "cause": causes,
            "reason": [_utf8(r.reason) for r in rejects],
            "raw": [_utf8(r.raw) for r in rejects],
        },
        schema=REJECTS_SCHEMA,
    )
    counts: dict[str, int] = {}
    for cause in causes:
        counts[cause] = counts.get(cause, 0) + 1
    footer = {
        "stage": stage,
        "rows": len(rejects),
        "rejects_fingerprint": fingerprint,
        CAUSES_KEY: json.dumps(counts, sort_keys=True),
    }
    if replaced:
        footer[f"{META}replaces"] = json.dumps([p.name for p in replaced])
    part = write_parquet_atomic(table, next_part_path(directory), metadata=footer)
    _delete(replaced)
    return part


def replace_stage_rejects(rejects: list[Reject], directory: Path | str, stage: str) -> Path | None:
    """The rejects of this run's `stage` (e.g. "load") become the only ones of that stage."""
    old = [p for p in live_parts(Path(directory)) if read_metadata(p).get("stage") == stage]
    return write_rejects(rejects, directory, stage, replaces=old)


def read_rejects(directory: Path | str) -> list[dict]:
    """Every live reject row, with its cause (derived for parts written before causes were stored)."""
    rows: list[dict] = []
    for part in live_parts(Path(directory)):
        table = pq.read_table(part)
        for row in table.to_pylist():
            row.setdefault("cause", None)
            row["cause"] = row["cause"] or reject_cause(row["stage"], row["reason"])
            rows.append(row)
    return rows


def settle_generate_rejects(directory: Path | str, responded: set[str], *, retry_refused: bool) -> set[str]:
    """Before a generate run: keep only the prompt rejects that still stand; return their ids.

    Rejects whose cause may be gone (too_long; refused too with `retry_refused`), or whose prompt
    has a response by now, are dropped from the rejects so that this run sends them again and
    records them once, as a response or as a fresh reject.
    """
    directory = Path(directory)
    parts = [p for p in live_parts(directory) if read_metadata(p).get("stage") == "generate"]
    if not parts:
        return set()
    kept, total = [], 0
    for part in parts:
        for row in pq.read_table(part).to_pylist():
            total += 1
            cause = row.get("cause") or reject_cause("generate", row["reason"])
            if cause in RETRIED_EVERY_RUN or (retry_refused and cause == "refused") or row["id"] in responded:
                continue
            kept.append(Reject(Path(row["source"]), row["row"], row["id"], row["reason"], row["raw"], cause=cause))
    if len(kept) < total:
        write_rejects(kept, directory, "generate", replaces=parts)
    return {r.id for r in kept if r.id is not None}


def reject_counts(directory: Path | str) -> dict[str, int]:
    """Live rejects by cause, from footers (rows are read only for parts without the counts)."""
    counts: dict[str, int] = {}
    for part in live_parts(Path(directory)):
        meta = read_metadata(part)
        if CAUSES_KEY in meta:
            part_counts = json.loads(meta[CAUSES_KEY])
        else:
            table = pq.read_table(part, columns=["stage", "reason"])
            part_counts = {}
            for stage, reason in zip(table.column("stage").to_pylist(), table.column("reason").to_pylist()):
                cause = reject_cause(stage, reason)
                part_counts[cause] = part_counts.get(cause, 0) + 1
        for cause, n in part_counts.items():
            counts[cause] = counts.get(cause, 0) + int(n)
    return dict(sorted(counts.items()))


def _delete(parts: list[Path]) -> None:
    for part in parts:  # after the new part is durable: a crash here leaves parts that readers skip
        part.unlink(missing_ok=True)


def _utf8(text: str) -> str:
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace").decode("utf-8")
