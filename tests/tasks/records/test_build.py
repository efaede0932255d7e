"""Records: exact ids and loss masks from responses and passthrough rows; resumable; token counts."""

from __future__ import annotations

import errno
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from models.common.file_errors import WriteFailed
from models.common.jobs import RecordsJob
from settings.layout import RunLayout
from tasks.generate.passthrough import PASSTHROUGH_SCHEMA, copy_passthrough
from tasks.generate.prompts import chat_prompt_ids
from tasks.records import build as records_module
from tasks.records.build import (
    build_records,
    count_tokens,
    coverage,
    record_stats,
    summarize_records,
)
from tasks.responses.checkpoints import compact, responses_table, write_part
from tasks.responses.parquet_io import DamagedPart, list_parts

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def settings(tokenizer, **kw) -> RecordsJob:
    return RecordsJob(vocab_size=len(tokenizer), **kw)


def response(tokenizer, i: int, answer: str, finish: str = "stop") -> dict:
    prompt = chat_prompt_ids(tokenizer, [{"role": "user", "content": f"question number {i}"}])
    output = tokenizer.encode(answer, add_special_tokens=False) + ([tokenizer.eos_token_id] if finish == "stop" else [])
    return {
        "id": f"r{i}",
        "prompt_ids": prompt,
        "output_ids": output,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(output),
        "finish_reason": finish,
        "text": tokenizer.decode(output, skip_special_tokens=False),
        "latency": 0.1,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "finished_at": 1.0 + i,
    }


def records_of(directory: Path) -> list[dict]:
    return [r for p in list_parts(directory) for r in pq.read_table(p).to_pylist()]


def test_generated_records_train_exactly_on_the_generated_ids(tmp_path, tokenizer):
    rows = [response(tokenizer, i, f"<think>step {i}</think>answer {i} is {i * 7}") for i in range(6)]
    rows.append(response(tokenizer, 6, "cut off in the midd", finish="length"))
    write_part(tmp_path / "responses", responses_table(rows))
    report = build_records(
        "B1", "generate", tmp_path / "responses", tmp_path / "records", tmp_path / "rejects", settings(tokenizer)
    )
    got = {r["id"]: r for r in records_of(tmp_path / "records")}
    assert sorted(got) == [f"r{i}" for i in range(6)]  # the length-finished one is left out
    assert report.dropped == {"finish_length": 1}
    for row in rows[:6]:
        ids, mask = np.array(got[row["id"]]["input_ids"]), np.array(got[row["id"]]["loss_mask"])
        assert ids[mask == 0].tolist() == row["prompt_ids"]
        assert ids[mask == 1].tolist() == row["output_ids"]  # stop token included
        assert tokenizer.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == row["text"]
        assert mask.tolist() == sorted(mask.tolist())  # 0s then 1s
    assert report.loss_tokens == sum(len(r["output_ids"]) for r in rows[:6])


def test_an_end_token_at_the_length_cap_is_a_whole_answer_whichever_rule_the_server_used(tmp_path, tokenizer):
    # SGLang 0.5.23 checks the stop token before the length cap (managers/schedule_batch.py update_finish_state),
    # 0.4.x the cap first: the same answer, ending with eos exactly at max_new_tokens, is `stop` on one and
    # `length` on the other. The records must be the same either way.
    eos = tokenizer.eos_token_id
    built = {}
    for version, finish in (("0.5", "stop"), ("0.4", "length")):
        row = response(tokenizer, 0, "a whole answer")  # ends with eos
        row["finish_reason"] = finish
        cut = response(tokenizer, 1, "cut off in the midd", finish="length")  # no eos: truncated on both
        write_part(tmp_path / version / "responses", responses_table([row, cut]))
        report = build_records(
            "B1",
            "generate",
            tmp_path / version / "responses",
            tmp_path / version / "records",
            tmp_path / version / "rejects",
            settings(tokenizer, stop_token_ids=[eos]),
        )
        built[version] = (
            [(r["id"], r["input_ids"]) for r in records_of(tmp_path / version / "records")],
            report.dropped,
        )
    assert built["0.5"] == built["0.4"]
    assert [i for i, _ in built["0.5"][0]] == ["r0"] and built["0.5"][1] == {"finish_length": 1}


