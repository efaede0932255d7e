import io
import json
import math
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from rich.console import Console

from tasks.datasets import Reject
from tasks.responses.checkpoints import RESPONSE_SCHEMA, responses_table, write_part
from tasks.responses.parquet_io import write_parquet_atomic
from tasks.responses.rejects import write_rejects
from tasks.responses.stats import (
    STATS_COLUMNS,
    DatasetStats,
    collect_stats,
    nearest_rank,
    render_stats_table,
    stats_rows,
    total_stats,
)

# ---------------------------------------------------------------------------------------------
# nearest-rank percentiles


def test_nearest_rank_known_values():
    # The textbook example of the method: ranks ceil(p/100 * 5).
    data = [15, 20, 35, 40, 50]
    assert [nearest_rank(data, p) for p in (5, 30, 40, 50, 100)] == [15, 20, 20, 35, 50]
    hundred = list(range(1, 101))
    assert nearest_rank(hundred, 50) == 50 and nearest_rank(hundred, 95) == 95
    assert nearest_rank(list(range(1, 21)), 95) == 19  # ceil(0.95 * 20) = 19, no float overshoot
    assert nearest_rank([7], 50) == 7 and nearest_rank([7], 95) == 7
    assert nearest_rank([], 50) is None
    with pytest.raises(ValueError, match="percentile"):
        nearest_rank(data, 0)


@pytest.mark.parametrize("n", [1, 2, 3, 4, 10, 19, 20, 21, 99, 100, 101, 1000, 1001])
def test_nearest_rank_matches_numpy_and_statistics(n):
    rng = np.random.default_rng(n)
    data = sorted(rng.integers(1, 5000, n).tolist())  # with repeats
    for p in (1, 5, 25, 50, 75, 90, 95, 99, 100):
        assert nearest_rank(data, p) == int(np.percentile(data, p, method="inverted_cdf")), p
    assert nearest_rank(data, 50) == statistics.median_low(data)
    assert nearest_rank(np.asarray(data), 95) == nearest_rank(data, 95)


# ---------------------------------------------------------------------------------------------
# collect_stats on a small run directory


def _row(i, length, reason="stop", finished_at=1000.0, prompt=10):
    return {
        "id": f"r{i}",
        "prompt_ids": list(range(prompt)),
        "output_ids": list(range(length)),
        "prompt_tokens": prompt,
        "completion_tokens": length,
        "finish_reason": reason,
        "text": "x",
        "latency": 1.0,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "finished_at": finished_at,
    }


def _rejects(n, source="data/b.jsonl"):
    return [Reject(path=source, row=i + 1, id=f"bad{i}", reason="too long", raw="{}") for i in range(n)]


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    b1 = run / "responses" / "B1"
    write_part(b1, responses_table([_row(0, 10, finished_at=100.0), _row(1, 30, "length", finished_at=110.0)]))
    write_part(b1, responses_table([_row(2, 20, finished_at=105.0), _row(3, 40, finished_at=140.0)]))
    write_rejects(_rejects(3), run / "rejects" / "B1")
    # A2: two parts and a compacted part that replaces them (a crash before the old ones were
    # deleted): each response must count once.
    a2 = run / "responses" / "A2"
    p0 = write_part(a2, responses_table([_row(10, 5, finished_at=50.0)]))
    p1 = write_part(a2, responses_table([_row(11, 7, finished_at=60.0)]))
    write_part(
        a2, responses_table([_row(10, 5, finished_at=50.0), _row(11, 7, finished_at=60.0)]), replaces=[p0.name, p1.name]
    )
    # C3: only rejects so far (every prompt too long, say).
    write_rejects(_rejects(2), run / "rejects" / "C3", stage="load")
    (run / "responses" / "D4").mkdir(parents=True)  # started, nothing flushed yet
    return run


