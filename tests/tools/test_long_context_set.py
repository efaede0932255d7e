"""The committed long-context eval set is tools/long_context_set.py's output, and its rows reach their buckets."""

from __future__ import annotations

from tools import long_context_set


def test_the_committed_set_is_the_builder_s_output():
    assert long_context_set.OUT.read_text(encoding="utf-8") == long_context_set.render(long_context_set.build_rows())


def test_each_size_holds_its_rows_at_or_above_its_length():
    rows = long_context_set.build_rows()
    assert len(rows) == len(long_context_set.LENGTHS) * long_context_set.ROWS_PER_LENGTH
    for row in rows:
        size = int(row["id"].split("-")[1])
        history = row["messages"][:-1]
        assert sum(len(m["content"]) for m in history) >= size
        assert [m["role"] for m in history] == ["user", "assistant"] * (len(history) // 2)  # whole exchanges
        assert row["messages"][-1]["role"] == "user"
