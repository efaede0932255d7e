import errno
import json
import logging
import math
import os
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from models.common.file_errors import WriteFailed
from tasks.datasets import DatasetError, load_dataset, stable_id
from tasks.generate.legacy_import import ImportReport, import_jsonl
from tasks.generate.prompts import chat_prompt_ids
from tasks.responses.checkpoints import PartSummary, done_ids
from tasks.responses.parquet_io import DamagedPart, list_parts, read_metadata
from tasks.responses.stats import collect_stats
from tasks.runtime.run_lock import RunDirLocked
from tests.run_locks import lock_held_elsewhere


@pytest.fixture(scope="module")
def tok(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


def write_lines(path, rows, tail=""):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows) + tail, encoding="utf-8")
    return path


def read_rows(run, dataset="B1"):
    return [r for p in list_parts(run / "responses" / dataset) for r in pq.read_table(p).to_pylist()]


def check_counts(report: ImportReport):
    assert report.lines == (
        report.imported
        + report.skipped_existing
        + report.duplicates
        + report.aborted
        + report.bad_lines
        + report.partial_last_line
    )


# SGLang /generate era: flat, token ids at the top level.
FLAT = [
    {
        "id": "glaive-1",
        "prompt_ids": [2, 10, 11, 12, 3],
        "output_ids": [20, 21, 22, 1],
        "prompt_tokens": 5,
        "completion_tokens": 4,
        "finish_reason": {"type": "stop", "matched": 1},
        "text": "abc<|im_end|>",
        "latency": 2.5,
        "cached_tokens": 3,
        "finished_at": 1000.0,
    },
    {
        "id": 7,
        "input_ids": [2, 13, 3],
        "output_ids": [30, 31, 32, 33, 34, 35],
        "prompt_tokens": 3,
        "completion_tokens": 6,
        "finish_reason": "length",
        "text": "xyz",
        "finished_at": 1010.0,
    },
    {  # no completion_tokens / prompt_tokens: counted from the ids
        "id": "glaive-3",
        "prompt_ids": [2, 14, 3],
        "output_ids": [40, 1],
        "finish_reason": "stop",
        "finished_at": 1020.0,
    },
]


def test_flat_format_imports_ids_and_counts(tmp_path):
    run = tmp_path / "run"
    report = import_jsonl(run, "B1", write_lines(tmp_path / "raw.jsonl", FLAT), tokenizer=None)

    assert (report.lines, report.imported, report.retokenized, report.completion_tokens) == (3, 3, 0, 12)
    assert report.partial_last_line is False and len(report.parts) == 1
    check_counts(report)
    rows = read_rows(run)
    assert [r["id"] for r in rows] == ["glaive-1", "7", "glaive-3"]
    assert [r["prompt_ids"] for r in rows] == [[2, 10, 11, 12, 3], [2, 13, 3], [2, 14, 3]]
    assert [r["output_ids"] for r in rows] == [[20, 21, 22, 1], [30, 31, 32, 33, 34, 35], [40, 1]]
    assert [r["completion_tokens"] for r in rows] == [4, 6, 2]
    assert [r["prompt_tokens"] for r in rows] == [5, 3, 3]
    assert [r["finish_reason"] for r in rows] == ["stop", "length", "stop"]
    assert [r["text"] for r in rows] == ["abc<|im_end|>", "xyz", None]
    assert (rows[0]["latency"], rows[0]["cached_tokens"], rows[1]["latency"]) == (2.5, 3, None)

    # The part's footer summary is what write_part computes from the rows.
    summary = PartSummary.from_metadata(read_metadata(report.parts[0]))
    assert summary == PartSummary.of_table(pq.read_table(report.parts[0]))
    assert summary == PartSummary(
        rows=3,
        completion_tokens=12,
        prompt_tokens=11,
        finish_reasons={"length": 1, "stop": 2},
        lengths=[4, 6, 2],
        first_finished_at=1000.0,
        last_finished_at=1020.0,
    )