def test_a_multi_turn_dataset_counts_its_conversations_and_turns_apart(tmp_path):
    """turns: all writes one response per turn, `<id>#t<k>`; a conversation's turns may lie in several parts."""
    turns = tmp_path / "run" / "responses" / "M1"
    named = lambda rid, length, reason="stop": {**_row(0, length, reason), "id": rid}  # noqa: E731
    write_part(turns, responses_table([named("c1#t0", 10), named("c2#t0", 12), named("c1#t1", 20, "length")]))
    write_part(turns, responses_table([named("c2#t1", 8), named("c2#t2", 9), named("c3#t0", 5), named("p9", 7)]))
    [m1] = collect_stats(tmp_path / "run")
    assert (m1.responses, m1.conversations, m1.truncated) == (7, 4, 1)  # c1, c2, c3 and the single prompt p9
    total = total_stats([m1])
    assert (total.responses, total.conversations) == (7, 4)
    [row] = [r for r in stats_rows([m1]) if r["dataset"] == "M1"]
    assert (row["responses"], row["conversations"], row["truncated"]) == (7, 4, 1)


def test_collect_stats_figures(run_dir):
    stats = collect_stats(run_dir)
    assert [s.dataset for s in stats] == ["A2", "B1", "C3", "D4"]
    a2, b1, c3, d4 = stats
    assert b1 == DatasetStats(
        dataset="B1",
        responses=4,
        rejects=3,
        completion_tokens=100,
        prompt_tokens=40,
        mean_length=25.0,
        p50_length=20,
        p95_length=40,
        finish_reasons={"length": 1, "stop": 3},
        tokens_per_s=100 / 40.0,
        wall_s=40.0,
        parts=2,
        first_finished_at=100.0,
        last_finished_at=140.0,
        reject_causes={"bad_row": 3},
        conversations=4,  # one-turn prompts: a conversation each
    )
    assert list(b1.lengths) == [10, 20, 30, 40]
    assert (a2.responses, a2.completion_tokens, a2.parts, a2.wall_s, a2.tokens_per_s) == (2, 12, 1, 10.0, 1.2)
    assert (a2.p50_length, a2.p95_length) == (5, 7)
    assert c3 == DatasetStats(  # rejects only
        dataset="C3",
        rejects=2,
        reject_causes={"bad_row": 2},
        responses=0,
        completion_tokens=0,
        prompt_tokens=0,
        mean_length=None,
        p50_length=None,
        p95_length=None,
        finish_reasons={},
        tokens_per_s=None,
        wall_s=None,
        parts=0,
    )
    assert (d4.responses, d4.rejects, d4.parts) == (0, 0, 0)


def test_collect_stats_reads_footers_only(run_dir, monkeypatch):
    def no_rows(*args, **kwargs):
        raise AssertionError("stats must not read row data")

    monkeypatch.setattr(pq, "read_table", no_rows)
    monkeypatch.setattr(pq.ParquetFile, "read", no_rows)
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", no_rows)
    monkeypatch.setattr(pq.ParquetFile, "iter_batches", no_rows)
    assert sum(s.responses for s in collect_stats(run_dir)) == 6


def test_one_response_or_no_timestamps_has_no_rate(tmp_path):
    write_part(tmp_path / "responses" / "one", responses_table([_row(0, 10, finished_at=5.0)]))
    (s,) = collect_stats(tmp_path)
    assert (s.wall_s, s.tokens_per_s, s.mean_length, s.p50_length) == (0.0, None, 10.0, 10)


def test_empty_or_missing_run_dir(tmp_path):
    assert collect_stats(tmp_path / "missing") == []
    assert collect_stats(tmp_path) == []
    assert total_stats([]).responses == 0
    assert stats_rows([], total=True)[0]["dataset"] == "TOTAL"


def test_part_without_summary_is_reported_as_damaged(tmp_path):
    table = responses_table([_row(0, 3)])
    part = write_parquet_atomic(table, tmp_path / "responses" / "B1" / "part-000000.parquet")
    (s,) = collect_stats(tmp_path)
    assert s.damaged.startswith(f"{part} is damaged (its footer has no valid eagle3 summary")


