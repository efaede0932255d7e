import hashlib
import json
import logging
import pickle

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from settings.dataset import RowFormat
from tasks.datasets import (
    DatasetError,
    EmptyDatasetError,
    PassthroughRow,
    PromptRow,
    Reject,
    iter_rows,
    load_dataset,
    stable_id,
)
from tasks.responses.rejects import write_rejects

GENERATE_EXPECTED = "each row needs 'messages' [{role, content}] or 'prompt' (string)"


def _hash(content) -> str:
    # The contract, restated independently of the code under test.
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


PROMPTS = [
    {"id": "a", "prompt": "Say hi."},
    {"id": 7, "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Why?"}]},
    {"prompt": "What is 2+2?"},
    {"messages": [{"role": "user", "content": "Ünïcødé ✓", "name": "bob"}]},
    {
        "messages": [
            {"role": "user", "content": "a"},
            {"role": "assistant", "content": "b"},
            {"role": "user", "content": "c"},
        ]
    },
]
PROMPT_IDS = [
    "a",
    "7",
    "d4e2520adda51c13",  # literal: ids must not drift between releases
    _hash({"messages": [{"role": "user", "content": "Ünïcødé ✓", "name": "bob"}]}),
    _hash({"messages": PROMPTS[4]["messages"]}),
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _all_keys(rows):
    # from_pylist and Dataset.from_list take their columns from the first row only.
    keys = list(dict.fromkeys(k for r in rows for k in r))
    return [{k: r.get(k) for k in keys} for r in rows]


def write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(_all_keys(rows)), path)
    return path


def make_format(fmt, tmp_path, rows):
    if fmt == "jsonl":
        return write_jsonl(tmp_path / "d.jsonl", rows)
    if fmt == "json":
        return write_jsonl(tmp_path / "d.json", rows)
    if fmt == "parquet":
        return write_parquet(tmp_path / "d.parquet", rows)
    if fmt == "parquet_dir":
        d = tmp_path / "dir"
        d.mkdir()
        # Same schema in both parts; sorted names give the row order.
        table = pa.Table.from_pylist(_all_keys(rows))
        pq.write_table(table.slice(0, 2), d / "000.parquet")
        pq.write_table(table.slice(2), d / "001.parquet")
        (d / "_SUCCESS").write_text("")
        return d
    import datasets  # dev dependency: only tests build HF directories

    rows = _all_keys(rows)

    if fmt == "hf":
        datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "hf"))
        return tmp_path / "hf"
    if fmt == "hf_dict":
        ds = datasets.Dataset.from_list(rows)
        datasets.DatasetDict({"train": ds, "test": ds.select([0])}).save_to_disk(str(tmp_path / "hfdd"))
        return tmp_path / "hfdd"
    raise AssertionError(fmt)


FORMATS = ["jsonl", "json", "parquet", "parquet_dir", "hf", "hf_dict"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_every_format_loads_the_same_prompt_rows(fmt, tmp_path):
    # HF and Parquet stringify the mixed int/str id column; keep ids strings there.
    rows = [dict(r, id=str(r["id"])) if "id" in r else r for r in PROMPTS] if fmt != "jsonl" else PROMPTS
    loaded = load_dataset(make_format(fmt, tmp_path, rows), "generate")

    assert [r.id for r in loaded.rows] == PROMPT_IDS
    assert loaded.rows[0] == PromptRow("a", [{"role": "user", "content": "Say hi."}])
    assert loaded.rows[1].messages == PROMPTS[1]["messages"]
    # Arrow fills the absent "name" key with null; the row must still look as written.
    assert [r.messages for r in loaded.rows[2:]] == [
        [{"role": "user", "content": "What is 2+2?"}],
        [{"role": "user", "content": "Ünïcødé ✓", "name": "bob"}],
        PROMPTS[4]["messages"],
    ]
    assert loaded.rejects == [] and loaded.duplicates == 0


PASSTHROUGH = [
    {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]},
    {
        "id": "agent",
        "messages": [
            {"role": "user", "content": "ls"},
            {"role": "assistant", "content": "", "reasoning_content": "run it"},
            {"role": "tool", "content": ""},
            {"role": "assistant", "content": "empty dir"},
        ],
    },
    {"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf"])
