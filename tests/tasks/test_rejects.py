"""Rejects keep their cause; the ones whose cause may be gone come back on the next run, once."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa

from tasks.datasets import Reject
from tasks.responses.checkpoints import live_parts
from tasks.responses.parquet_io import next_part_path, write_parquet_atomic
from tasks.responses.rejects import (
    read_rejects,
    reject_counts,
    replace_stage_rejects,
    settle_generate_rejects,
    write_rejects,
)


def rejects(*ids: str, cause: str | None = None, reason: str = "bad") -> list[Reject]:
    return [Reject(Path("b1.jsonl"), i + 1, rid, reason, "{}", cause=cause) for i, rid in enumerate(ids)]


def test_a_later_load_replaces_the_earlier_loads_rejects(tmp_path):
    d = tmp_path / "rejects/B1"
    write_rejects(rejects("g1", cause="refused"), d, "generate")
    replace_stage_rejects(rejects("a", "b"), d, "load")
    replace_stage_rejects(rejects("b"), d, "load")  # row a was fixed in the file
    assert sorted((r["id"], r["cause"]) for r in read_rejects(d)) == [("b", "bad_row"), ("g1", "refused")]
    replace_stage_rejects([], d, "load")  # every row fixed
    assert [r["id"] for r in read_rejects(d)] == ["g1"]
    assert reject_counts(d) == {"refused": 1}
    first = replace_stage_rejects(rejects("c"), d, "load")
    assert replace_stage_rejects(rejects("c"), d, "load") == first  # unchanged: nothing rewritten


def test_settle_keeps_only_the_rejects_that_still_stand(tmp_path):
    d = tmp_path / "rejects/B1"
    write_rejects(rejects("long1", "long2", cause="too_long"), d, "generate")
    write_rejects(rejects("ref1", "ref2", cause="refused"), d, "generate")
    write_rejects(rejects("row1"), d, "load")
    standing = settle_generate_rejects(d, responded={"ref2"}, retry_refused=False)
    assert standing == {"ref1"}  # too_long goes back to the queue; ref2 has a response by now
    assert sorted(r["id"] for r in read_rejects(d)) == ["ref1", "row1"]  # load rejects untouched
    assert settle_generate_rejects(d, responded=set(), retry_refused=False) == {"ref1"}
    assert settle_generate_rejects(d, responded=set(), retry_refused=True) == set()
    assert [r["id"] for r in read_rejects(d)] == ["row1"]


def test_parts_written_before_causes_were_stored_are_classified_by_reason(tmp_path):
    d = tmp_path / "rejects/B1"
    old_schema = pa.schema(
        [
            ("id", pa.string()),
            ("source", pa.string()),
            ("row", pa.int64()),
            ("stage", pa.string()),
            ("reason", pa.string()),
            ("raw", pa.string()),
        ]
    )
    table = pa.table(
        {
            "id": ["x", "y"],
            "source": ["s", "s"],
            "row": [0, 0],
            "stage": ["generate", "generate"],
            "reason": [
                "prompt is 900 tokens; the server accepts at most 199 (max_req_input_len 200)",
                "server refused the prompt (HTTP 400): unsupported",
            ],
            "raw": ["", ""],
        },
        schema=old_schema,
    )
    write_parquet_atomic(table, next_part_path(d), {"stage": "generate", "rows": 2})
    assert reject_counts(d) == {"refused": 1, "too_long": 1}
    assert settle_generate_rejects(d, responded=set(), retry_refused=False) == {"y"}
    (part,) = live_parts(d)
    assert [r["cause"] for r in read_rejects(d)] == ["refused"] and part.name != "part-000000.parquet"