def test_a_damaged_dataset_is_named_and_the_others_still_counted(run_dir):
    part = sorted((run_dir / "responses" / "B1").glob("part-*.parquet"))[1]
    part.write_bytes(part.read_bytes()[:100])  # truncated: no footer
    stats = {s.dataset: s for s in collect_stats(run_dir)}
    assert stats["B1"].damaged.startswith(f"{part} is damaged (100 bytes, not a readable Parquet file")
    assert stats["B1"].responses == 0 and stats["A2"].responses == 2 and stats["A2"].damaged is None
    rows = {r["dataset"]: r for r in stats_rows(list(stats.values()), total=True)}
    assert rows["TOTAL"]["damaged"] == "damaged: B1" and rows["A2"]["damaged"] is None
    table = render_stats_table(list(stats.values()))
    assert "DAMAGED" in table.caption and str(part) in table.caption


def test_rejects_are_counted_by_cause(tmp_path):
    from tasks.responses.rejects import write_rejects as write

    rejects = _rejects(3)
    rejects[0].cause, rejects[1].cause = "too_long", "refused"
    write(rejects[:2], tmp_path / "rejects" / "B1", "generate")
    write(rejects[2:], tmp_path / "rejects" / "B1", "load")
    (s,) = collect_stats(tmp_path)
    assert (s.rejects, s.reject_causes) == (3, {"bad_row": 1, "refused": 1, "too_long": 1})
    assert stats_rows([s], total=True)[-1]["reject_causes"] == {"bad_row": 1, "refused": 1, "too_long": 1}


def test_a_compaction_between_the_listing_and_the_reads_is_counted_once_not_a_crash(tmp_path, monkeypatch):
    """`eagle3 stats` while generate runs: the writer's compaction (tasks/responses/checkpoints.py `compact`, the real
    one) merges the parts just listed and deletes them before their footers are read. The parts are listed again, and
    the figures are the compacted directory's, as checkpoints.summarize reads them."""
    import tasks.responses.stats as stats_module
    from tasks.responses.checkpoints import compact, summarize

    b1 = tmp_path / "run" / "responses" / "B1"
    for i in range(4):
        write_part(b1, responses_table([_row(2 * i, 10 + i), _row(2 * i + 1, 20 + i, "length")]))
    listing = stats_module.list_parts
    compactions: list[Path | None] = []

    def listed_then_compacted(directory, *args, **kwargs):
        parts = listing(directory, *args, **kwargs)
        if not compactions:  # the first listing only: then the writer merges those parts and deletes them
            compactions.append(compact(directory, min_parts=4))
        return parts

    monkeypatch.setattr(stats_module, "list_parts", listed_then_compacted)
    [b1_stats] = collect_stats(tmp_path / "run")
    assert compactions[0] is not None and len(listing(b1)) == 1  # the race happened: one merged part is left
    expected = summarize(b1)
    assert (b1_stats.responses, b1_stats.completion_tokens, b1_stats.parts) == (
        expected.rows,
        expected.completion_tokens,
        1,
    )
    assert (b1_stats.responses, b1_stats.completion_tokens) == (8, sum(10 + i + 20 + i for i in range(4)))
    assert b1_stats.damaged is None


def test_stats_rows_are_json_ready(run_dir):
    stats = collect_stats(run_dir)
    rows = stats_rows(stats)
    assert [r["dataset"] for r in rows] == ["A2", "B1", "C3", "D4"]
    assert all(list(r) == list(STATS_COLUMNS) for r in rows)
    assert json.loads(json.dumps(rows)) == rows
    assert rows[1]["finish_reasons"] == {"length": 1, "stop": 3} and rows[1]["p95_length"] == 40
    total = stats_rows(stats, total=True)[-1]
    assert total["dataset"] == "TOTAL"
    assert (total["responses"], total["rejects"], total["completion_tokens"], total["parts"]) == (6, 5, 112, 3)
    # over all six lengths [5, 7, 10, 20, 30, 40]; span 50 s .. 140 s
    assert (total["p50_length"], total["p95_length"], total["wall_s"]) == (10, 40, 90.0)
    assert total["tokens_per_s"] == pytest.approx(112 / 90)
    assert total["finish_reasons"] == {"length": 1, "stop": 5}


def test_render_stats_table_has_a_total_row(run_dir):
    table = render_stats_table(collect_stats(run_dir))
    out = io.StringIO()
    Console(file=out, width=200, color_system=None).print(table)
    lines = out.getvalue().splitlines()
    total = next(line for line in lines if "TOTAL" in line)
    assert "112" in total and "6" in total
    b1 = next(line for line in lines if " B1 " in line)
    assert "length=1 stop=3" in b1 and "100" in b1
    assert table.row_count == 5