def test_every_format_loads_the_same_passthrough_rows(fmt, tmp_path):
    loaded = load_dataset(make_format(fmt, tmp_path, PASSTHROUGH), "passthrough")

    assert [r.id for r in loaded.rows] == [_hash({"messages": PASSTHROUGH[0]["messages"]}), "agent", "e7f4eeb455ea3e51"]
    assert loaded.rows[1].messages[1] == {"role": "assistant", "content": "", "reasoning_content": "run it"}
    assert loaded.rows[1].messages[2] == {"role": "tool", "content": ""}
    assert loaded.rows[2] == PassthroughRow("e7f4eeb455ea3e51", None, [1, 2, 3], [0, 1, 1])


def test_bool_loss_mask_normalises_and_hashes_like_ints(tmp_path):
    path = write_parquet(tmp_path / "m.parquet", [{"input_ids": [1, 2, 3], "loss_mask": [False, True, True]}])
    (row,) = load_dataset(path, "passthrough").rows
    assert row.loss_mask == [0, 1, 1] and row.id == "e7f4eeb455ea3e51"


def test_stable_ids_match_across_formats_and_differ_by_content(tmp_path):
    rows = [{"prompt": "x"}, {"prompt": "y"}, {"messages": [{"role": "user", "content": "x"}]}]
    from_jsonl = [
        r.id for r in load_dataset(write_jsonl(tmp_path / "a.jsonl", rows), "generate", on_bad_row="skip").rows
    ]
    parquet = load_dataset(write_parquet(tmp_path / "a.parquet", rows[:2]), "generate")

    # A prompt and the same single user message are the same prompt: one id, the second dropped.
    assert from_jsonl == [
        _hash({"messages": [{"role": "user", "content": "x"}]}),
        _hash({"messages": [{"role": "user", "content": "y"}]}),
    ]
    assert [r.id for r in parquet.rows] == from_jsonl
    assert from_jsonl[0] != from_jsonl[1]
    assert stable_id({"messages": [{"role": "user", "content": "x"}]}) == from_jsonl[0]


def _bad_line_file(tmp_path, line: bytes, name="b1.jsonl"):
    path = tmp_path / name
    path.write_bytes(b'{"prompt": "fine"}\n   \n' + line + b'\n{"prompt": "after"}\n')
    return path


GENERATE_BAD = [
    (b'{"prompt": "x"', "invalid JSON"),
    (b'{"prompt": "caf\xe9"}', "not valid UTF-8 (byte 0xe9"),
    (b"[1, 2]", "expected a JSON object, got list"),
    (b'"just a string"', "expected a JSON object, got string"),
    (b"{}", "missing 'messages' or 'prompt'"),
    (b'{"text": "hi"}', "missing 'messages' or 'prompt' (row has: text)"),
    (b'{"messages": [{"role": "user", "content": 3}]}', "'messages[0].content' must be a string, got int"),
    (b'{"messages": [{"role": "user"}]}', "'messages[0].content' is missing"),
    (b'{"messages": [{"role": "user", "content": " "}]}', "'messages[0].content' is empty"),
    (b'{"messages": [{"content": "x"}]}', "'messages[0].role' is missing"),
    (
        b'{"messages": [{"role": "bot", "content": "x"}]}',
        "'messages[0].role' must be one of system, user, assistant, got 'bot'",
    ),
    (b'{"messages": [{"role": "tool", "content": "x"}]}', "'messages[0].role' must be one of"),
    (b'{"messages": ["hi"]}', "'messages[0]' must be an object {role, content}, got string"),
    (b'{"messages": "hi"}', "'messages' must be a list of {role, content} objects, got string"),
    (b'{"messages": []}', "'messages' is empty"),
    (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "system", "content": "s"}]}',
        "'messages' must end with a user turn (the prompt to answer), got 'system' last",
    ),
    (
        b'{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}',
        "'messages' must end with a user turn (the prompt to answer); it has none",
    ),
    (b'{"prompt": ""}', "'prompt' is empty"),
    (b'{"prompt": 5}', "'prompt' must be a string, got int"),
    (
        b'{"prompt": "y", "messages": [{"role": "user", "content": "x"}]}',
        "has both 'messages' and 'prompt', and 'prompt' is not the first user turn's content",
    ),
    (b'{"id": 1.5, "prompt": "x"}', "'id' must be a string or int, got float"),
    (b'{"id": true, "prompt": "x"}', "'id' must be a string or int, got bool"),
    (b'{"id": "", "prompt": "x"}', "'id' is empty"),
    (b'{"prompt": "\\ud83d"}', "'prompt' is not valid Unicode"),
]


