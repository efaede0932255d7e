"""Response checkpoints: atomic parts, footer summaries, resume by id, crash-safe compaction."""

from __future__ import annotations

import asyncio
import json

import pyarrow.parquet as pq
import pytest

from tasks import checkpoints
from tasks.checkpoints import (
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
from tasks.parquet_io import list_parts, read_metadata


def row(i: int, n: int = 3, reason: str = "stop") -> dict:
    return {
        "id": f"p{i}", "prompt_ids": [1, 2, i], "output_ids": list(range(n)), "prompt_tokens": 3,
        "completion_tokens": n, "finish_reason": reason, "text": "x" * n, "latency": 0.5,
        "cached_tokens": 0, "reasoning_tokens": 0, "finished_at": 1000.0 + i,
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