# ---------------------------------------------------------------------------------------------
# Speed: footers against parsing the same responses as JSONL (the legacy way)

DATASETS = 10
PER_DATASET = 10_000
PART_ROWS = 2_500
# Realistic shapes, scaled down 4x so that the fixture builds in seconds on 2 cores: prompts
# ~50 ids (real: ~200), completions lognormal with mean 250 (real: ~1000). Smaller rows make the
# JSONL baseline *faster*, so the asserted ratio is conservative (full size measured ~300x).
PROMPT_LEN = 50
MEAN_OUTPUT = 250
SIGMA = 0.9


def _dataset_table(rng, d):
    n = PER_DATASET
    lengths = np.maximum(1, rng.lognormal(math.log(MEAN_OUTPUT) - SIGMA**2 / 2, SIGMA, n)).astype(np.int32)
    prompt_lengths = rng.integers(PROMPT_LEN // 2, PROMPT_LEN * 3 // 2, n).astype(np.int32)

    def lists(sizes):
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int32)
        values = rng.integers(0, 163_840, int(offsets[-1]), dtype=np.int32)
        return pa.ListArray.from_arrays(offsets, values)

    reasons = np.where(rng.random(n) < 0.9, "stop", "length")
    return pa.table(
        {
            "id": [f"D{d}-{i:05d}" for i in range(n)],
            "prompt_ids": lists(prompt_lengths),
            "output_ids": lists(lengths),
            "prompt_tokens": prompt_lengths,
            "completion_tokens": lengths,
            "finish_reason": reasons.tolist(),
            "text": [""] * n,
            "latency": rng.uniform(1.0, 120.0, n),
            "cached_tokens": np.zeros(n, np.int32),
            "reasoning_tokens": np.zeros(n, np.int32),
            "finished_at": 1.7e9 + d * 3600 + np.sort(rng.uniform(0.0, 3600.0, n)),
        },
        schema=RESPONSE_SCHEMA,
    )


def _write_jsonl(table, path):
    # The flat /generate-era layout of raw_responses.jsonl: one response per line, same rows.
    cols = {c: table.column(c) for c in table.column_names}
    plain = {c: col.to_pylist() for c, col in cols.items() if c not in ("prompt_ids", "output_ids")}
    lists = {}
    for c in ("prompt_ids", "output_ids"):
        arr = cols[c].combine_chunks()
        values = arr.values.to_numpy().tolist()
        offsets = arr.offsets.to_numpy()
        lists[c] = [values[offsets[i] : offsets[i + 1]] for i in range(len(arr))]
    with open(path, "w", encoding="utf-8") as f:
        for i in range(table.num_rows):
            row = {c: plain[c][i] for c in plain}
            row["prompt_ids"] = lists["prompt_ids"][i]
            row["output_ids"] = lists["output_ids"][i]
            f.write(json.dumps(row) + "\n")


def _jsonl_stats(paths):
    """The legacy way: parse every line, then the same figures as collect_stats."""
    out = {}
    for name, path in paths.items():
        lengths, prompt_tokens, reasons, times = [], 0, {}, []
        with open(path, encoding="utf-8") as f:
            for line in f:
                d = json.loads(line)
                lengths.append(d["completion_tokens"])
                prompt_tokens += d["prompt_tokens"]
                reasons[d["finish_reason"]] = reasons.get(d["finish_reason"], 0) + 1
                times.append(d["finished_at"])
        lengths.sort()
        n = len(lengths)
        out[name] = {
            "responses": n,
            "completion_tokens": sum(lengths),
            "prompt_tokens": prompt_tokens,
            "p50_length": lengths[math.ceil(0.50 * n) - 1],
            "p95_length": lengths[math.ceil(0.95 * n) - 1],
            "finish_reasons": dict(sorted(reasons.items())),
            "wall_s": max(times) - min(times),
        }
    return out


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    """10 datasets x 10k responses as Parquet parts, and the same rows as raw_responses.jsonl."""
    root = tmp_path_factory.mktemp("big_run")
    rng = np.random.default_rng(0)
    jsonl = {}
    for d in range(DATASETS):
        name = f"B{d:02d}"
        table = _dataset_table(rng, d)
        for start in range(0, PER_DATASET, PART_ROWS):
            write_part(root / "run" / "responses" / name, table.slice(start, PART_ROWS))
        jsonl[name] = root / "legacy" / name / "raw_responses.jsonl"
        jsonl[name].parent.mkdir(parents=True)
        _write_jsonl(table, jsonl[name])
    return root / "run", jsonl