# OpenAI chat era: nested usage, text only, the prompt as messages.
PROMPTS = [
    {"messages": [{"role": "user", "content": "Say hi."}]},
    {"messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why is the sky blue?"}]},
    {"prompt": "What is 2+2?"},
    {"messages": [{"role": "user", "content": "Name a colour.", "name": None}]},
]


def nested_lines():
    return [
        {  # answer in `response`, reasoning split off
            "messages": PROMPTS[0]["messages"],
            "response": "Hello there!",
            "reasoning_content": "A greeting.",
            "usage": {"prompt_tokens": 9, "completion_tokens": 11, "total_tokens": 20},
            "finish_reason": "stop",
            "created": 2000,
        },
        {  # a whole OpenAI response: its `id` names the completion, not the prompt
            "id": "chatcmpl-abc123",
            "object": "chat.completion",
            "created": 2030,
            "messages": PROMPTS[1]["messages"],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "length",
                    "message": {"role": "assistant", "content": "Rayleigh scattering", "reasoning_content": None},
                }
            ],
            "usage": {
                "prompt_tokens": 14,
                "completion_tokens": 3,
                "completion_tokens_details": {"reasoning_tokens": 0},
            },
        },
        {  # `prompt` string, thinking still inline in content (the old capture bug), no usage
            "prompt": "What is 2+2?",
            "content": "<think>2+2=4</think>4",
            "finish_reason": "stop",
        },
        {  # the answer as a trailing assistant turn
            "messages": [*PROMPTS[3]["messages"], {"role": "assistant", "content": "Teal."}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 4},
            "finish_reason": "stop",
            "created": 2010,
        },
    ]


def test_nested_format_tokenises_and_keeps_dataset_ids(tmp_path, tok):
    run = tmp_path / "run"
    report = import_jsonl(run, "B1", write_lines(tmp_path / "raw.jsonl", nested_lines()), tokenizer=tok)
    assert (report.imported, report.retokenized) == (4, 4)
    check_counts(report)
    rows = read_rows(run)

    # The ids are the ones the dataset loader gives the same prompts, so resume sees them done.
    dataset = load_dataset(write_lines(tmp_path / "prompts.jsonl", PROMPTS), "generate")
    assert [r["id"] for r in rows] == [p.id for p in dataset.rows]
    assert rows[0]["id"] == stable_id({"messages": PROMPTS[0]["messages"]})
    assert rows[2]["id"] == stable_id({"messages": [{"role": "user", "content": "What is 2+2?"}]})
    assert rows[3]["id"] == stable_id({"messages": [{"role": "user", "content": "Name a colour."}]})
    assert {p.id for p in dataset.rows} <= done_ids(run / "responses" / "B1")

    eos = tok.eos_token_id
    for row, prompt in zip(rows, dataset.rows):
        assert row["prompt_ids"] == chat_prompt_ids(tok, prompt.messages)
    assert rows[0]["text"] == "<think>A greeting.</think>Hello there!"
    assert rows[0]["output_ids"] == tok.encode("<think>A greeting.</think>Hello there!", add_special_tokens=False) + [
        eos
    ]
    assert rows[1]["output_ids"] == tok.encode("Rayleigh scattering", add_special_tokens=False)  # length: no eos
    assert rows[2]["output_ids"] == tok.encode("<think>2+2=4</think>4", add_special_tokens=False) + [eos]
    assert rows[3]["output_ids"] == tok.encode("Teal.", add_special_tokens=False) + [eos]
    assert rows[2]["output_ids"][0] == tok.convert_tokens_to_ids("<think>")  # one token, as generated

    # The server's counts are kept; without usage they are the token counts.
    assert [r["completion_tokens"] for r in rows] == [11, 3, len(rows[2]["output_ids"]), 4]
    assert [r["prompt_tokens"] for r in rows] == [9, 14, len(rows[2]["prompt_ids"]), 9]
    assert report.completion_tokens == 11 + 3 + len(rows[2]["output_ids"]) + 4
    assert [r["finish_reason"] for r in rows] == ["stop", "length", "stop", "stop"]
    assert rows[1]["reasoning_tokens"] == 0
    assert [r["finished_at"] for r in rows[:2]] == [2000.0, 2030.0]
    assert rows[2]["finished_at"] == (tmp_path / "raw.jsonl").stat().st_mtime  # no time: the file's


