"""Row formats (tasks/datasets/formats.py, detect.py): each public shape reads as `messages` rows written by hand."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from settings.dataset import RowFormat
from tasks.datasets import DatasetError, PromptRow, iter_rows, load_dataset
from tasks.datasets.detect import Resolver

SAMPLES = Path(__file__).resolve().parents[2] / "data" / "formats"  # not data/samples: the tiny target trains on those
FORMATS = ["sharegpt", "alpaca", "columns", "ultrachat", "glaive"]
KINDS = ["generate", "passthrough"]
DOC = (
    "row formats: messages, sharegpt, alpaca, columns, ultrachat, glaive (docs/run-a-pipeline.md#row-formats: the "
    "config lines of each)"
)
CONFIGURED = {  # the config lines that name each sample's format instead of detecting it
    "sharegpt": RowFormat(format="sharegpt"),
    "alpaca": RowFormat(format="alpaca"),
    "columns": RowFormat(format="columns", prompt_field="problem", response_field="solution"),
    "ultrachat": RowFormat(format="ultrachat"),
    "glaive": RowFormat(format="glaive"),
}


def _hash(content) -> str:
    # The id contract, restated independently of the code under test.
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()[:16]


def _lines(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


def _parquet(path: Path, rows: list[dict]) -> Path:
    # Arrow wants one type per column: ids as strings, every key in every row (null where a row lacks it).
    keys = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{k: (str(r[k]) if k == "id" and k in r else r.get(k)) for k in keys} for r in rows]
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fmt", FORMATS)
def test_each_sample_reads_as_its_messages_file(fmt, kind):
    expected = load_dataset(SAMPLES / f"fmt_{fmt}_as_messages.jsonl", kind, row_format=RowFormat(format="messages"))
    for row_format in (None, RowFormat(), CONFIGURED[fmt]):  # auto by default, auto said, and the format named
        loaded = load_dataset(SAMPLES / f"fmt_{fmt}.jsonl", kind, row_format=row_format)
        assert [(r.id, r.messages) for r in loaded.rows] == [(r.id, r.messages) for r in expected.rows]
        assert len(loaded.rows) == 5 and not loaded.rejects
        assert loaded.shape.format == fmt and loaded.shape.auto == (row_format is not CONFIGURED[fmt])


def test_ids_are_kept_or_hash_the_canonical_messages():
    # Stated without the loader: explicit ids stay (an int as its digits), a row without id hashes its messages.
    sharegpt = load_dataset(SAMPLES / "fmt_sharegpt.jsonl", "passthrough").rows
    assert [r.id for r in sharegpt] == [
        "sg-1",
        "sg-2",
        "3",
        _hash(
            {
                "messages": [
                    {"role": "user", "content": "Convert 3 miles to kilometres."},
                    {"role": "assistant", "content": "3 miles is about 4.83 kilometres (1 mile = 1.609 km)."},
                ]
            }
        ),
        "sg-5",
    ]
    alpaca = load_dataset(SAMPLES / "fmt_alpaca.jsonl", "generate").rows
    translate = [{"role": "user", "content": "Translate the sentence into French.\n\nThe library opens at nine."}]
    assert alpaca[1] == PromptRow(_hash({"messages": translate}), translate)
    # an empty input adds no blank line
    assert alpaca[0].messages == [{"role": "user", "content": 'Give three synonyms for "happy".'}]


def test_a_prompt_is_cut_after_its_last_user_turn_in_every_format(tmp_path):
    # ultrachat row "1" is user, assistant, user, assistant: the prompt is the first three turns
    (row,) = [r for r in load_dataset(SAMPLES / "fmt_ultrachat.jsonl", "generate").rows if r.id == "1"]
    assert [m["role"] for m in row.messages] == ["user", "assistant", "user"]
    assert row.messages[-1]["content"] == "Is 2100 one?"
    # the same rule for `messages`; the cut turns are not checked (an empty answer to be written is common)
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": ""}]
    (cut,) = load_dataset(_jsonl(tmp_path / "m.jsonl", [{"messages": messages}]), "generate").rows
    assert cut == PromptRow(_hash({"messages": messages[:1]}), messages[:1])
    conversations = [{"from": "human", "value": "q"}, {"from": "gpt", "value": ""}]
    (same,) = load_dataset(_jsonl(tmp_path / "s.jsonl", [{"conversations": conversations}]), "generate").rows
    assert same == cut
    # a generate row of columns without the response column is the prompt alone, with the same id
    rows = [{"problem": "q"}]
    (alone,) = load_dataset(_jsonl(tmp_path / "c.jsonl", rows), "generate", row_format=CONFIGURED["columns"]).rows
    assert alone == cut


@pytest.mark.parametrize("reader", ["parquet", "parquet_dir", "hf"])
@pytest.mark.parametrize("fmt", FORMATS)
def test_parquet_and_saved_datasets_go_through_the_same_formats(fmt, reader, tmp_path):
    rows = _lines(SAMPLES / f"fmt_{fmt}.jsonl")
    if reader == "parquet":
        path = _parquet(tmp_path / "d.parquet", rows)
    elif reader == "parquet_dir":
        path = tmp_path / "parts"
        path.mkdir()
        _parquet(path / "000.parquet", rows[:2])
        _parquet(path / "001.parquet", rows[2:])
    else:
        import datasets  # dev dependency: only tests build HF directories

        keys = list(dict.fromkeys(k for r in rows for k in r))
        table = [{k: (str(r[k]) if k == "id" and k in r else r.get(k)) for k in keys} for r in rows]
        datasets.Dataset.from_list(table).save_to_disk(str(tmp_path / "hf"))
        path = tmp_path / "hf"
    expected = load_dataset(SAMPLES / f"fmt_{fmt}_as_messages.jsonl", "passthrough").rows
    loaded = load_dataset(path, "passthrough")
    assert [(r.id, r.messages) for r in loaded.rows] == [(str(r.id), r.messages) for r in expected]
    assert loaded.shape.format == fmt and loaded.shape.auto


def test_a_column_reader_reads_only_the_columns_of_the_format(tmp_path):
    schema = pa.schema({name: pa.string() for name in ("id", "problem", "solution", "lang", "seed")})
    resolver = Resolver("passthrough", RowFormat())
    assert resolver.columns(tmp_path / "x.parquet", schema) == ["id", "problem", "solution"]
    assert resolver.shape.describe() == "columns (auto: problem -> user, solution -> assistant)"
    named = Resolver(
        "generate", RowFormat(format="columns", prompt_field="problem", system_field="seed", id_field="lang")
    )
    assert named.columns(tmp_path / "x.parquet", schema) == ["lang", "seed", "problem"]
    with pytest.raises(DatasetError) as info:
        Resolver("passthrough", RowFormat(format="sharegpt")).columns(tmp_path / "x.parquet", schema)
    assert str(info.value).startswith(f"{tmp_path / 'x.parquet'}: has no 'conversations' column for format sharegpt")


GOOD_FIRST = {  # a good row of each format on line 1, so that auto has decided before the bad row on line 3
    "sharegpt": {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
    "alpaca": {"instruction": "q", "output": "a"},
    "columns": {"problem": "q", "solution": "a"},
    "ultrachat": {"data": ["q", "a"]},
    "glaive": {"system": "SYSTEM: s", "chat": "USER: q\n\n\nASSISTANT: a <|endoftext|>"},
}


def glaive(chat, system="SYSTEM: s") -> dict:
    """A glaive row: its system prompt and its chat, one string of USER:/ASSISTANT:/FUNCTION RESPONSE: turns."""
    return {"system": system, "chat": chat}


BAD = [  # format, kind, the bad row, what the error says is wrong
    ("sharegpt", "passthrough", {"id": "x", "messages": []}, "'conversations' is missing (row has: id, messages)"),
    (
        "sharegpt",
        "passthrough",
        {"conversations": {"from": "human"}},
        "'conversations' must be a list of {from, value} objects, got object",
    ),
    (
        "sharegpt",
        "passthrough",
        {"conversations": [{"from": "human"}, {"from": "gpt", "value": "a"}]},
        "'conversations[0].value' is missing",
    ),
    ("sharegpt", "passthrough", {"conversations": [{"value": "q"}]}, "'conversations[0].from' is missing"),
    (
        "sharegpt",
        "passthrough",
        {"conversations": [{"from": "bot", "value": "q"}]},
        "'conversations[0].from' is 'bot', not a role name",
    ),
    (
        "sharegpt",
        "passthrough",
        {"conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": " "}]},
        "'conversations[1].value' is empty",
    ),
    (
        "sharegpt",
        "passthrough",
        {"conversations": [{"from": "human", "value": "q"}]},
        "'conversations' has no assistant turn",
    ),
    ("sharegpt", "generate", {"conversations": [{"from": "gpt", "value": "a"}]}, "'conversations' has no user turn"),
    (
        "sharegpt",
        "generate",
        {"conversations": [{"from": "tool", "value": "t"}, {"from": "human", "value": "q"}]},
        "'conversations[0].from' is a tool turn",
    ),
    ("alpaca", "generate", {"input": "x", "output": "a"}, "'instruction' is missing (row has: input, output)"),
    ("alpaca", "generate", {"instruction": " "}, "'instruction' is empty"),
    ("alpaca", "generate", {"instruction": "q", "input": 7}, "'input' must be a string, got int"),
    ("alpaca", "passthrough", {"instruction": "q", "input": "x"}, "'output' is missing"),
    ("columns", "generate", {"solution": "a"}, "'problem' is missing (row has: solution)"),
    ("columns", "passthrough", {"problem": "q"}, "'solution' is missing"),
    ("columns", "passthrough", {"problem": "q", "solution": ["a"]}, "'solution' must be a string, got list"),
    (
        "ultrachat",
        "generate",
        {"data": {"q": "a"}},
        "'data' must be a list of strings (user, assistant, ... alternating), got object",
    ),
    ("ultrachat", "generate", {"data": []}, "'data' is empty"),
    ("ultrachat", "passthrough", {"data": ["q", 5]}, "'data[1]' must be a string, got int"),
    ("ultrachat", "passthrough", {"id": "u", "text": "q"}, "'data' is missing (row has: id, text)"),
    ("glaive", "generate", glaive(" <|endoftext|>\n"), "'chat' is empty"),
    ("glaive", "generate", glaive(["USER: q"]), "'chat' must be a string of USER:/ASSISTANT:"),
    ("glaive", "passthrough", {"system": "SYSTEM: s", "text": "USER: q"}, "'chat' is missing (row has: system, text)"),
    ("glaive", "passthrough", glaive("ASSISTANT: a"), "'chat' has no USER: turn"),
    ("glaive", "generate", glaive("USER: q", system=3), "'system' must be a string, got int"),
    (
        "glaive",
        "generate",
        glaive("Hello USER: q"),
        "'chat' does not open with a role marker (USER:, ASSISTANT:, FUNCTION RESPONSE:): 'Hello USER: q'",
    ),
    ("glaive", "passthrough", glaive("USER: q\nASSISTANT: <|endoftext|>"), "'chat turn 2 (ASSISTANT:)' is empty"),
    ("glaive", "passthrough", glaive("USER: q\nFUNCTION RESPONSE: {}"), "'chat' has no assistant turn"),
    (
        "glaive",
        "generate",
        glaive("USER: q\nASSISTANT: <functioncall> {}\nFUNCTION RESPONSE: {}\nUSER: thanks", system=""),
        "'chat turn 3 (FUNCTION RESPONSE:)' is a tool turn; a prompt to generate from has system, user, assistant",
    ),
]


@pytest.mark.parametrize("configured", [False, True], ids=["auto", "configured"])
@pytest.mark.parametrize("fmt, kind, row, reason", BAD, ids=[r for _, _, _, r in BAD])
def test_a_bad_row_of_each_format_names_file_row_and_what_is_missing(tmp_path, fmt, kind, row, reason, configured):
    path = tmp_path / "b1.jsonl"
    path.write_text(json.dumps(GOOD_FIRST[fmt]) + "\n\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError) as info:
        load_dataset(path, kind, row_format=CONFIGURED[fmt] if configured else None)
    err = info.value
    assert err.path == path and err.row == 3 and reason in err.reason
    assert str(err).startswith(f"{path} line 3: {reason}") and "\n" not in str(err)
    assert (f"format {fmt}: each row needs" in str(err)) or "roles: {bot: user}" in str(err)


def test_a_bad_row_under_skip_is_rejected_with_its_id_field(tmp_path):
    rows = [{"prompt_id": "p1", "data": ["q", "a"]}, {"prompt_id": "p2", "data": ["q", 3]}]
    path = _jsonl(tmp_path / "u.jsonl", rows)
    loaded = load_dataset(path, "passthrough", row_format=RowFormat(id_field="prompt_id"), on_bad_row="skip")
    assert [r.id for r in loaded.rows] == ["p1"]
    assert [(r.row, r.id, r.reason) for r in loaded.rejects] == [(2, "p2", "'data[1]' must be a string, got int")]


ALPACA = "alpaca (auto: instruction + input -> user, output -> assistant)"


def _columns(user: str, assistant: str) -> str:
    """How validate describes the columns format it picked."""
    return f"columns (auto: {user} -> user, {assistant} -> assistant)"


DETECTED = [  # a row, the kind, the format auto picks, and how validate describes it
    ({"messages": [{"role": "user", "content": "q"}]}, "generate", "messages (auto)"),
    ({"prompt": "q", "source": "x"}, "generate", "messages (auto)"),
    ({"input_ids": [1], "loss_mask": [1]}, "passthrough", "messages (auto)"),
    (
        {"id": "1", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        "passthrough",
        "sharegpt (auto: conversations: from -> role, value -> content)",
    ),
    ({"instruction": "q", "input": "", "output": "a"}, "passthrough", ALPACA),
    ({"instruction": "q", "response": "a"}, "generate", ALPACA),
    ({"problem": "q", "solution": "a", "lang": "py"}, "passthrough", _columns("problem", "solution")),
    (
        {"problem": "q", "generated_solution": "a", "expected_answer": "1"},
        "passthrough",
        _columns("problem", "generated_solution"),
    ),
    ({"question": "q", "generated_solution": "a"}, "passthrough", _columns("question", "generated_solution")),
    ({"id": "o1", "input": "q", "output": "a", "domain": "x"}, "passthrough", _columns("input", "output")),
    ({"id": "0", "data": ["q", "a"]}, "passthrough", "ultrachat (auto: data: user, assistant, ... alternating)"),
    (
        {"system": "SYSTEM: s", "chat": "USER: q\nASSISTANT: a"},
        "passthrough",
        "glaive (auto: system -> system, chat: USER: -> user, ASSISTANT: -> assistant, FUNCTION RESPONSE: -> tool)",
    ),
    (
        {"prompt": "q", "prompt_id": "p", "messages": [{"role": "user", "content": "q"}]},
        "generate",
        "messages (auto)",
    ),
]


@pytest.mark.parametrize("reader", ["jsonl", "parquet"])
@pytest.mark.parametrize("row, kind, described", DETECTED, ids=[d for _, _, d in DETECTED])
def test_auto_picks_each_format_from_a_row_or_the_columns(tmp_path, row, kind, described, reader):
    path = _jsonl(tmp_path / "d.jsonl", [row]) if reader == "jsonl" else _parquet(tmp_path / "d.parquet", [row])
    loaded = load_dataset(path, kind)
    assert loaded.shape.describe() == described and len(loaded.rows) == 1


AMBIGUOUS = [
    (
        {"messages": [{"role": "user", "content": "q"}], "conversations": [{"from": "human", "value": "q"}]},
        "(messages, sharegpt)",
        "set format: messages or format: sharegpt in the dataset's config",
    ),
    (
        {"instruction": "q", "problem": "p", "solution": "s"},
        "(alpaca, columns)",
        (
            "set format: alpaca or format: columns, prompt_field: problem, response_field: solution in the dataset's "
            "config"
        ),
    ),
]


@pytest.mark.parametrize("row, formats, fix", AMBIGUOUS, ids=["messages+sharegpt", "alpaca+columns"])
def test_auto_refuses_an_ambiguous_row_with_the_config_lines(tmp_path, row, formats, fix):
    path = _jsonl(tmp_path / "a.jsonl", [row])
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate")
    keys = ", ".join(row)
    said = f"which fit more than one row format {formats}; {fix} — {DOC}"
    assert str(info.value) == f"{path} line 1: has keys [{keys}], {said}"
    with pytest.raises(DatasetError) as info:  # a column reader: the file's columns, no row
        load_dataset(_parquet(tmp_path / "a.parquet", [row]), "generate")
    assert info.value.row is None
    assert str(info.value).endswith(f"has columns [{keys}], {said}")


def test_an_unknown_shape_shows_its_keys_and_the_config_line_that_reads_it(tmp_path):
    rows = [{"id": 1, "question": "What is 6 x 7?", "answer": "42"}]
    path = _jsonl(tmp_path / "q.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "passthrough")
    fix = f"set format: columns, prompt_field: question, response_field: answer in the dataset's config — {DOC}"
    assert str(info.value) == f"{path} line 1: has keys [id, question, answer], which fit no row format; {fix}"
    # the line it shows reads the rows
    hinted = RowFormat(format="columns", prompt_field="question", response_field="answer")
    (row,) = load_dataset(path, "passthrough", row_format=hinted).rows
    assert row.id == "1"
    assert row.messages == [{"role": "user", "content": "What is 6 x 7?"}, {"role": "assistant", "content": "42"}]
    # nothing to guess from: the placeholders, and the other formats
    with pytest.raises(DatasetError) as info:
        load_dataset(_jsonl(tmp_path / "g.jsonl", [{"system": "s", "dialogue": "USER: hi"}]), "passthrough")
    assert str(info.value).endswith(
        "has keys [system, dialogue], which fit no row format; set format: columns, "
        "prompt_field: COLUMN, response_field: COLUMN, system_field: system in the "
        f"dataset's config — {DOC}"
    )
    with pytest.raises(DatasetError) as info:  # a column reader says it of the file
        load_dataset(_parquet(tmp_path / "q.parquet", rows), "generate")
    parquet = tmp_path / "q.parquet"
    assert str(info.value) == f"{parquet}: has columns [id, question, answer], which fit no row format; {fix}"


def test_the_first_row_that_fits_decides_for_the_dataset(tmp_path):
    path = _jsonl(tmp_path / "m.jsonl", [{"junk": 1}, {"data": ["q", "a"]}, {"instruction": "q", "output": "a"}])
    loaded = load_dataset(path, "passthrough", on_bad_row="skip")
    assert loaded.shape.format == "ultrachat" and len(loaded.rows) == 1
    assert [r.reason for r in loaded.rejects] == [
        "has keys [junk], which fit no row format; set format: columns, prompt_field: COLUMN, response_field: COLUMN "
        "in the dataset's config",
        "'data' is missing (row has: instruction, output)",
    ]


def test_role_names_map_through_the_aliases_and_the_roles_setting(tmp_path):
    rows = [{"id": "r", "messages": [{"role": "human", "content": "q"}, {"role": "gpt", "content": "a"}]}]
    (row,) = load_dataset(_jsonl(tmp_path / "m.jsonl", rows), "passthrough").rows
    assert row.messages == [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    rows = [{"conversations": [{"from": "customer", "value": "q"}, {"from": "agent", "value": "a"}]}]
    path = _jsonl(tmp_path / "s.jsonl", rows)
    with pytest.raises(DatasetError, match=r"'conversations\[0\]\.from' is 'customer'.* roles: \{customer: user\}"):
        load_dataset(path, "passthrough")
    mapped = load_dataset(path, "passthrough", row_format=RowFormat(roles={"customer": "user", "agent": "assistant"}))
    assert mapped.rows[0].messages == row.messages and mapped.rows[0].id == _hash({"messages": row.messages})
    assert mapped.shape.describe() == (
        "sharegpt (auto: conversations: from -> role, value -> content; roles: customer -> user, agent -> assistant)"
    )
    hint = r"got 'bot' \(another name for a role: map it with roles: \{bot: \.\.\.\}\)"
    with pytest.raises(DatasetError, match=hint):
        load_dataset(_jsonl(tmp_path / "b.jsonl", [{"messages": [{"role": "bot", "content": "x"}]}]), "generate")


def test_id_field_and_system_field(tmp_path):
    rows = [
        {"prompt_id": 7, "id": "ignored", "sys": "Be brief.", "q": "hi", "a": "hello"},
        {"prompt_id": "p2", "sys": "", "q": "bye", "a": "ciao"},
    ]
    fmt = RowFormat(format="columns", prompt_field="q", response_field="a", system_field="sys", id_field="prompt_id")
    loaded = load_dataset(_jsonl(tmp_path / "c.jsonl", rows), "passthrough", row_format=fmt)
    assert [(r.id, r.messages) for r in loaded.rows] == [
        (
            "7",
            [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "hello"},
            ],
        ),
        ("p2", [{"role": "user", "content": "bye"}, {"role": "assistant", "content": "ciao"}]),  # empty system: no turn
    ]
    assert loaded.shape.describe() == "columns (configured: sys -> system, q -> user, a -> assistant; id: prompt_id)"
    with pytest.raises(DatasetError, match="line 1: 'prompt_id' must be a string or int, got float"):
        load_dataset(_jsonl(tmp_path / "f.jsonl", [{"prompt_id": 1.5, "q": "x"}]), "generate", row_format=fmt)


def test_the_settings_are_checked_where_declared():
    with pytest.raises(ValidationError, match="prompt_field apply to format: columns only"):
        RowFormat(prompt_field="problem")
    with pytest.raises(ValidationError, match="format: columns needs prompt_field"):
        RowFormat(format="columns")
    with pytest.raises(ValidationError, match="format"):
        RowFormat(format="csv")
    with pytest.raises(ValidationError, match="roles"):
        RowFormat(roles={"bot": "robot"})
    with pytest.raises(ValidationError, match="id_field"):
        RowFormat(id_field="")


def test_iter_rows_reads_in_the_datasets_format():
    rows = list(iter_rows(SAMPLES / "fmt_columns.jsonl", "passthrough", CONFIGURED["columns"]))
    expected = load_dataset(SAMPLES / "fmt_columns_as_messages.jsonl", "passthrough").rows
    assert [row for _, row in rows] == expected and [n for n, _ in rows] == [1, 2, 3, 4, 5]


def test_a_passthrough_copy_is_made_again_when_the_row_format_changes(tmp_path):
    from tasks.generate.passthrough import copy_passthrough

    source = tmp_path / "pt.jsonl"
    source.write_text((SAMPLES / "fmt_sharegpt.jsonl").read_text())
    args = ("A1", source, tmp_path / "out", tmp_path / "rejects", "fail")
    assert copy_passthrough(*args, RowFormat()).copied and not copy_passthrough(*args, RowFormat()).copied
    assert not copy_passthrough(*args).copied  # no format given: auto, the same copy
    assert copy_passthrough(*args, RowFormat(format="sharegpt")).copied


def test_glaive_splits_chat_on_its_role_markers_and_keeps_function_calls_as_text():
    rows = load_dataset(SAMPLES / "fmt_glaive.jsonl", "passthrough").rows
    first = rows[0].messages
    assert [m["role"] for m in first] == ["system", "user", "assistant", "tool", "assistant"]
    assert first[0]["content"].startswith("You are a helpful assistant with access to the following functions.")
    # the function call is the assistant turn's text, its <|endoftext|> removed: no tool_calls are parsed
    assert first[2] == {
        "role": "assistant",
        "content": '<functioncall> {"name": "get_time", "arguments": \'{"zone": "Asia/Tokyo"}\'}',
    }
    assert rows[3].messages[0] == {"role": "user", "content": "Is a tomato a fruit?\nAsking for a quiz."}  # no system
    # a prompt ends at its last USER: turn, with the id the same conversation gets as `messages`
    prompts = load_dataset(SAMPLES / "fmt_glaive.jsonl", "generate").rows
    assert [m["role"] for m in prompts[0].messages] == ["system", "user"]
    assert [m["role"] for m in prompts[1].messages] == ["system", "user", "assistant", "user"]
    assert prompts[2].id == _hash({"messages": prompts[2].messages})


def test_a_bad_glaive_row_is_one_line_with_file_and_row_under_a_column_reader_too(tmp_path):
    rows = [{"system": "SYSTEM: s", "chat": "USER: q\nASSISTANT: a"}, {"system": "SYSTEM: s", "chat": "ASSISTANT: a"}]
    path = _parquet(tmp_path / "g.parquet", rows)
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate")
    assert str(info.value).startswith(f"{path} row 2: 'chat' has no USER: turn — format glaive: each row needs 'chat'")
    assert "\n" not in str(info.value)
    with pytest.raises(DatasetError, match="has no 'chat' column for format glaive"):
        load_dataset(
            _parquet(tmp_path / "s.parquet", [{"system": "s", "text": "q"}]),
            "generate",
            row_format=CONFIGURED["glaive"],
        )


ULTRACHAT_200K_AS_MESSAGES = [  # the rows below written as `messages`, by hand
    {
        "id": "9f2c",
        "messages": [
            {"role": "user", "content": "What is a haiku?"},
            {"role": "assistant", "content": "A three-line poem of 5, 7 and 5 syllables."},
            {"role": "user", "content": "Write one about rain."},
            {"role": "assistant", "content": "Soft rain on the roof / ..."},
        ],
    },
    {
        "id": "17ab",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Name a blue fruit."},
            {"role": "assistant", "content": "Blueberries."},
        ],
    },
]
ULTRACHAT_200K = [  # HuggingFaceH4/ultrachat_200k's shape: the prompt repeats the first user turn
    {"prompt": prompt, "prompt_id": row["id"], "messages": row["messages"]}
    for prompt, row in zip(["What is a haiku?", "Name a blue fruit."], ULTRACHAT_200K_AS_MESSAGES, strict=True)
]


@pytest.mark.parametrize("reader", ["jsonl", "parquet"])
@pytest.mark.parametrize("kind", KINDS)
def test_ultrachat_200k_reads_its_messages_when_prompt_is_the_first_user_turn(tmp_path, kind, reader):
    write = _jsonl if reader == "jsonl" else _parquet
    path = write(tmp_path / f"u.{reader}", ULTRACHAT_200K)
    expected = load_dataset(_jsonl(tmp_path / "m.jsonl", ULTRACHAT_200K_AS_MESSAGES), kind).rows
    for row_format in (RowFormat(id_field="prompt_id"), RowFormat(format="messages", id_field="prompt_id")):
        loaded = load_dataset(path, kind, row_format=row_format)
        assert [(r.id, r.messages) for r in loaded.rows] == [(r.id, r.messages) for r in expected]
        assert loaded.shape.describe().endswith("id: prompt_id)") and not loaded.rejects
    assert [r.id for r in expected] == ["9f2c", "17ab"]
    if kind == "generate":
        assert expected[0].messages[-1] == {"role": "user", "content": "Write one about rain."}


def test_a_prompt_that_is_not_the_first_user_turn_is_still_the_both_error(tmp_path):
    rows = [dict(ULTRACHAT_200K[0]), {**ULTRACHAT_200K[1], "prompt": "Name a red fruit."}]
    path = _jsonl(tmp_path / "u.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        load_dataset(path, "generate", row_format=RowFormat(id_field="prompt_id"))
    assert str(info.value).startswith(
        f"{path} line 2: has both 'messages' and 'prompt', and 'prompt' is not the first user turn's content; give one"
    )