@pytest.mark.slow
def test_stats_from_footers_is_50x_faster_than_parsing_jsonl(big_run):
    run, jsonl = big_run
    collect_stats(run)  # warm imports; the files are in the page cache for both sides
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        stats = collect_stats(run)
        times.append(time.perf_counter() - t0)
    fast = min(times)
    t0 = time.perf_counter()
    expected = _jsonl_stats(jsonl)
    slow = time.perf_counter() - t0

    got = {
        s.dataset: {
            "responses": s.responses,
            "completion_tokens": s.completion_tokens,
            "prompt_tokens": s.prompt_tokens,
            "p50_length": s.p50_length,
            "p95_length": s.p95_length,
            "finish_reasons": s.finish_reasons,
            "wall_s": s.wall_s,
        }
        for s in stats
    }
    assert got == expected
    assert sum(s.responses for s in stats) == DATASETS * PER_DATASET
    assert all(s.parts == PER_DATASET // PART_ROWS for s in stats)
    ratio = slow / fast
    print(f"\nstats from footers {fast * 1000:.1f} ms, JSONL parse {slow:.2f} s: {ratio:.0f}x")
    assert ratio >= 50, f"footers {fast:.3f} s vs JSONL {slow:.3f} s: only {ratio:.1f}x"


@pytest.mark.multiprocess
def test_eagle3_stats_names_a_damaged_part_without_a_traceback(run_dir):
    import subprocess
    import sys

    part = sorted((run_dir / "responses" / "B1").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:-40])  # a truncated copy
    exe = Path(sys.executable).parent / "eagle3"
    done = subprocess.run(
        [str(exe), "stats", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "250"},
    )
    out = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 1 and "Traceback" not in out
    assert f"{part} is damaged" in out and "A2" in out  # named; the other datasets still reported
    as_json = subprocess.run([str(exe), "stats", str(run_dir), "--json"], capture_output=True, text=True, timeout=120)
    report = json.loads(as_json.stdout)
    assert as_json.returncode == 1 and report["damaged"][0].startswith(f"{part} is damaged")
    assert {r["dataset"]: r["responses"] for r in report["responses"]}["A2"] == 2


def test_answers_cut_by_the_length_limit_are_counted_and_flagged(tmp_path):
    # B1: 1 of 4 answers ended by length (25%: flagged); A2: 1 of 40 (2.5%: counted, not flagged)
    write_part(
        tmp_path / "responses" / "B1", responses_table([_row(i, 10) for i in range(3)] + [_row(3, 64, "length")])
    )
    write_part(
        tmp_path / "responses" / "A2", responses_table([_row(i, 5) for i in range(39)] + [_row(39, 64, "length")])
    )
    stats = {s.dataset: s for s in collect_stats(tmp_path)}
    assert (stats["B1"].truncated, stats["B1"].truncated_share) == (1, 0.25)
    assert (stats["A2"].truncated, stats["A2"].truncated_share) == (1, 0.025)
    rows = {r["dataset"]: r for r in stats_rows(list(stats.values()), total=True)}
    assert (rows["TOTAL"]["truncated"], rows["TOTAL"]["truncated_share"]) == (2, 2 / 44)
    table = render_stats_table(list(stats.values()))
    assert table.caption.startswith("CUT: B1 25% of the answers ended at the length limit")
    assert "A2" not in table.caption
    cut = table.columns[[c.header for c in table.columns].index("cut by length")]
    assert [str(c) for c in cut.cells] == ["1 (2.5%)", "1 (25.0%)", "2 (4.5%)"]
