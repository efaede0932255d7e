"""Response checkpoints: atomic parts, footer summaries, resume by id, crash-safe compaction."""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from tasks.responses import checkpoints
from tasks.responses.checkpoints import (
    META,
    PartSummary,
    ResponseWriter,
    compact,
    done_ids,
    finish_compaction,
    live_parts,
    responses_table,
    summarize,
    write_part,
)
from tasks.responses.parquet_io import list_parts, read_metadata


def row(i: int, n: int = 3, reason: str = "stop") -> dict:
    return {
        "id": f"p{i}",
        "prompt_ids": [1, 2, i],
        "output_ids": list(range(n)),
        "prompt_tokens": 3,
        "completion_tokens": n,
        "finish_reason": reason,
        "text": "x" * n,
        "latency": 0.5,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "finished_at": 1000.0 + i,
    }


def test_part_footer_holds_the_summary(tmp_path):
    path = write_part(tmp_path, responses_table([row(1, 5), row(2, 7, "length"), row(3, 2)]))
    meta = read_metadata(path)
    assert meta[f"{META}rows"] == "3"
    assert meta[f"{META}completion_tokens"] == "14"
    summary = PartSummary.from_metadata(meta)
    assert summary.finish_reasons == {"stop": 2, "length": 1}
    assert summary.lengths == [5, 7, 2]
    assert (summary.first_finished_at, summary.last_finished_at) == (1001.0, 1003.0)
    table = pq.read_table(path)
    assert table.schema.field("prompt_ids").type.value_type.bit_width == 32
    assert table.column("output_ids").to_pylist()[1] == list(range(7))


def test_summarize_and_done_ids_over_parts(tmp_path):
    write_part(tmp_path, responses_table([row(i, 10) for i in range(5)]))
    write_part(tmp_path, responses_table([row(i, 20) for i in range(5, 8)]))
    total = summarize(tmp_path)
    assert (total.rows, total.completion_tokens) == (8, 5 * 10 + 3 * 20)
    assert done_ids(tmp_path) == {f"p{i}" for i in range(8)}
    assert done_ids(tmp_path / "missing") == set()


def test_compaction_merges_without_double_counting(tmp_path):
    for k in range(6):
        write_part(tmp_path, responses_table([row(10 * k + j) for j in range(4)]))
    merged = compact(tmp_path, min_parts=4)
    assert merged is not None
    assert live_parts(tmp_path) == [merged]
    assert summarize(tmp_path).rows == 24
    assert sorted(done_ids(tmp_path)) == sorted(f"p{10 * k + j}" for k in range(6) for j in range(4))
    assert compact(tmp_path, min_parts=4) is None  # one part left: nothing to merge


def test_a_merged_part_is_not_merged_again_so_each_row_is_rewritten_once(tmp_path):
    """The writer compacts every min_parts flushes. Were the last merge taken into the next one, every compaction
    would rewrite all earlier rows (bytes in the square of the rows over a long run); each row is merged once."""
    merges = []
    for k in range(12):
        write_part(tmp_path, responses_table([row(10 * k + j) for j in range(2)]))
        if (k + 1) % 4 == 0:
            merges.append(compact(tmp_path, min_parts=4))
    assert all(m is not None for m in merges)
    assert live_parts(tmp_path) == merges  # the first merge is still on disk, untouched, beside the later ones
    rows = [int(read_metadata(m)[f"{META}rows"]) for m in merges]
    assert rows == [8, 8, 8] and summarize(tmp_path).rows == 24
    assert sorted(done_ids(tmp_path)) == sorted(f"p{10 * k + j}" for k in range(12) for j in range(2))


def test_crash_between_merge_and_delete_is_invisible_and_finished(tmp_path, monkeypatch):
    for k in range(4):
        write_part(tmp_path, responses_table([row(10 * k + j) for j in range(3)]))
    originals = list_parts(tmp_path)

    def crash(self, missing_ok=False):
        raise KeyboardInterrupt("killed after the merged part was renamed")

    monkeypatch.setattr(checkpoints.Path, "unlink", crash)
    with pytest.raises(KeyboardInterrupt):
        compact(tmp_path, min_parts=4)
    monkeypatch.undo()
    assert len(list_parts(tmp_path)) == 5  # 4 originals + the merged one on disk
    assert summarize(tmp_path).rows == 12  # ... but every response counts once
    assert len(done_ids(tmp_path)) == 12
    removed = finish_compaction(tmp_path)
    assert sorted(removed) == sorted(originals)
    assert len(list_parts(tmp_path)) == 1