PASSTHROUGH_BAD = [
    (b'{"messages": [{"role": "user", "content": "q"}]}', "'messages' has no assistant turn"),
    (
        b'{"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]}',
        "'messages[1].content' is empty",
    ),
    (b'{"messages": [{"role": "assistant", "content": "a"}], "input_ids": [1]}', "has both 'messages' and 'input_ids'"),
    (b'{"input_ids": [1, 2, 3], "loss_mask": [0, 1]}', "'loss_mask' has 2 entries but 'input_ids' has 3"),
    (b'{"input_ids": [1, 2], "loss_mask": [0, 0]}', "'loss_mask' has no 1s"),
    (b'{"input_ids": [1, 2], "loss_mask": [1, 2]}', "'loss_mask[1]' must be 0 or 1, got 2"),
    (b'{"input_ids": [1, 2], "loss_mask": [1, 0.5]}', "'loss_mask[1]' must be 0 or 1, got float"),
    (b'{"input_ids": [1, -5], "loss_mask": [1, 1]}', "'input_ids[1]' must be a non-negative int, got -5"),
    (b'{"input_ids": ["a", 2], "loss_mask": [1, 1]}', "'input_ids[0]' must be a non-negative int, got string"),
    (b'{"input_ids": [], "loss_mask": []}', "'input_ids' is empty"),
    (b'{"input_ids": "1 2", "loss_mask": [1]}', "'input_ids' must be a list of ints, got string"),
    (b'{"input_ids": [1, 2]}', "'loss_mask' is missing"),
    (b'{"loss_mask": [1]}', "'input_ids' is missing"),
    (b"{}", "missing 'messages' or 'input_ids' + 'loss_mask'"),
]


BAD_ROWS = [("generate", *bad) for bad in GENERATE_BAD] + [("passthrough", *bad) for bad in PASSTHROUGH_BAD]
GOOD_ROW = {"generate": b'{"prompt": "fine"}', "passthrough": b'{"input_ids": [1], "loss_mask": [1]}'}
EXPECTED = {
    "generate": GENERATE_EXPECTED,
    "passthrough": "each row needs 'messages' [{role, content}] with an assistant turn",
}


@pytest.mark.parametrize("kind,line,reason", BAD_ROWS, ids=[f"{kind}: {reason}" for kind, _, reason in BAD_ROWS])
def test_a_bad_row_names_file_line_and_field(tmp_path, kind, line, reason):
    path = tmp_path / "b1.jsonl"  # a good row, a blank line, the bad row (line 3), a good row after it
    path.write_bytes(GOOD_ROW[kind] + b"\n   \n" + line + b"\n" + GOOD_ROW[kind] + b"\n")
    with pytest.raises(DatasetError) as info:
        load_dataset(path, kind)
    err = info.value
    assert isinstance(err, ValueError)
    assert err.path == path and err.row == 3 and reason in err.reason
    unparsed = reason.startswith(("invalid JSON", "not valid UTF-8"))  # not a row yet: the file's format is named
    expected = "expected JSON Lines: one JSON object per line, UTF-8" if unparsed else EXPECTED[kind]
    assert str(err).startswith(f"{path} line 3: {reason}") and expected in str(err)