def test_partial_last_line_is_skipped_with_a_warning(tmp_path, caplog):
    file = write_lines(tmp_path / "raw.jsonl", FLAT[:2], tail='{"id": "glaive-3", "prompt_ids": [2, 1')
    with caplog.at_level(logging.WARNING, logger="eagle3.legacy_import"):
        report = import_jsonl(tmp_path / "run", "B1", file, tokenizer=None)
    assert (report.lines, report.imported, report.partial_last_line) == (3, 2, True)
    check_counts(report)
    assert [r["id"] for r in read_rows(tmp_path / "run")] == ["glaive-1", "7"]
    assert f"{file} line 3: skipped a partial last line" in caplog.text

    # Truncated JSON with a newline after it, and trailing blank lines: still the partial last line.
    file.write_text(file.read_text() + "\n\n")
    assert import_jsonl(tmp_path / "run2", "B1", file, tokenizer=None).partial_last_line is True

    # A last line that is JSON but not an object was not cut short: a bad line like any other.
    listed = write_lines(tmp_path / "listed.jsonl", [FLAT[0], [1, 2]])
    with pytest.raises(DatasetError, match="line 2: a line must be a JSON object"):
        import_jsonl(tmp_path / "run4", "B1", listed, tokenizer=None)

    # A complete last line without its newline is a whole response.
    whole = tmp_path / "whole.jsonl"
    whole.write_text("\n".join(json.dumps(r) for r in FLAT))
    report = import_jsonl(tmp_path / "run3", "B1", whole, tokenizer=None)
    assert (report.imported, report.partial_last_line) == (3, False)


def test_reimport_adds_nothing_and_duplicates_keep_the_first(tmp_path, tok):
    run = tmp_path / "run"
    first = dict(FLAT[0])
    repeat = dict(FLAT[0], text="second copy", output_ids=[9, 9])
    lines = [first, FLAT[1], repeat, *nested_lines(), FLAT[2]]
    file = write_lines(tmp_path / "raw.jsonl", lines)
    report = import_jsonl(run, "B1", file, tokenizer=tok, flush_every=3)
    assert (report.lines, report.imported, report.duplicates, report.skipped_existing) == (8, 7, 1, 0)
    assert len(report.parts) == 3  # 3 + 3 + 1 rows
    check_counts(report)
    rows = read_rows(run)
    assert len(rows) == 7 and len({r["id"] for r in rows}) == 7
    assert next(r for r in rows if r["id"] == "glaive-1")["text"] == "abc<|im_end|>"
    before = sorted(p.name for p in (run / "responses" / "B1").iterdir())

    again = import_jsonl(run, "B1", file, tokenizer=tok, flush_every=3)
    assert (again.imported, again.skipped_existing, again.duplicates, again.retokenized) == (0, 7, 1, 0)
    assert again.parts == [] and again.completion_tokens == 0
    assert sorted(p.name for p in (run / "responses" / "B1").iterdir()) == before

    # A longer file later (the old loop went on): only the new lines are added.
    more = dict(FLAT[2], id="glaive-4")
    write_lines(file, [*lines, more])
    third = import_jsonl(run, "B1", file, tokenizer=tok)
    assert (third.imported, third.skipped_existing) == (1, 7)
    assert len(read_rows(run)) == 8


