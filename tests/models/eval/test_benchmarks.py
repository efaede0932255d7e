"""The published benchmark formats read into chat prompts as SpecForge's benchmark scripts build them, and bad rows
named by file and line (models/eval/benchmarks.py)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from models.eval.benchmarks import read_benchmark
from settings.eval import BenchmarkSpec, EvalSettings

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "data" / "benchmarks"
# SpecForge benchmarks/benchmarker/mtbench.py SYSTEM_PROMPT, written out again here (two spaces after "safe.")
LLAMA2_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being safe.  "
    "Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content. "
    "Please ensure that your responses are socially unbiased and positive in nature.\n\n"
    "If a question does not make any sense, or is not factually coherent, explain why instead of answering "
    "something not correct. If you don't know the answer to a question, please don't share false information."
)


def spec(path: Path | str, **kw) -> BenchmarkSpec:
    return BenchmarkSpec(name=kw.pop("name", "b"), path=str(path), **kw)


def test_mt_bench_asks_the_first_turn_after_specforge_s_system_prompt():
    got = read_benchmark(spec(SAMPLES / "mt_bench_question.jsonl"))
    assert got.format == "mt_bench"  # told from the keys
    assert [p.id for p in got.prompts] == [str(i) for i in range(901, 913)]
    assert got.prompts[0].messages == [
        {"role": "system", "content": LLAMA2_SYSTEM},
        {
            "role": "user",
            "content": "Write a short note to a neighbour asking them to water your plants while you are away for a "
            "week.",
        },
    ]
    assert got.prompts[3].messages[1]["content"] == "What is the sum of the first ten odd numbers?"
    assert got.prompts[0].where == f"{SAMPLES / 'mt_bench_question.jsonl'}:1"


def test_gsm8k_puts_specforge_s_five_shots_before_each_question():
    got = read_benchmark(spec(SAMPLES / "gsm8k_test.jsonl", format="gsm8k", limit=7))
    assert [p.id for p in got.prompts] == ["0", "1", "2", "3", "4", "5", "6"]  # the shot rows are asked too
    (message,) = got.prompts[5].messages
    assert message["role"] == "user"
    content = message["content"]
    assert len(content.split("\n\n")) == 5 + 1  # five shots, then the question
    assert content.startswith(
        "Question: Lena has 4 boxes with 6 pencils in each box. She gives away 5 pencils. How many pencils does she "
        "have left?\nAnswer: Lena has 4 * 6 = <<4*6=24>>24 pencils.\nAfter giving away 5 she has 24 - 5 = "
        "<<24-5=19>>19 pencils.\n#### 19\n\nQuestion: A bakery sells muffins"
    )
    assert content.endswith(
        "#### 9\n\nQuestion: A class of 28 students splits into teams of 4. Each team needs 2 balls. How many balls "
        "are needed?\nAnswer:"
    )
    assert content.count("Question: ") == 6 and content.count("\nAnswer: ") == 5 and content.count("####") == 5
    # every question has the same five shots; only the last question differs
    first = got.prompts[0].messages[0]["content"]
    assert first.rsplit("Question: ", 1)[0] == content.rsplit("Question: ", 1)[0]
    assert first.endswith(
        "Question: " + "Lena has 4 boxes with 6 pencils in each box. She gives away 5 pencils. "
        "How many pencils does she have left?\nAnswer:"
    )


def test_humaneval_asks_the_prompt_as_the_user_turn():
    got = read_benchmark(spec(SAMPLES / "humaneval.jsonl", limit=None))
    assert got.format == "humaneval" and len(got.prompts) == 12
    assert got.prompts[0].id == "Sample/0"
    assert got.prompts[0].messages == [
        {
            "role": "user",
            "content": 'def add_pair(a: int, b: int) -> int:\n    """Return the sum of a and b.\n'
            '    >>> add_pair(2, 3)\n    5\n    """\n',
        }
    ]


def test_the_limit_takes_the_first_questions_and_every_row_is_still_checked(tmp_path):
    rows = [json.loads(line) for line in (SAMPLES / "humaneval.jsonl").read_text().splitlines()]
    assert [p.id for p in read_benchmark(spec(SAMPLES / "humaneval.jsonl", limit=2)).prompts] == [
        "Sample/0",
        "Sample/1",
    ]
    bad = tmp_path / "he.jsonl"
    bad.write_text("".join(json.dumps(r) + "\n" for r in rows[:3]) + json.dumps({**rows[3], "prompt": 7}) + "\n")
    with pytest.raises(ValueError, match=rf"{bad}:4: `prompt` must be a non-empty string"):
        read_benchmark(spec(bad, limit=1))


def test_gzip_and_parquet_files_read_as_the_jsonl(tmp_path):
    text = (SAMPLES / "humaneval.jsonl").read_bytes()
    (tmp_path / "HumanEval.jsonl.gz").write_bytes(gzip.compress(text))
    rows = [json.loads(line) for line in text.decode().splitlines()]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "test.parquet")
    want = read_benchmark(spec(SAMPLES / "humaneval.jsonl"))
    for name in ("HumanEval.jsonl.gz", "test.parquet"):
        got = read_benchmark(spec(tmp_path / name))
        assert [(p.id, p.messages) for p in got.prompts] == [(p.id, p.messages) for p in want.prompts]
    assert read_benchmark(spec(tmp_path / "test.parquet")).prompts[2].where == f"{tmp_path / 'test.parquet'} row 3"


