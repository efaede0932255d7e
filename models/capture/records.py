"""The records a capture reads and its plan: the samples (trimmed), the token cap, the deal over the ranks, the batches.

`load_records` reads the records parts as flat token arrays; `within_token_cap`, `deal` and `make_batches` are
deterministic, so every rank of models/capture/job.py computes the same plan. `make_batches` batches the training's
samples too (models/train/data.py).
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

import numpy as np

from models.common.file_errors import DamagedFile
from models.common.job_files import DatasetRecords

RECORDS_ADVICE = "Delete it and run the records stage again (it is rebuilt from its responses), then capture"


@dataclass(frozen=True, slots=True)
class Sample:
    """One record to capture: rows [start, start+length) of `part`'s flat arrays (already trimmed)."""

    dataset: str
    id: str
    part: int
    start: int
    length: int


@dataclass
class RecordPart:
    """A records part held as flat token arrays (row i starts at `Sample.start`)."""

    path: Path
    input_ids: np.ndarray  # int32 [tokens]
    loss_mask: np.ndarray  # uint8 [tokens]


def trimmed_length(loss_mask: np.ndarray) -> int:
    """Tokens up to and including the last loss token (0 when nothing is trained)."""
    nz = np.flatnonzero(loss_mask)
    return int(nz[-1]) + 1 if nz.size else 0


def load_records(
    datasets: list[DatasetRecords], vocab_size: int | None = None, *, keep_tokens: bool = True
) -> tuple[list[Sample], list[RecordPart], int]:
    """Every record with at least one loss token, trimmed; also the parts and how many had none.

    keep_tokens=False: every part is read and checked as before, one at a time, but its token arrays are not kept
    (empty): the plan needs only the samples, and `held` then reads the tokens of the samples a rank captures. A
    rank then holds its share of the records, not all of them (92M tokens are ~460 MB per rank)."""
    samples: list[Sample] = []
    parts: list[RecordPart] = []
    seen: dict[tuple[str, str], Path] = {}
    no_loss = 0
    for ds in datasets:
        records_dir = Path(ds.records_dir)
        if not records_dir.is_dir():
            raise FileNotFoundError(f"records of dataset {ds.name!r}: {records_dir} is not a directory")
        for path in sorted(records_dir.glob("part-*.parquet")):
            table = _read_records_part(path)
            ids = table.column("id").to_pylist()
            input_ids, id_starts = _flat_lists(table.column("input_ids"), path, "input_ids")
            loss_mask, mask_starts = _flat_lists(table.column("loss_mask"), path, "loss_mask")
            if not np.array_equal(np.diff(id_starts), np.diff(mask_starts)):
                row = int(np.flatnonzero(np.diff(id_starts) != np.diff(mask_starts))[0])
                raise ValueError(f"{path}: row {row} (id {ids[row]!r}): input_ids and loss_mask lengths differ")
            input_ids = input_ids.astype(np.int32, copy=False)
            loss_mask = (loss_mask != 0).astype(np.uint8)
            if input_ids.size and (input_ids.min() < 0 or (vocab_size is not None and input_ids.max() >= vocab_size)):
                bad = int(np.flatnonzero((input_ids < 0) | (input_ids >= (vocab_size or np.iinfo(np.int32).max)))[0])
                row = int(np.searchsorted(id_starts, bad, side="right") - 1)
                raise ValueError(
                    f"{path}: row {row} (id {ids[row]!r}): token id {int(input_ids[bad])} "
                    f"outside the target vocab [0, {vocab_size})"
                )
            part = len(parts)
            if keep_tokens:
                parts.append(RecordPart(path, input_ids, loss_mask))
            else:
                parts.append(RecordPart(path, _NO_TOKENS.astype(np.int32), _NO_TOKENS))
            for row, sample_id in enumerate(ids):
                if sample_id is None:
                    raise ValueError(f"{path}: row {row}: id is null")
                key = (ds.name, sample_id)
                if key in seen:
                    raise ValueError(
                        f"dataset {ds.name!r}: id {sample_id!r} in both {seen[key]} and {path} (row {row})"
                    )
                seen[key] = path
                start, end = int(id_starts[row]), int(id_starts[row + 1])
                n = trimmed_length(loss_mask[start:end])
                if n == 0:
                    no_loss += 1
                    continue
                samples.append(Sample(ds.name, sample_id, part, start, n))
    return samples, parts, no_loss


_NO_TOKENS = np.empty(0, np.uint8)