def test_error_message_format_exactly(tmp_path):
    path = _bad_line_file(tmp_path, b'{"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": 3}]}')
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate")
    assert str(info.value) == (f"{path} line 3: 'messages[1].content' must be a string, got int — {GENERATE_EXPECTED}")
    clone = pickle.loads(pickle.dumps(info.value))  # crosses process/Prefect boundaries intact
    assert (str(clone), clone.path, clone.row, clone.reason) == (str(info.value), path, 3, info.value.reason)


def test_bad_parquet_row_is_reported_by_row_number(tmp_path):
    path = write_parquet(tmp_path / "b2.parquet", [{"prompt": "ok"}, {"prompt": "ok2"}, {"prompt": ""}])
    with pytest.raises(DatasetError, match=r"b2\.parquet row 3: 'prompt' is empty — each row needs"):
        load_dataset(path, "generate")


def test_bad_row_in_parquet_directory_names_the_part_file(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    write_parquet(d / "a.parquet", [{"prompt": "1"}, {"prompt": "2"}])
    write_parquet(d / "b.parquet", [{"prompt": "3"}, {"prompt": " "}])
    with pytest.raises(DatasetError) as info:
        load_dataset(d, "generate")
    assert (info.value.path, info.value.row) == (d / "b.parquet", 2)


def test_skip_mode_keeps_good_rows_and_writes_rejects(tmp_path, caplog):
    path = tmp_path / "b1.jsonl"
    path.write_bytes(
        b'{"id": "g1", "prompt": "one"}\n'
        b'{"id": "b1", "prompt": ""}\n'
        b"not json\n"
        b"\n"
        b'{"id": "g2", "messages": [{"role": "user", "content": "two"}]}\n'
        b'{"id": 9, "messages": [{"role": "assistant", "content": "x"}]}\n'
        b"\xff\xfe\n"
    )
    with caplog.at_level(logging.WARNING, logger="eagle3.datasets"):
        loaded = load_dataset(path, "generate", on_bad_row="skip")

    assert [r.id for r in loaded.rows] == ["g1", "g2"]
    assert loaded.rows[1].messages == [{"role": "user", "content": "two"}]
    assert [(r.row, r.id) for r in loaded.rejects] == [(2, "b1"), (3, None), (6, "9"), (7, None)]
    assert loaded.rejects[0] == Reject(path, 2, "b1", "'prompt' is empty", '{"id": "b1", "prompt": ""}')
    assert loaded.rejects[1].reason.startswith("invalid JSON")
    assert loaded.rejects[2].reason.startswith("'messages' must end with a user turn")
    assert loaded.rejects[3].reason.startswith("not valid UTF-8")
    assert any("skipped 4 bad row(s)" in m for m in caplog.messages)

    out = write_rejects(loaded.rejects, tmp_path / "rejects" / "B1", stage="load")
    assert out == tmp_path / "rejects" / "B1" / "part-000000.parquet"
    table = pq.read_table(out)
    assert table.schema.field("id").type == pa.string() and table.schema.field("row").type == pa.int64()
    assert table.to_pylist()[0] == {
        "id": "b1",
        "source": str(path),
        "row": 2,
        "stage": "load",
        "cause": "bad_row",
        "reason": "'prompt' is empty",
        "raw": '{"id": "b1", "prompt": ""}',
    }
    assert table.column("row").to_pylist() == [2, 3, 6, 7]
    assert table.column("raw").to_pylist()[1:] == [
        "not json",
        '{"id": 9, "messages": [{"role": "assistant", "content": "x"}]}',
        "\ufffd\ufffd",
    ]
    # A resumed run loading the same file does not write the same rejects twice.
    assert write_rejects(loaded.rejects, tmp_path / "rejects" / "B1") == out
    assert write_rejects([], tmp_path / "rejects" / "B1") is None


def test_duplicate_ids_keep_first_and_count_rest(tmp_path, caplog):
    # Repeats with the same content (extra keys ignored, either spelling of a prompt) are duplicates.
    path = write_jsonl(
        tmp_path / "d.jsonl",
        [
            {"id": "x", "prompt": "first"},
            {"prompt": "same"},
            {"id": "x", "prompt": "first", "source": "mirror"},
            {"prompt": "same"},
            {"id": "x", "messages": [{"role": "user", "content": "first"}]},
        ],
    )
    with caplog.at_level(logging.WARNING, logger="eagle3.datasets"):
        loaded = load_dataset(path, "generate")

    assert [(r.id, r.messages[0]["content"]) for r in loaded.rows] == [
        ("x", "first"),
        (_hash({"messages": [{"role": "user", "content": "same"}]}), "same"),
    ]
    assert loaded.duplicates == 3 and loaded.rejects == []
    warnings = [r for r in caplog.records if r.name == "eagle3.datasets"]
    assert len(warnings) == 1 and "dropped 3 row(s)" in warnings[0].getMessage()
    assert "first repeat: id 'x' at " + f"{path} line 3" in warnings[0].getMessage()


REPEATED_ID_FIX = "ids must be unique within a dataset: give one of the two rows another id"


def test_repeated_id_with_different_content_fails_naming_both_rows(tmp_path):
    rows = [{"id": "x", "prompt": "first"}, {"id": "y", "prompt": "other"}, {"id": "x", "prompt": "second"}]
    path = write_jsonl(tmp_path / "b1.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate")
    assert (info.value.path, info.value.row) == (path, 3)
    assert str(info.value).startswith(
        f"{path} line 3: id 'x' repeats line 1 with different content — {REPEATED_ID_FIX}"
    )
    assert "on_bad_row: skip" in str(info.value)


def test_repeated_id_with_different_content_is_rejected_under_skip(tmp_path):
    path = write_jsonl(
        tmp_path / "b1.jsonl",
        [
            {"id": "x", "prompt": "first"},
            {"id": "y", "prompt": "other"},
            {"id": "x", "prompt": "second"},
            {"id": "x", "prompt": "first"},
            {"id": "x", "prompt": "third"},
        ],
    )
    loaded = load_dataset(path, "generate", on_bad_row="skip")

    assert [(r.id, r.messages[0]["content"]) for r in loaded.rows] == [("x", "first"), ("y", "other")]
    assert loaded.duplicates == 1
    assert [(r.row, r.id, r.reason) for r in loaded.rejects] == [
        (3, "x", "id 'x' repeats line 1 with different content"),
        (5, "x", "id 'x' repeats line 1 with different content"),
    ]
    assert loaded.rejects[0].raw == '{"id": "x", "prompt": "second"}'
    table = pq.read_table(write_rejects(loaded.rejects, tmp_path / "rejects"))
    assert table.column("row").to_pylist() == [3, 5]


def test_repeated_passthrough_id_with_different_tokens_is_a_bad_row(tmp_path):
    path = write_jsonl(
        tmp_path / "a1.jsonl",
        [
            {"id": "t", "input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]},
            {"id": "t", "input_ids": [1, 2, 3], "loss_mask": [False, True, True]},  # same content
            {"id": "t", "input_ids": [1, 2, 4], "loss_mask": [0, 1, 1]},
        ],
    )
    with pytest.raises(DatasetError, match=r"a1\.jsonl line 3: id 't' repeats line 1 with different content"):
        load_dataset(path, "passthrough")
    loaded = load_dataset(path, "passthrough", on_bad_row="skip")
    assert [r.input_ids for r in loaded.rows] == [[1, 2, 3]]
    assert (loaded.duplicates, [r.row for r in loaded.rejects]) == (1, [3])


@pytest.mark.parametrize(
    "first,repeat,reason",
    [
        (7, "7", 'id "7" collides with id 7 at line 1'),
        ("7", 7, 'id 7 collides with id "7" at line 1'),
    ],
)
def test_int_and_string_id_collide_even_with_the_same_content(tmp_path, first, repeat, reason):
    path = write_jsonl(
        tmp_path / "b1.jsonl",
        [
            {"id": first, "prompt": "same"},
            {"id": "8", "prompt": "eight"},
            {"id": repeat, "prompt": "same"},
        ],
    )
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate")
    assert info.value.row == 3
    assert str(info.value).startswith(f"{path} line 3: {reason}: ids are compared as strings")
    assert REPEATED_ID_FIX in str(info.value)

    loaded = load_dataset(path, "generate", on_bad_row="skip")
    assert [r.id for r in loaded.rows] == ["7", "8"]
    assert [(r.row, r.id) for r in loaded.rejects] == [(3, "7")] and loaded.duplicates == 0
    assert loaded.rejects[0].reason.startswith(reason)


def test_repeat_across_parquet_parts_names_the_first_part(tmp_path):
    d = tmp_path / "parts"
    d.mkdir()
    pq.write_table(pa.table({"id": [7, 8], "prompt": ["a", "b"]}), d / "a.parquet")
    pq.write_table(pa.table({"id": ["8", "9"], "prompt": ["b", "c"]}), d / "b.parquet")
    with pytest.raises(DatasetError) as info:
        load_dataset(d, "generate")
    assert (info.value.path, info.value.row) == (d / "b.parquet", 1)
    assert f'id "8" collides with id 8 at {d / "a.parquet"} row 2' in str(info.value)

    pq.write_table(pa.table({"id": [8, 9], "prompt": ["B", "c"]}), d / "b.parquet")
    with pytest.raises(
        DatasetError, match=r"b\.parquet row 1: id '8' repeats .*a\.parquet row 2 with different content"
    ):
        load_dataset(d, "generate")


@pytest.mark.parametrize("kind", ["generate", "passthrough"])
@pytest.mark.parametrize("content", [b"", b"\n  \n\r\n"], ids=["empty", "blank-lines"])
def test_empty_jsonl_is_an_error(tmp_path, kind, content):
    path = tmp_path / "d.jsonl"
    path.write_bytes(content)
    for on_bad_row in ("fail", "skip"):
        with pytest.raises(EmptyDatasetError) as info:
            load_dataset(path, kind, on_bad_row=on_bad_row)
        assert isinstance(info.value, DatasetError) and info.value.row is None
        assert str(info.value) == (
            f"{path}: has no rows — a dataset needs at least one row: check that datasets[i].path"
            " names the right file, or remove the dataset from the config"
        )


def test_parquet_without_rows_is_an_error(tmp_path):
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"id": pa.array([], pa.string()), "prompt": pa.array([], pa.string())}), path)
    with pytest.raises(EmptyDatasetError, match=r"d\.parquet: has no rows — a dataset needs at least one row"):
        load_dataset(path, "generate")