def test_writer_flushes_by_count_and_by_time(tmp_path):
    async def scenario():
        writer = ResponseWriter(tmp_path, flush_every=3, flush_interval_s=3600)
        for i in range(7):
            writer.add(row(i))
            await writer.maybe_flush()
        assert len(list_parts(tmp_path)) == 2 and writer.pending == 1
        writer.flush_interval_s = 0.0  # the oldest buffered row is now "too old"
        assert writer.due()
        await writer.maybe_flush()
        assert writer.pending == 0
        assert await writer.flush() is None  # nothing left

    asyncio.run(scenario())
    assert summarize(tmp_path).rows == 7


def test_failed_flush_keeps_the_rows(tmp_path, monkeypatch):
    async def scenario():
        writer = ResponseWriter(tmp_path, flush_every=100)
        writer.add(row(1))
        writer.add(row(2))

        def disk_full(*a, **k):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(checkpoints, "write_part", disk_full)
        with pytest.raises(OSError):
            await writer.flush()
        assert writer.pending == 2
        monkeypatch.undo()
        await writer.flush()

    asyncio.run(scenario())
    assert done_ids(tmp_path) == {"p1", "p2"}


def test_writer_start_cleans_temp_files_and_unfinished_compaction(tmp_path):
    write_part(tmp_path, responses_table([row(1)]))
    (tmp_path / ".part-000009.parquet.123-abc.tmp").write_bytes(b"partial")
    ResponseWriter(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["part-000000.parquet"]
    assert json.loads(read_metadata(list_parts(tmp_path)[0])[f"{META}lengths"]) == [3]


def test_a_flush_cancelled_while_its_part_is_written_records_each_row_once(tmp_path, monkeypatch):
    """The generate loop cancels its flush timer when the run ends; the part its thread was writing still lands.

    The write runs in a worker thread that a cancellation cannot stop: the buffer must say what is
    on disk (those rows written), not put them back to be written a second time by the final flush.
    """
    import threading

    started, release = threading.Event(), threading.Event()
    real = checkpoints.write_part

    def slow_write(*args, **kwargs):
        started.set()
        release.wait(10)
        return real(*args, **kwargs)

    async def scenario():
        writer = ResponseWriter(tmp_path, flush_every=100)
        writer.add(row(1))
        writer.add(row(2))
        monkeypatch.setattr(checkpoints, "write_part", slow_write)
        timer = asyncio.create_task(writer.flush())
        await asyncio.to_thread(started.wait, 10)
        timer.cancel()  # mid-write, as generate's `finally: timer.cancel()`
        writer.add(row(3))
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await timer
        monkeypatch.undo()
        await writer.flush()  # the final flush of close()

    asyncio.run(scenario())
    ids = [r for p in live_parts(tmp_path) for r in pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    assert sorted(ids) == ["p1", "p2", "p3"]


def test_a_compaction_cancelled_mid_merge_finishes_before_the_next_part_is_numbered(tmp_path, monkeypatch):
    """A cancelled flush must not free the writer while its merge thread still runs: the next part would be
    numbered from a directory the merge has not renamed into yet, take the merged part's name, and be overwritten."""
    import threading

    merging, release, numbered_meanwhile = threading.Event(), threading.Event(), threading.Event()
    real_write, real_next = checkpoints.write_parquet_atomic, checkpoints.next_part_path

    def slow_merge(table, path, metadata=None, **kw):
        if metadata and f"{META}replaces" in metadata:  # the merged part: its name is chosen, not yet renamed
            merging.set()
            release.wait(10)
        return real_write(table, path, metadata, **kw)

    def next_part(directory):
        if merging.is_set() and not release.is_set():
            numbered_meanwhile.set()
        return real_next(directory)

    async def scenario():
        writer = ResponseWriter(tmp_path, flush_every=1, compact_min_parts=2)
        writer.add(row(1))
        await writer.flush()
        monkeypatch.setattr(checkpoints, "write_parquet_atomic", slow_merge)
        monkeypatch.setattr(checkpoints, "next_part_path", next_part)
        writer.add(row(2))
        flushing = asyncio.create_task(writer.flush())  # the 2nd part, then its merge, which waits
        await asyncio.to_thread(merging.wait, 10)
        flushing.cancel()
        writer.add(row(3))
        nxt = asyncio.create_task(writer.flush())  # must wait for the merge, not number its part meanwhile
        # bounded wait: a writer that raced the merge numbers its part within it; a correct one never does
        await asyncio.to_thread(numbered_meanwhile.wait, 1.0)
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await flushing
        await nxt

    asyncio.run(scenario())
    assert not numbered_meanwhile.is_set()
    ids = [r for p in live_parts(tmp_path) for r in pq.read_table(p, columns=["id"]).column("id").to_pylist()]
    assert sorted(ids) == ["p1", "p2", "p3"]