def held(samples: list[Sample], parts: list[RecordPart]) -> tuple[list[Sample], list[RecordPart]]:
    """`samples` (in their order) with their tokens: each part they come from is read again and only their rows are
    kept, packed one after the other; the samples point into the new parts. Memory: the samples' tokens, plus one
    part while it is read."""
    by_part: dict[int, list[int]] = {}
    for k, s in enumerate(samples):
        by_part.setdefault(s.part, []).append(k)
    out: list[Sample | None] = [None] * len(samples)
    kept: list[RecordPart] = []
    for index in sorted(by_part):
        path = parts[index].path
        table = _read_records_part(path)
        input_ids, _ = _flat_lists(table.column("input_ids"), path, "input_ids")
        loss_mask, _ = _flat_lists(table.column("loss_mask"), path, "loss_mask")
        del table
        ranges = [(samples[k].start, samples[k].start + samples[k].length) for k in by_part[index]]
        take = np.concatenate([np.arange(a, b) for a, b in ranges]) if ranges else np.empty(0, np.int64)
        new = len(kept)
        kept.append(RecordPart(path, input_ids[take].astype(np.int32), (loss_mask[take] != 0).astype(np.uint8)))
        start = 0
        for k in by_part[index]:
            s = samples[k]
            out[k] = Sample(s.dataset, s.id, new, start, s.length)
            start += s.length
    return [s for s in out if s is not None], kept


def _read_records_part(path: Path) -> Any:
    """The id, input_ids and loss_mask columns of one records part; DamagedFile if it cannot be read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.read_table(path, columns=["id", "input_ids", "loss_mask"])
    except (pa.ArrowException, OSError) as e:
        if isinstance(e, OSError) and e.errno is not None:  # the OS refused (permissions, I/O): not damage
            raise
        try:
            size = f"{path.stat().st_size:,} bytes"
        except OSError:
            size = "size unknown"
        text = (str(e).splitlines() or [type(e).__name__])[0]
        if text.startswith("Could not open"):  # "Could not open Parquet input source '<path>': <what>"
            text = text.split("': ", 1)[-1]
        raise DamagedFile(path, f"{size}, not a readable Parquet file: {text}", RECORDS_ADVICE) from None


def _flat_lists(column: Any, path: Path, name: str) -> tuple[np.ndarray, np.ndarray]:
    """A list column as (flat values, row starts with a final end), rebased to 0."""
    arr = column.combine_chunks() if hasattr(column, "combine_chunks") else column
    if arr.null_count:
        raise ValueError(f"{path}: column {name} has {arr.null_count} null rows")
    offsets = arr.offsets.to_numpy()
    values = arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    return values, offsets - offsets[0]


def within_token_cap(pending: list[Sample], budget: int | None) -> list[Sample]:
    """The samples this launch captures under `budget` tokens: a prefix in a stable hash order of (dataset, id).

    The hash order mixes datasets and lengths (a length order would keep only short or long ones),
    and it is the same on every resume: given the overall cap minus the tokens earlier launches
    captured, a killed capture continues with exactly the samples it would have taken anyway.
    """
    if budget is None:
        return pending
    chosen, used = [], 0
    for s in sorted(pending, key=lambda s: hashlib.sha256(f"{s.dataset}\0{s.id}".encode()).digest()):
        if used + s.length > budget:
            break
        chosen.append(s)
        used += s.length
    return chosen


def deal(samples: list[Sample], world_size: int) -> list[list[Sample]]:
    """Split samples over ranks with balanced token counts; each share comes out longest first."""
    shares: list[list[Sample]] = [[] for _ in range(world_size)]
    loads = [(0, r) for r in range(world_size)]  # (tokens so far, rank): ties go to the lower rank
    for s in sorted(samples, key=lambda s: (-s.length, s.dataset, s.id)):
        tokens, r = heapq.heappop(loads)
        shares[r].append(s)
        heapq.heappush(loads, (tokens + s.length, r))
    return shares


class _HasLength(Protocol):
    @property
    def length(self) -> int: ...


SampleT = TypeVar("SampleT", bound=_HasLength)  # a capture Sample, or models/train/data.py's TrainSample


def make_batches(samples: list[SampleT], max_batch_tokens: int) -> list[list[SampleT]]:
    """Group longest-first samples so that batch size x longest length <= max_batch_tokens."""
    batches: list[list[SampleT]] = []
    current: list[SampleT] = []
    for s in samples:
        if current and current[0].length * (len(current) + 1) > max_batch_tokens:
            batches.append(current)
            current = []
        current.append(s)
    if current:
        batches.append(current)
    return batches