def test_no_usable_row_after_skipping_is_an_error(tmp_path):
    path = write_jsonl(tmp_path / "b1.jsonl", [{"prompt": ""}, {"prompt": 5}])
    with pytest.raises(EmptyDatasetError) as info:
        load_dataset(path, "generate", on_bad_row="skip")
    assert str(info.value) == (
        f"{path}: has no usable row: all 2 row(s) are bad (first: {path} line 1: 'prompt' is empty)"
        " — fix the rows (`eagle3 validate CONFIG` lists them), or remove the dataset from the config"
    )
    assert [r.row for r in info.value.rejects] == [1, 2]
    clone = pickle.loads(pickle.dumps(info.value))
    assert type(clone) is EmptyDatasetError and str(clone) == str(info.value)
    # Under fail, the first bad row is the error, as before.
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate")
    assert not isinstance(info.value, EmptyDatasetError) and info.value.row == 1


def test_missing_path_is_the_users_to_provide(tmp_path):
    missing = tmp_path / "data" / "b9.jsonl"
    with pytest.raises(FileNotFoundError) as info:
        load_dataset(missing, "generate")
    assert isinstance(info.value, DatasetError)
    assert str(info.value).startswith(f"{missing}: does not exist")
    assert "datasets[i].path" in str(info.value)
    with pytest.raises(DatasetError, match="does not exist"):
        iter_rows(missing, "generate")  # raised at the call, not at the first row