def test_bad_line_names_file_and_line(tmp_path):
    file = write_lines(tmp_path / "raw.jsonl", [FLAT[0], {"id": "x", "output_ids": "oops"}, FLAT[1]])
    with pytest.raises(DatasetError) as err:
        import_jsonl(tmp_path / "run", "B1", file, tokenizer=None)
    assert str(err.value).startswith(f"{file} line 2: 'output_ids' must be a list of token ids, got string")
    assert err.value.row == 2
    # Nothing of the file is imported, not even the good line before it; the fixed file goes in whole.
    assert read_rows(tmp_path / "run") == []
    write_lines(file, FLAT)
    report = import_jsonl(tmp_path / "run", "B1", file, tokenizer=None)
    assert (report.imported, report.skipped_existing) == (3, 0)

    garbage = tmp_path / "garbage.jsonl"
    garbage.write_text(json.dumps(FLAT[0]) + "\nnot json\n" + json.dumps(FLAT[1]) + "\n")
    with pytest.raises(DatasetError, match=rf"{garbage} line 2: invalid JSON"):
        import_jsonl(tmp_path / "run2", "B1", garbage, tokenizer=None)

    for bad, message in [
        ({"id": "y", "prompt_ids": [1]}, "has no 'output_ids' and no response text"),
        ({"output_ids": [1], "prompt_ids": [1]}, "has no 'id' and no prompt"),
        ({"id": "z", "output_ids": [1]}, "has no 'prompt_ids'/'input_ids' and no prompt"),
        ({"id": "z", "output_ids": [1, -2], "prompt_ids": [1]}, r"'output_ids\[1\]' must be a non-negative"),
        (
            {"id": "z", "output_ids": [1], "prompt_ids": [1], "usage": {"completion_tokens": "3"}},
            "'usage.completion_tokens' must be a non-negative int",
        ),
        ({"messages": [{"role": "assistant", "content": "hi"}], "response": "x"}, "prompt: 'messages' is empty"),
        ([1, 2], "a line must be a JSON object, got list"),
    ]:
        f = write_lines(tmp_path / "one.jsonl", [bad, FLAT[0]])
        with pytest.raises(DatasetError, match=f"line 1: {message}"):
            import_jsonl(tmp_path / "run3", "B1", f, tokenizer=None)


def test_skip_bad_lines_writes_rejects(tmp_path):
    file = tmp_path / "raw.jsonl"
    file.write_text(
        json.dumps(FLAT[0])
        + "\n{broken\n"
        + json.dumps({"id": "q", "output_ids": [1]})
        + "\n"
        + json.dumps(FLAT[1])
        + "\n"
    )
    report = import_jsonl(tmp_path / "run", "B1", file, tokenizer=None, on_bad_line="skip")
    assert (report.lines, report.imported, report.bad_lines) == (4, 2, 2)
    check_counts(report)
    rejects = pq.read_table(report.rejects_part).to_pylist()
    assert [(r["row"], r["id"], r["stage"], r["source"]) for r in rejects] == [
        (2, None, "import", str(file)),
        (3, "q", "import", str(file)),
    ]
    assert rejects[0]["raw"] == "{broken" and rejects[0]["reason"].startswith("invalid JSON")
    # Re-running finds the same rejects part instead of writing another.
    again = import_jsonl(tmp_path / "run", "B1", file, tokenizer=None, on_bad_line="skip")
    assert again.rejects_part == report.rejects_part and again.imported == 0
    assert [s.rejects for s in collect_stats(tmp_path / "run")] == [2]


def test_aborted_lines_are_left_for_generation(tmp_path):
    aborted = dict(FLAT[0], finish_reason={"type": "abort"})
    report = import_jsonl(
        tmp_path / "run", "B1", write_lines(tmp_path / "raw.jsonl", [aborted, FLAT[0]]), tokenizer=None
    )
    assert (report.aborted, report.imported, report.duplicates) == (1, 1, 0)
    check_counts(report)


def test_missing_tokenizer_is_a_clear_error(tmp_path):
    file = write_lines(tmp_path / "raw.jsonl", nested_lines()[:1])
    with pytest.raises(ValueError, match="line 1 has no prompt_ids: pass the target's tokenizer"):
        import_jsonl(tmp_path / "run", "B1", file, tokenizer=None)