@pytest.mark.parametrize(
    "lines, fmt, problem",
    [
        (['{"question_id": 1, "turns": ["a"]}', '{"question_id": 2, "turns": "b"}'], None, "2: `turns` must be"),
        (['{"question_id": 1, "turns": ["a"]}', '{"question_id": 1, "turns": ["b"]}'], None, "2: id '1' repeats"),
        (['{"question_id": true, "turns": ["a"]}'], "mt_bench", "1: `question_id` must be a string or an integer"),
        (['{"question_id": 1, "turns": ["a"]}', "", '{"question_id": 2, "turns": ['], None, "3: not valid JSON"),
        (['{"text": "hello"}'], None, "1: cannot tell the benchmark format from this row (['text'])"),
        (['{"question": "q?", "answer": "a"}'] * 6, "humaneval", "1: a humaneval row needs task_id, prompt"),
        (['{"question": "q?", "answer": "a"}'] * 4, "gsm8k", "4 rows; gsm8k needs at least 5"),
        (['{"question": "q?", "answer": "a"}'] * 5 + ['{"question": "", "answer": "a"}'], None, "6: `question` must"),
        (['{"task_id": "t", "prompt": "p"}', "[1]"], None, "2: a humaneval row must be a JSON object"),
        (['{"id": "a", "messages": []}'], None, "1: `messages` must be a non-empty list"),
        (['{"id": "a", "messages": [{"role": "user"}]}'], "chat", "1: messages[0] must be an object with string"),
        (
            ['{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}'],
            None,
            "1: the last message is the assistant's",
        ),
        (['{"messages": [{"role": "user", "content": "q"}]}'], "chat", "1: a chat row needs id"),
        (['{"id": "a", "input_ids": [1, 2]}', '{"id": "b", "input_ids": []}'], None, "2: `input_ids` must be a non"),
        (['{"id": "a", "input_ids": [1, -2]}'], "ids", "1: `input_ids` must be a non-empty list of non-negative"),
        (['{"id": "a", "input_ids": "1 2"}'], "ids", "1: `input_ids` must be"),
        (['{"id": "a", "messages": [{"role": "user", "content": "q"}]}'], "ids", "1: a ids row needs input_ids"),
    ],
)
def test_a_bad_row_names_its_file_and_line(tmp_path, lines, fmt, problem):
    bad = tmp_path / "bench.jsonl"
    bad.write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError) as e:
        read_benchmark(spec(bad, format=fmt))
    assert f"{bad}" in str(e.value) and problem in str(e.value)


def test_rows_of_a_hub_dataset_are_named_by_the_dataset_and_row(tmp_path):
    f = tmp_path / "rows.jsonl"
    f.write_text('{"task_id": "a", "prompt": "p"}\n{"task_id": "b"}\n')
    with pytest.raises(ValueError, match=r"^hf:openai/openai_humaneval \(test\) row 2: a humaneval row needs prompt"):
        read_benchmark(spec(f), source="hf:openai/openai_humaneval (test)")


def test_benchmark_settings_are_checked():
    assert EvalSettings().benchmarks == []  # configs without benchmarks are unchanged
    b = BenchmarkSpec(name="gsm8k", path="hf:openai/gsm8k", config="main")
    assert (b.limit, b.format, b.split, b.anchor, b.max_new_tokens) == (80, None, None, None, None)
    for bad, said in [
        ({"name": "mt bench", "path": "q.jsonl"}, "a benchmark name is letters"),
        ({"name": "m", "path": "q.jsonl", "format": "mmlu"}, "mt_bench"),
        ({"name": "m", "path": "q.jsonl", "split": "test"}, "split: for hf: benchmarks only"),
        ({"name": "m", "path": "q.jsonl", "limit": 0}, "greater than or equal to 1"),
        ({"name": "m", "path": "q.jsonl", "limit": True}, "not true/false"),
        ({"name": "m", "path": "q.jsonl", "anchor": 0.5}, "greater than or equal to 1"),
        ({"name": "m", "path": "q.jsonl", "turns": 2}, "Extra inputs are not permitted"),
    ]:
        with pytest.raises(ValidationError, match=said):
            BenchmarkSpec(**bad)
    with pytest.raises(ValidationError, match=r"benchmark name\(s\) \['a'\] given more than once"):
        EvalSettings(benchmarks=[{"name": "a", "path": "x.jsonl"}, {"name": "a", "path": "y.jsonl"}])


def test_a_chat_set_asks_each_conversation_as_it_is():
    """data/eval/long_context.jsonl, the long-context set (tools/long_context_set.py): told from its keys, every turn
    kept in order, the last one the user's."""
    path = REPO / "data" / "eval" / "long_context.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    got = read_benchmark(spec(path, limit=None))
    assert got.format == "chat" and len(got.prompts) == len(rows) == 24
    assert [p.id for p in got.prompts] == [r["id"] for r in rows]
    assert got.prompts[-1].messages == rows[-1]["messages"] and got.prompts[-1].messages[-1]["role"] == "user"
    assert got.prompts[0].where == f"{path}:1"


def test_an_ids_set_is_sent_as_its_token_ids(tmp_path):
    path = tmp_path / "probes.jsonl"
    path.write_text('{"id": "r@8", "input_ids": [5, 6, 7, 8, 9, 10, 11, 12]}\n{"id": 3, "input_ids": [4]}\n')
    got = read_benchmark(spec(path, limit=None))
    assert got.format == "ids"  # told from its keys
    assert [(p.id, p.input_ids, p.messages) for p in got.prompts] == [
        ("r@8", [5, 6, 7, 8, 9, 10, 11, 12], []),
        ("3", [4], []),
    ]


def test_context_buckets_are_ascending_positive_edges():
    assert EvalSettings().context_buckets == [512, 1024, 2048, 4096, 8192, 16384, 32768]
    assert EvalSettings(context_buckets=[]).context_buckets == []  # one bucket
    for bad in ([1024, 512], [512, 512], [0, 512]):
        with pytest.raises(ValidationError, match="ascending and positive"):
            EvalSettings(context_buckets=bad)