def test_unsupported_inputs_list_accepted_formats(tmp_path):
    csv = tmp_path / "d.csv"
    csv.write_text("a,b\n")
    with pytest.raises(DatasetError, match=r"unsupported file type '\.csv'.*accepted: a \.jsonl/\.json file"):
        load_dataset(csv, "generate")
    (tmp_path / "empty").mkdir()
    with pytest.raises(DatasetError, match="no \\*\\.parquet files.*accepted:"):
        load_dataset(tmp_path / "empty", "generate")
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(b"not parquet")
    with pytest.raises(DatasetError, match="not a readable Parquet file"):
        load_dataset(bad, "generate")


def test_parquet_without_content_columns_is_a_file_error(tmp_path):
    path = write_parquet(tmp_path / "x.parquet", [{"id": "1", "text": "hi"}])
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate", row_format=RowFormat(format="messages"), on_bad_row="skip")
    assert info.value.row is None
    assert str(info.value).startswith(f"{path}: has no 'messages' or 'prompt' column (columns: id, text)")
    with pytest.raises(DatasetError) as info:  # format auto: no format fits (tests/tasks/test_dataset_formats.py)
        load_dataset(path, "generate", on_bad_row="skip")
    assert info.value.row is None
    assert str(info.value).startswith(f"{path}: has columns [id, text], which fit no row format")