def test_stats_of_an_imported_run_match_the_source_jsonl(tmp_path, tok):
    lines = [*FLAT, *nested_lines()]
    file = write_lines(tmp_path / "raw.jsonl", lines)
    run = tmp_path / "run"
    report = import_jsonl(run, "B1", file, tokenizer=tok, flush_every=2)
    (stats,) = collect_stats(run)

    # The figures straight from the JSONL, the way the old stats collector read both formats.
    lengths, prompt_tokens, reasons = [], 0, {}
    for row in (json.loads(line) for line in file.read_text().splitlines()):
        usage = row.get("usage", {})
        n = row.get("completion_tokens", usage.get("completion_tokens"))
        if n is None and "output_ids" in row:  # no count in the file: the ids'
            n = len(row["output_ids"])
        elif n is None:  # nor ids: the re-tokenised output's length
            n = len(tok.encode(row["content"], add_special_tokens=False)) + 1  # + eos (stop)
        lengths.append(n)
        p = row.get("prompt_tokens", usage.get("prompt_tokens"))
        prompt_tokens += (
            p
            if p is not None
            else len(row.get("prompt_ids") or chat_prompt_ids(tok, [{"role": "user", "content": row["prompt"]}]))
        )
        reason = row.get("finish_reason") or row["choices"][0]["finish_reason"]
        reason = reason["type"] if isinstance(reason, dict) else reason
        reasons[reason] = reasons.get(reason, 0) + 1
    lengths.sort()
    n = len(lengths)
    assert (stats.responses, stats.completion_tokens, stats.prompt_tokens) == (7, sum(lengths), prompt_tokens)
    assert stats.completion_tokens == report.completion_tokens
    assert stats.p50_length == lengths[math.ceil(n * 0.5) - 1]
    assert stats.p95_length == lengths[math.ceil(n * 0.95) - 1]
    assert stats.finish_reasons == {"length": 2, "stop": 5} == dict(sorted(reasons.items()))
    assert stats.parts == 4
    # first 1000.0 (flat), last: the file's mtime for the line without a timestamp
    assert stats.first_finished_at == 1000.0 and stats.last_finished_at == file.stat().st_mtime


# --- all or nothing, resume, lock, write failures, damaged parts ------------------------------


def flat_rows(n, start=0):
    """`n` distinct flat lines with ids r<start>.. (3 prompt ids, 4 output ids each)."""
    return [
        {"id": f"r{i}", "prompt_ids": [2, 10 + i % 50, 3], "output_ids": [20, 21, 22, 1], "finish_reason": "stop"}
        for i in range(start, start + n)
    ]


def entries(directory):
    """Every name in `directory`, hidden temporary files included."""
    return sorted(p.name for p in directory.iterdir()) if directory.is_dir() else []


def test_a_bad_line_anywhere_imports_nothing_of_the_file(tmp_path):
    run = tmp_path / "run"
    earlier = import_jsonl(run, "B1", write_lines(tmp_path / "earlier.jsonl", flat_rows(2, start=100)), tokenizer=None)
    before = entries(run / "responses" / "B1")
    assert before == [p.name for p in earlier.parts] and len(before) == 1

    # Five good lines, staged as five parts (flush_every=1), before the bad line 6.
    lines = [*flat_rows(5), {"id": "bad", "prompt_ids": [1], "output_ids": [1, "x"]}, *flat_rows(3, start=5)]
    file = write_lines(tmp_path / "raw.jsonl", lines)
    with pytest.raises(DatasetError, match=r"raw\.jsonl line 6: 'output_ids\[1\]' must be a non-negative int32"):
        import_jsonl(run, "B1", file, tokenizer=None, flush_every=1)
    assert entries(run / "responses" / "B1") == before  # no part, no staged temp file left
    assert {r["id"] for r in read_rows(run)} == {"r100", "r101"}

    # Skip: the other eight go in, the bad line is a reject of stage "import".
    report = import_jsonl(run, "B1", file, tokenizer=None, flush_every=3, on_bad_line="skip")
    assert (report.lines, report.imported, report.bad_lines, len(report.parts)) == (9, 8, 1, 3)
    check_counts(report)
    rejects = pq.read_table(report.rejects_part).to_pylist()
    assert [(r["row"], r["id"], r["stage"]) for r in rejects] == [(6, "bad", "import")]

    # The line fixed: only it is added, and every id is there exactly once.
    lines[5] = {"id": "bad", "prompt_ids": [1], "output_ids": [1, 2]}
    write_lines(file, lines)
    fixed = import_jsonl(run, "B1", file, tokenizer=None)
    assert (fixed.imported, fixed.skipped_existing) == (1, 8)
    ids = [r["id"] for r in read_rows(run)]
    assert sorted(ids) == sorted(["r100", "r101", "bad", *(f"r{i}" for i in range(8))])
    assert len(ids) == len(set(ids)) == 11
    assert [s.rejects for s in collect_stats(run)] == [0]  # the fixed line is no longer listed as bad


