"""Context probes (models/eval/probes.py): held-out records cut at each bucket edge, inside the target's answer."""

from __future__ import annotations

from models.eval.probes import probe_rows


def record(name: str, prompt: int, answer: int, then: int = 0) -> tuple[str, str, list[int], list[bool]]:
    """A record of `prompt` prompt tokens, an answer of `answer` loss tokens, then `then` tokens of a next user turn."""
    ids = list(range(100, 100 + prompt + answer + then))
    return "ds", name, ids, [False] * prompt + [True] * answer + [False] * then


def test_a_probe_is_the_record_up_to_the_edge_where_the_target_writes_next():
    records = [
        record("short", 10, 5),  # 15 tokens: reaches no edge
        record("mid", 10, 20, then=30),  # answer at 10..29: edge 16 cut inside it; 32 falls in the next user turn
        record("long", 4, 60),  # answer at 4..63: edges 16 and 32
        record("prompt", 40, 4),  # edges 16 and 32 fall in its prompt
    ]
    rows = probe_rows(records, [16, 32, 64], per_edge=2)
    assert [r["id"] for r in rows] == ["ds/mid@16", "ds/long@16", "ds/long@32"]  # shortest first, then record order
    assert rows[0]["input_ids"] == list(range(100, 116)) and len(rows[2]["input_ids"]) == 32
    # 64: the long record has 64 tokens, so nothing follows the cut: no probe there


def test_at_most_per_edge_probes_at_each_edge_in_record_order():
    records = [record(f"r{i}", 4, 40) for i in range(5)]
    rows = probe_rows(records, [16, 32], per_edge=2)
    assert [r["id"] for r in rows] == ["ds/r0@16", "ds/r1@16", "ds/r0@32", "ds/r1@32"]
    assert probe_rows(records, [16], per_edge=0) == []