def test_keep_truncated_includes_length_finished(tmp_path, tokenizer):
    write_part(tmp_path / "responses", responses_table([response(tokenizer, 0, "cut", finish="length")]))
    report = build_records(
        "B1",
        "generate",
        tmp_path / "responses",
        tmp_path / "records",
        tmp_path / "rej",
        settings(tokenizer, keep_truncated=True),
    )
    assert report.records == 1 and report.dropped == {}


def test_max_seq_len_truncate_and_drop_and_min_loss_tokens(tmp_path, tokenizer):
    rows = [response(tokenizer, i, "word " * n) for i, n in enumerate((2, 40, 80))]
    write_part(tmp_path / "responses", responses_table(rows))
    longest = max(len(r["prompt_ids"]) + len(r["output_ids"]) for r in rows)
    cut = len(rows[0]["prompt_ids"]) + 30
    trunc = build_records(
        "B1", "generate", tmp_path / "responses", tmp_path / "t", tmp_path / "r", settings(tokenizer, max_seq_len=cut)
    )
    assert trunc.truncated == 2 and trunc.max_length == cut < longest
    assert all(len(r["input_ids"]) == len(r["loss_mask"]) <= cut for r in records_of(tmp_path / "t"))
    drop = build_records(
        "B1",
        "generate",
        tmp_path / "responses",
        tmp_path / "d",
        tmp_path / "r",
        settings(tokenizer, max_seq_len=cut, overflow="drop"),
    )
    assert drop.records == 1 and drop.dropped == {"too_long": 2}
    few = build_records(
        "B1",
        "generate",
        tmp_path / "responses",
        tmp_path / "m",
        tmp_path / "r",
        settings(tokenizer, min_loss_tokens=10),
    )
    assert few.records == 2 and few.dropped == {"few_loss_tokens": 1}


def test_rerun_is_idempotent_and_follows_compaction_and_settings(tmp_path, tokenizer):
    for k in range(4):
        write_part(
            tmp_path / "responses", responses_table([response(tokenizer, 10 * k + j, f"a{j}") for j in range(3)])
        )
    args = ("B1", "generate", tmp_path / "responses", tmp_path / "records", tmp_path / "rejects")
    first = build_records(*args, settings(tokenizer))
    assert (first.parts_built, first.records) == (4, 12)
    again = build_records(*args, settings(tokenizer))
    assert (again.parts_built, again.records) == (0, 12)  # nothing to do
    compact(tmp_path / "responses", min_parts=4)
    merged = build_records(*args, settings(tokenizer))
    assert (merged.parts_built, merged.records) == (1, 12)
    ids = [r["id"] for r in records_of(tmp_path / "records")]
    assert len(ids) == len(set(ids)) == 12  # no duplicates after the rebuild
    other = build_records(*args, settings(tokenizer, min_loss_tokens=3))
    assert other.parts_built == 1  # other settings: rebuilt, not mixed


def passthrough_part(tmp_path: Path, rows: list[dict]) -> Path:
    directory = tmp_path / "passthrough"
    table = pa.Table.from_pylist(rows, schema=PASSTHROUGH_SCHEMA)
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / "part-000000.parquet")
    return directory