def test_dataset_dict_without_train_lists_splits(tmp_path):
    import datasets

    ds = datasets.Dataset.from_list([{"prompt": "x"}])
    datasets.DatasetDict({"validation": ds, "test": ds}).save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DatasetError, match=r"without a 'train' split \(splits: validation, test\).*dd/validation"):
        load_dataset(tmp_path / "dd", "generate")


def test_json_array_file_gets_a_hint(tmp_path):
    path = tmp_path / "arr.json"
    path.write_text('[\n  {"prompt": "x"}\n]\n')
    with pytest.raises(DatasetError, match="line 1: invalid JSON .*looks like one JSON array"):
        load_dataset(path, "generate")


def test_iter_rows_yields_line_numbers_and_raises_on_unparseable(tmp_path):
    path = _bad_line_file(tmp_path, b"{oops")
    rows = iter_rows(path, "generate")
    assert next(rows) == (
        1,
        PromptRow(_hash({"messages": [{"role": "user", "content": "fine"}]}), [{"role": "user", "content": "fine"}]),
    )
    with pytest.raises(DatasetError, match=r"b1\.jsonl line 3: invalid JSON"):
        next(rows)
    ok = write_jsonl(tmp_path / "ok.jsonl", [{"id": "a", "prompt": "a", "extra": 1}, {"prompt": 3}])
    (first, row), (second, bad) = iter_rows(ok, "generate")
    assert (first, row) == (1, PromptRow("a", [{"role": "user", "content": "a"}]))
    assert second == 2 and bad.reason == "'prompt' must be a string, got int"  # a bad row is yielded, not raised


def test_argument_checks(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "x"}])
    with pytest.raises(ValueError, match="on_bad_row"):
        load_dataset(path, "generate", on_bad_row="ignore")
    with pytest.raises(ValueError, match="kind"):
        load_dataset(path, "chat")