def test_parts_are_cut_by_tokens_too(tmp_path):
    # 7 ids a row: a budget of 14 ids makes parts of 2 rows however large flush_every is.
    report = import_jsonl(
        tmp_path / "run", "B1", write_lines(tmp_path / "raw.jsonl", flat_rows(5)), tokenizer=None, flush_tokens=14
    )
    assert [pq.read_metadata(p).num_rows for p in report.parts] == [2, 2, 1]
    assert [r["id"] for r in read_rows(tmp_path / "run")] == [f"r{i}" for i in range(5)]


def fail_writes_after(monkeypatch, n, error):
    """Make the import's part writer succeed `n` times, then raise `error`."""
    import tasks.generate.legacy_import as legacy

    real, calls = legacy.write_parquet_atomic, []

    def write(*args, **kwargs):
        calls.append(args[1])
        if len(calls) > n:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(legacy, "write_parquet_atomic", write)
    return calls


def test_disk_full_while_staging_keeps_the_run_as_it_was(tmp_path, monkeypatch):
    run = tmp_path / "run"
    import_jsonl(run, "B1", write_lines(tmp_path / "earlier.jsonl", flat_rows(2, start=100)), tokenizer=None)
    before = entries(run / "responses" / "B1")
    file = write_lines(tmp_path / "raw.jsonl", flat_rows(6))
    calls = fail_writes_after(monkeypatch, 1, OSError(errno.ENOSPC, "No space left on device"))
    with pytest.raises(WriteFailed) as failed:
        import_jsonl(run, "B1", file, tokenizer=None, flush_every=2)
    message = str(failed.value)
    assert len(calls) == 2  # stopped at the first failed write, did not go on to the third part
    assert message.startswith(f"cannot write {run / 'responses' / 'B1'}: disk full: ")
    assert f"kept: nothing of {file} was imported" in message and "to resume: " in message
    assert entries(run / "responses" / "B1") == before  # the staged first part is gone too
    assert {r["id"] for r in read_rows(run)} == {"r100", "r101"}  # earlier parts readable

    monkeypatch.undo()
    report = import_jsonl(run, "B1", file, tokenizer=None, flush_every=2)
    assert (report.imported, report.skipped_existing) == (6, 0)
    assert sorted(r["id"] for r in read_rows(run)) == sorted(["r100", "r101", *(f"r{i}" for i in range(6))])


def test_kill_while_committing_resumes_exactly_once(tmp_path, monkeypatch):
    run = tmp_path / "run"
    file = write_lines(tmp_path / "raw.jsonl", flat_rows(6))
    real, renames = os.replace, []

    def replace(src, dst):
        renames.append(Path(dst).name)
        if len(renames) == 5:  # 3 staged writes, the first commit rename, then "killed"
            raise KeyboardInterrupt
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(KeyboardInterrupt):
        import_jsonl(run, "B1", file, tokenizer=None, flush_every=2)
    monkeypatch.undo()
    assert renames[3:] == ["part-000000.parquet", "part-000001.parquet"]
    assert [r["id"] for r in read_rows(run)] == ["r0", "r1"]  # one whole part in place
    # A real kill -9 would also leave the unrenamed staged parts: the rerun must not count them.
    (run / "responses" / "B1" / ".import-999-deadbeef.tmp").write_bytes(b"PAR1 half a part")

    report = import_jsonl(run, "B1", file, tokenizer=None, flush_every=2)
    assert (report.imported, report.skipped_existing) == (4, 2)
    ids = [r["id"] for r in read_rows(run)]
    assert sorted(ids) == [f"r{i}" for i in range(6)] and len(ids) == 6
    assert entries(run / "responses" / "B1") == ["part-000000.parquet", "part-000001.parquet", "part-000002.parquet"]