def test_pretokenized_rows_are_validated_with_reasons(tmp_path, tokenizer):
    v = len(tokenizer)
    source = passthrough_part(
        tmp_path,
        [
            {"id": "ok", "messages": None, "input_ids": [5, 6, 7, 1], "loss_mask": [0, 0, 1, 1]},
            {"id": "oov", "messages": None, "input_ids": [5, v + 3], "loss_mask": [0, 1]},
            {"id": "noloss", "messages": None, "input_ids": [5, 6], "loss_mask": [0, 0]},
        ],
    )
    report = build_records(
        "A1", "passthrough", source, tmp_path / "records", tmp_path / "rejects", settings(tokenizer), tokenizer
    )
    assert [r["id"] for r in records_of(tmp_path / "records")] == ["ok"]
    assert report.rejects == 2
    reasons = {r["id"]: r["reason"] for r in pq.read_table(list_parts(tmp_path / "rejects")[0]).to_pylist()}
    assert f"token id {v + 3} is outside the target's vocabulary" in reasons["oov"]
    assert "loss_mask has no 1" in reasons["noloss"]


def test_passthrough_conversations_mask_assistant_turns_and_split_rewritten_history(tmp_path, tokenizer):
    copy_passthrough("A1", REPO / "data/samples/passthrough_chat.jsonl", tmp_path / "passthrough", tmp_path / "rejects")
    report = build_records(
        "A1",
        "passthrough",
        tmp_path / "passthrough",
        tmp_path / "records",
        tmp_path / "rejects",
        settings(tokenizer),
        tokenizer,
    )
    rows = [
        json.loads(line)
        for line in (REPO / "data/samples/passthrough_chat.jsonl").read_text().splitlines()
        if line.strip()
    ]
    got = records_of(tmp_path / "records")
    split = [r for r in got if "#t" in r["id"]]
    assert split and len(got) > len(rows)  # some histories are rewritten by the template, so split
    by_id = {r["id"]: r for r in got}
    for row in rows:
        assistants = [m["content"] for m in row["messages"] if m["role"] == "assistant"]
        if row["id"] in by_id:  # stable: one record, every assistant turn trained, reasoning included
            record = by_id[row["id"]]
            trained = tokenizer.decode(
                [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m], skip_special_tokens=False
            )
            assert trained == "<|im_end|>".join(assistants) + "<|im_end|>"
        else:  # split: record k trains on assistant turn k only, with its reasoning
            for k, content in enumerate(assistants):
                record = by_id[f"{row['id']}#t{k}"]
                trained = tokenizer.decode(
                    [t for t, m in zip(record["input_ids"], record["loss_mask"]) if m], skip_special_tokens=False
                )
                assert trained == content + "<|im_end|>"
    assert report.records == len(got)

    rejected = build_records(
        "A1",
        "passthrough",
        tmp_path / "passthrough",
        tmp_path / "records2",
        tmp_path / "rejects2",
        settings(tokenizer, on_rewrite="reject"),
        tokenizer,
    )
    assert rejected.rejects == len({r["id"].split("#")[0] for r in split})
    reasons = pq.read_table(list_parts(tmp_path / "rejects2")[0]).column("reason").to_pylist()
    assert all("split" in reason for reason in reasons)


def test_token_counts_and_coverage(tmp_path, tokenizer):
    rows = [response(tokenizer, i, "alpha beta " * (i + 1)) for i in range(5)]
    write_part(tmp_path / "responses", responses_table(rows))
    build_records(
        "B1", "generate", tmp_path / "responses", tmp_path / "records/B1", tmp_path / "rej", settings(tokenizer)
    )
    total, counts = count_tokens([tmp_path / "records/B1"], RunLayout(tmp_path).token_counts, len(tokenizer))
    naive = Counter(t for r in rows for t in r["output_ids"])
    assert total == sum(naive.values())
    table = pq.read_table(tmp_path / "records" / "token_counts.parquet").to_pylist()
    assert {r["token_id"]: r["count"] for r in table} == dict(naive)
    assert [r["count"] for r in table] == sorted((r["count"] for r in table), reverse=True)
    top2 = sum(c for _, c in naive.most_common(2))
    assert coverage(counts, 2) == pytest.approx(top2 / total)
    assert coverage(counts, len(tokenizer)) == 1.0
    (stats,) = record_stats(tmp_path)
    assert stats.dataset == "B1" and stats.records == 5 and stats.loss_tokens == total


# --- failures: a full disk, damaged parts ---------------------------------------------------------


def big_responses(tmp_path: Path, parts: int, rows: int = 40, length: int = 400) -> list[str]:
    """`parts` responses parts of `rows` rows with random (badly compressible) ids; return every id."""
    rng = np.random.default_rng(0)
    ids = []
    for k in range(parts):
        batch = []
        for j in range(rows):
            out = rng.integers(3, 2000, length).tolist()
            batch.append(
                {
                    "id": f"p{k}-{j}",
                    "prompt_ids": [5, 6],
                    "output_ids": out,
                    "prompt_tokens": 2,
                    "completion_tokens": length,
                    "finish_reason": "stop",
                    "text": "",
                    "latency": 0.1,
                    "cached_tokens": 0,
                    "reasoning_tokens": 0,
                    "finished_at": 1.0,
                }
            )
        write_part(tmp_path / "responses", responses_table(batch))
        ids += [r["id"] for r in batch]
    return ids


def test_full_disk_stops_records_at_once_keeps_parts_and_resumes(tmp_path, tmpfs):
    ids = big_responses(tmp_path, parts=6)
    one_part = None
    with tmpfs(tmp_path / "small", "160k") as small:
        records = small / "records"
        with pytest.raises(WriteFailed) as failed:
            build_records(
                "B1", "generate", tmp_path / "responses", records, tmp_path / "rejects", RecordsJob(vocab_size=2048)
            )
        kept = list_parts(records)
        one_part = kept[0].stat().st_size if kept else None
        assert 1 <= len(kept) < 6, "the disk should hold some parts, not all"
        message = str(failed.value)
        assert message.startswith(f"cannot write {records}/part-{len(kept):06d}.parquet: disk full: ")
        assert f"bytes free on {small}" in message
        assert f"kept: {len(kept)} complete records parts in {records}" in message
        assert "to resume: make room there, then run the records stage again" in message
        assert failed.value.errno == errno.ENOSPC
        # what was written is whole and readable; nothing half-written is left
        assert sorted(p.name for p in records.iterdir()) == [p.name for p in kept]
        got = [r for p in kept for r in pq.read_table(p).column("id").to_pylist()]
        assert got == ids[: 40 * len(kept)]
        # the disk grows: the rerun builds only the missing parts, every record exactly once
        tmpfs.remount(small, "size=4m")
        report = build_records(
            "B1", "generate", tmp_path / "responses", records, tmp_path / "rejects", RecordsJob(vocab_size=2048)
        )
        assert report.parts_built == 6 - len(kept)
        got = [r["id"] for r in records_of(records)]
        assert sorted(got) == sorted(ids) and len(got) == len(set(got)) == 240
    assert one_part and one_part > 20_000  # the parts were big enough for the test to mean something


@pytest.mark.parametrize("what", ["records part", "token counts", "rejects"])
def test_write_failures_name_the_file_and_what_is_kept(what, tmp_path, tokenizer, monkeypatch):
    source = passthrough_part(
        tmp_path,
        [
            {"id": "ok", "messages": None, "input_ids": [5, 6, 7, 1], "loss_mask": [0, 0, 1, 1]},
            {"id": "noloss", "messages": None, "input_ids": [5, 6], "loss_mask": [0, 0]},
        ],
    )
    if what == "records part":
        monkeypatch.setattr(records_module, "parquet_atomic_writer", _refuse(errno.EROFS))
    elif what == "rejects":
        monkeypatch.setattr(records_module, "write_rejects", _refuse(errno.EDQUOT))
    args = ("A1", "passthrough", source, tmp_path / "records", tmp_path / "rejects", settings(tokenizer), tokenizer)
    if what == "token counts":
        build_records(*args)
        monkeypatch.setattr(records_module, "write_parquet_atomic", _refuse(errno.ENOSPC))
        with pytest.raises(WriteFailed) as failed:
            count_tokens([tmp_path / "records"], tmp_path / "token_counts.parquet", len(tokenizer))
        assert str(failed.value).startswith(f"cannot write {tmp_path / 'token_counts.parquet'}: disk full: ")
        assert "kept: every records part (complete; only the token counts are missing)" in str(failed.value)
        return
    with pytest.raises(WriteFailed) as failed:
        build_records(*args)
    expected = {
        "records part": f"cannot write {tmp_path / 'records' / 'part-000000.parquet'}: read-only file system. ",
        "rejects": f"cannot write {tmp_path / 'rejects'}: disk quota exceeded",
    }[what]
    assert str(failed.value).startswith(expected)
    assert f"kept: 0 complete records parts in {tmp_path / 'records'}" in str(failed.value)
    assert list_parts(tmp_path / "records") == []  # the rejects come first: a part on disk has its rejects