def test_rename_failure_names_what_is_in_place(tmp_path, monkeypatch):
    run = tmp_path / "run"
    file = write_lines(tmp_path / "raw.jsonl", flat_rows(6))
    real, renames = os.replace, []

    def replace(src, dst):
        renames.append(dst)
        if len(renames) == 5:
            raise OSError(errno.EIO, "Input/output error")
        return real(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    with pytest.raises(WriteFailed) as failed:
        import_jsonl(run, "B1", file, tokenizer=None, flush_every=2)
    monkeypatch.undo()
    assert str(failed.value).startswith(f"cannot write {run / 'responses' / 'B1' / 'part-000001.parquet'}: I/O error")
    assert "kept: 1 of the 3 part(s) of" in str(failed.value)
    assert entries(run / "responses" / "B1") == ["part-000000.parquet"]
    assert import_jsonl(run, "B1", file, tokenizer=None).imported == 4
    assert sorted(r["id"] for r in read_rows(run)) == [f"r{i}" for i in range(6)]


def test_a_damaged_part_is_named(tmp_path):
    run = tmp_path / "run"
    file = write_lines(tmp_path / "raw.jsonl", flat_rows(4))
    report = import_jsonl(run, "B1", file, tokenizer=None, flush_every=2)
    damaged = report.parts[1]
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated, as a full disk or a copy cut short leaves it
    with pytest.raises(DamagedPart) as err:
        import_jsonl(run, "B1", file, tokenizer=None)
    where = run / "quarantine" / "responses" / "B1"
    assert str(err.value).startswith(f"{damaged} is damaged (100 bytes, not a readable Parquet file: ")
    assert f"Nothing was imported. Move it aside: mkdir -p {where} && mv {damaged} {where}/ -- then" in str(err.value)
    assert "\n" not in str(err.value)
    assert entries(run / "responses" / "B1") == ["part-000000.parquet", "part-000001.parquet"]

    # Moved away as told: its two responses are imported again, the others are not repeated.
    damaged.rename(tmp_path / damaged.name)
    again = import_jsonl(run, "B1", file, tokenizer=None)
    assert (again.imported, again.skipped_existing) == (2, 2)
    assert sorted(r["id"] for r in read_rows(run)) == ["r0", "r1", "r2", "r3"]


@pytest.mark.multiprocess
def test_a_second_writer_is_refused(tmp_path):
    run = tmp_path / "run"
    with lock_held_elsewhere(run, "generate B1") as holder:
        with pytest.raises(RunDirLocked, match=rf"in use by another writer: pid {holder.pid} on .*writing generate B1"):
            import_jsonl(run, "B1", write_lines(tmp_path / "raw.jsonl", flat_rows(2)), tokenizer=None)
    assert entries(run / "responses" / "B1") == []
    assert import_jsonl(run, "B1", tmp_path / "raw.jsonl", tokenizer=None).imported == 2  # free again


def test_run_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "run").write_text("not a directory")
    with pytest.raises(DatasetError, match="run: is not a directory"):
        import_jsonl(tmp_path / "run", "B1", write_lines(tmp_path / "raw.jsonl", FLAT), tokenizer=None)
    with pytest.raises(ValueError, match="cannot be a directory name"):
        import_jsonl(tmp_path / "run2", "../B1", tmp_path / "raw.jsonl", tokenizer=None)