def _refuse(code: int):
    def write(*args, **kwargs):
        raise OSError(code, "refused by the test")

    return write


def damage(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "garbage":
        path.write_bytes(b"this is not parquet\n" * 20)
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "pages":  # footer intact, the column data overwritten
        path.write_bytes(data[:4] + b"\xff" * 64 + data[68:])


@pytest.mark.parametrize("how", ["truncated", "garbage", "empty", "pages"])
def test_damaged_responses_part_is_named_with_what_to_do(how, tmp_path, tokenizer):
    for k in range(2):
        write_part(
            tmp_path / "run/responses/B1", responses_table([response(tokenizer, 10 * k + j, f"a{j}") for j in range(3)])
        )
    bad = list_parts(tmp_path / "run/responses/B1")[1]
    damage(bad, how)
    with pytest.raises(DamagedPart) as failed:
        build_records(
            "B1",
            "generate",
            tmp_path / "run/responses/B1",
            tmp_path / "run/records/B1",
            tmp_path / "run/rejects/B1",
            settings(tokenizer),
        )
    message = str(failed.value)
    assert message.startswith(f"{bad} is damaged ({bad.stat().st_size:,} bytes, not a readable Parquet file: ")
    where = tmp_path / "run/quarantine/responses/B1"
    assert message.endswith(
        f"). Move it aside: mkdir -p {where} && mv {bad} {where}/ -- then run generate (the prompts "
        "it held are generated again, exactly once) and the records stage again"
    )
    assert failed.value.path == bad
    if how == "pages":  # the footer could be read, so the part before it was converted: kept
        assert [p.name for p in list_parts(tmp_path / "run/records/B1")] == ["part-000000.parquet"]


def test_damaged_passthrough_and_records_parts(tmp_path, tokenizer):
    source = passthrough_part(
        tmp_path, [{"id": "ok", "messages": None, "input_ids": [5, 6, 7, 1], "loss_mask": [0, 0, 1, 1]}]
    )
    args = ("A1", "passthrough", source, tmp_path / "records", tmp_path / "rejects", settings(tokenizer), tokenizer)
    build_records(*args)
    record = list_parts(tmp_path / "records")[0]
    damage(record, "truncated")
    rebuild = "Delete it and run the records stage again: it is rebuilt from its responses or passthrough part"
    for read in (
        lambda: build_records(*args),
        lambda: summarize_records(tmp_path / "records"),
        lambda: count_tokens([tmp_path / "records"], tmp_path / "token_counts.parquet", len(tokenizer)),
    ):
        with pytest.raises(DamagedPart) as failed:
            read()
        assert str(failed.value).startswith(
            f"{record} is damaged ({record.stat().st_size:,} bytes, not a readable Parquet file: "
        )
        assert str(failed.value).endswith(f"). {rebuild}")
    # the advice works: delete it and the stage rebuilds it
    record.unlink()
    assert build_records(*args).records == 1
    # a Parquet file that is no records part (no summary in its footer) is named too
    pq.write_table(pa.table({"x": [1]}), tmp_path / "records" / "part-000001.parquet")
    with pytest.raises(DamagedPart, match=r"part-000001.parquet is damaged \(its footer has no valid records summary"):
        summarize_records(tmp_path / "records")
    (tmp_path / "records" / "part-000001.parquet").unlink()
    damage(source / "part-000000.parquet", "garbage")
    (tmp_path / "records" / "part-000000.parquet").unlink()
    with pytest.raises(DamagedPart) as failed:
        build_records(*args)
    assert str(failed.value).startswith(
        f"{source / 'part-000000.parquet'} is damaged (400 bytes, not a readable Parquet file"
    )
    assert str(failed.value).endswith(
        "Delete it and run generate again (it is copied again from the dataset file), then the records stage"
    )


def test_record_stats_reports_a_damaged_dataset_and_goes_on(tmp_path, tokenizer):
    for ds in ("A1", "B1"):
        write_part(tmp_path / "responses" / ds, responses_table([response(tokenizer, 0, "hello")]))
        build_records(
            ds,
            "generate",
            tmp_path / "responses" / ds,
            tmp_path / "records" / ds,
            tmp_path / "rejects",
            settings(tokenizer),
        )
    damage(list_parts(tmp_path / "records/A1")[0], "garbage")
    with pytest.raises(DamagedPart, match="A1/part-000000.parquet is damaged"):
        record_stats(tmp_path)
    seen = []
    reports = record_stats(tmp_path, on_damaged=lambda ds, e: seen.append((ds, e.path.name)))
    assert [r.dataset for r in reports] == ["B1"] and reports[0].records == 1
    assert seen == [("A1", "part-000000.parquet")]


def _python_peak_mb(fn) -> float:
    """Peak of Python's own allocations (tracemalloc) while `fn()` runs, in MB: Python rows are what grows here."""
    import tracemalloc

    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1] / 1e6
    finally:
        tracemalloc.stop()


def test_a_long_passthrough_set_is_copied_and_made_records_one_row_group_at_a_time(tmp_path, tokenizer):
    """The rehearsal (docs/bench-rehearsal.md) found the generate and records CLIs growing by ~760 and ~610 MB from
    10% to 100% of the reference run: each held its passthrough set whole as Python rows (2,400 records of ~4,000
    tokens, ~70 B per token). Here 4,096 records of 300 tokens (1.2M tokens) must copy and convert within a fraction
    of what holding them took, and come out whole. Measured (tracemalloc's peak): 61.6 and 63.2 MB held whole, 4.9 and
    7.9 MB a row group at a time."""
    n, length = 4096, 300
    rng = np.random.default_rng(0)
    source = tmp_path / "long.parquet"
    ids = rng.integers(257, len(tokenizer), size=(n, length)).tolist()  # above CPython's cached small ints
    table = pa.table(
        {
            "id": [f"long-{i}" for i in range(n)],
            "input_ids": pa.array(ids, pa.list_(pa.int32())),
            "loss_mask": pa.array([[0] * 100 + [1] * (length - 100)] * n, pa.list_(pa.uint8())),
        }
    )
    del ids
    pq.write_table(table, source, row_group_size=256)
    layout = RunLayout(tmp_path / "run")
    copied = layout.passthrough("A1")

    peak_copy = _python_peak_mb(lambda: copy_passthrough("A1", source, copied, layout.rejects("A1"), "fail"))
    args = ("A1", "passthrough", copied, layout.records("A1"), layout.rejects("A1"), settings(tokenizer), tokenizer)
    peak_records = _python_peak_mb(lambda: build_records(*args))

    part = copied / "part-000000.parquet"
    meta = pq.read_metadata(part)
    assert meta.num_rows == n and meta.num_row_groups == n // 256
    assert pq.read_table(part).column("input_ids").to_pylist() == table.column("input_ids").to_pylist()
    assert not copy_passthrough("A1", source, copied, layout.rejects("A1"), "fail").copied  # its footer names it
    report = summarize_records(layout.records("A1"))
    assert (report.records, report.tokens, report.loss_tokens) == (n, n * length, n * (length - 100))
    assert peak_copy < 20 and peak_records < 20, (peak_copy, peak_records)
