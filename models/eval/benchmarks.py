"""Published benchmarks in their published formats, read into the eval's chat prompts (`eval.benchmarks`).

    mt_bench   FastChat's llm_judge/data/mt_bench/question.jsonl: {"question_id", "category", "turns": [..]}
    gsm8k      openai/gsm8k (main, test split; grade-school-math's test.jsonl): {"question", "answer"}
    humaneval  openai/openai_humaneval (test split; HumanEval.jsonl.gz): {"task_id", "prompt", "canonical_solution",
               "test", "entry_point"}
    chat       a conversation a row, {"id", "messages": [{role, content}, ...]} ending with a user turn, asked as it is:
               a set of one's own, e.g. data/eval/long_context.jsonl (long conversations, for acceptance by context
               position)
    ids        token ids a row, {"id", "input_ids": [..]}, sent as they are (no chat template): e.g. the context
               probes the eval cuts from held-out records (models/eval/probes.py, `eval.context_probes`)

Each row becomes the messages SpecForge's benchmark scripts send for it (sgl-project/SpecForge
benchmarks/benchmarker/{mtbench,gsm8k,humaneval}.py and utils.py, main at a6b6b0230009, unchanged there since
04a6bcfb, 2025-11-25), which the eval renders with the target's chat template and the generation prompt:

- mt_bench: SpecForge's system prompt (the Llama-2 default one, `MT_BENCH_SYSTEM`) and the question's FIRST turn.
  SpecForge asks both turns in one conversation, the second after the target's own answer to the first; the eval
  decodes each prompt once, from fixed token ids, so the second turn (whose prompt holds that answer) is not asked.
- gsm8k: SpecForge's 5-shot text, "Question: {question}\\nAnswer: {answer}\\n\\n" for each of the file's first 5
  rows, then "Question: {question}\\nAnswer:", as the user turn. SpecForge asks every row, the first 5 too (with
  their own answers among the shots), and sends the text raw, without a chat template; ours wraps it as the one
  user turn, as the eval renders every prompt (the draft learned text in the target's chat template).
- humaneval: the row's `prompt` (a signature and docstring) as the user turn, no system prompt.

`read_benchmark` reads a local JSONL file (a `.jsonl.gz` too) or Parquet file; a Hub dataset (`hf:ORG/NAME`) is
written to a local JSONL file by the pipeline before the eval job starts (tasks/eval/benchmarks.py). A bad row is a
ValueError naming the file and line (or row) and what is wrong. Plain Python and pyarrow: no torch, no tokenizer.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from settings.eval import BENCHMARK_FORMATS, BenchmarkSpec

# SpecForge benchmarks/benchmarker/mtbench.py SYSTEM_PROMPT (main at a6b6b0230009), two spaces after "safe." included.
MT_BENCH_SYSTEM = (
    "You are a helpful, respectful and honest assistant. Always answer as helpfully as possible, while being safe.  "
    "Your answers should not include any harmful, unethical, racist, sexist, toxic, dangerous, or illegal content. "
    "Please ensure that your responses are socially unbiased and positive in nature.\n\nIf a question does not make "
    "any sense, or is not factually coherent, explain why instead of answering something not correct. If you don't "
    "know the answer to a question, please don't share false information."
)
GSM8K_SHOTS = 5  # SpecForge benchmarks/benchmarker/gsm8k.py: get_few_shot_examples(lines, 5)

# The keys that tell a format from the others (format: auto), and what each format's rows must hold.
SIGNATURES: dict[str, tuple[str, ...]] = {
    "mt_bench": ("question_id", "turns"),
    "gsm8k": ("question", "answer"),
    "humaneval": ("task_id", "prompt"),
    "chat": ("id", "messages"),
    "ids": ("id", "input_ids"),
}
PUBLISHED = {
    "mt_bench": '{"question_id", "category", "turns": [..]} (FastChat mt_bench question.jsonl)',
    "gsm8k": '{"question", "answer"} (openai/gsm8k, main)',
    "humaneval": '{"task_id", "prompt", "canonical_solution", "test", "entry_point"} (openai/openai_humaneval)',
    "chat": '{"id", "messages": [{"role", "content"}, ...]} (a conversation ending with the user\'s turn)',
    "ids": '{"id", "input_ids": [token ids]} (a prompt already tokenized for the target, sent as it is)',
}


class BenchmarkPrompt(NamedTuple):
    """One benchmark question as the eval asks it."""

    where: str  # FILE:LINE (or FILE row N) of its row
    id: str  # the row's id (question_id, task_id; gsm8k: the 0-based row number)
    messages: list[dict[str, str]]  # [] for an ids row
    input_ids: list[int] | None = None  # an ids row's tokens, sent as they are; None: render `messages`


class Benchmark(NamedTuple):
    """A benchmark file read: its format (given or detected) and its first `limit` prompts."""

    format: str
    prompts: list[BenchmarkPrompt]


def read_benchmark(spec: BenchmarkSpec, source: str | None = None) -> Benchmark:
    """The benchmark's format and prompts (its first `spec.limit` questions, in file order); ValueError naming the
    file and line of a bad row. `source` names the rows in errors instead of the file (a Hub dataset written to one)."""
    path = Path(spec.path)
    rows = read_rows(path, source)
    label = source or str(path)
    if not rows:
        raise ValueError(f"{label}: no rows (a {spec.format or 'benchmark'} file holds one JSON object a line)")
    fmt = spec.format or detect_format(*rows[0])
    for where, row in rows:
        check_row(fmt, where, row)
    prompts = BUILDERS[fmt](rows, label)
    ids: dict[str, str] = {}
    for p in prompts:
        if p.id in ids:
            raise ValueError(f"{p.where}: id {p.id!r} repeats the row at {ids[p.id]}")
        ids[p.id] = p.where
    return Benchmark(fmt, prompts[: spec.limit] if spec.limit is not None else prompts)


def read_rows(path: Path, source: str | None = None) -> list[tuple[str, Any]]:
    """(where, parsed row) of each row of a JSONL (.jsonl, .jsonl.gz, .json) or Parquet file: where is FILE:LINE (FILE
    row N for Parquet), or `source` row N when the file holds the rows of `source` one a line."""
    label = source or str(path)
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except (OSError, ValueError) as e:
            raise ValueError(f"{label}: cannot read the benchmark file: {e}") from e
        return [(f"{label} row {i}", row) for i, row in enumerate(table.to_pylist(), 1)]
    try:
        raw = gzip.decompress(path.read_bytes()) if path.suffix == ".gz" else path.read_bytes()
        lines = raw.decode("utf-8").splitlines()
    except (OSError, UnicodeDecodeError, gzip.BadGzipFile) as e:
        raise ValueError(f"{label}: cannot read the benchmark file: {e}") from e
    rows = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source} row {lineno}" if source else f"{path}:{lineno}"
        try:
            rows.append((where, json.loads(line)))
        except json.JSONDecodeError as e:
            raise ValueError(f"{where}: not valid JSON: {e.msg}") from None
    return rows


def detect_format(where: str, row: Any) -> str:
    """The format whose keys the (first) row has; ValueError naming the row, its keys and the formats' keys."""
    if isinstance(row, dict):
        for fmt, keys in SIGNATURES.items():
            if all(k in row for k in keys):
                return fmt
    found = sorted(row) if isinstance(row, dict) else type(row).__name__
    raise ValueError(
        f"{where}: cannot tell the benchmark format from this row ({found}): expected one of "
        + "; ".join(f"{fmt}: {PUBLISHED[fmt]}" for fmt in BENCHMARK_FORMATS)
        + " (or set the benchmark's format)"
    )


def check_row(fmt: str, where: str, row: Any) -> None:
    """ValueError naming the row when it is not a row of `fmt` (the fields the prompt is built from)."""
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a {fmt} row must be a JSON object: {PUBLISHED[fmt]}")
    missing = [k for k in SIGNATURES[fmt] if k not in row]
    if missing:
        raise ValueError(f"{where}: a {fmt} row needs {', '.join(missing)}; this one has {sorted(row)}")
    if fmt == "mt_bench":
        _id(row["question_id"], "question_id", where)
        turns = row["turns"]
        if not (isinstance(turns, list) and turns and all(isinstance(t, str) and t.strip() for t in turns)):
            raise ValueError(f"{where}: `turns` must be a non-empty list of non-empty strings (the user turns)")
        if "category" in row and not isinstance(row["category"], str):
            raise ValueError(f"{where}: `category` must be a string")
    elif fmt == "gsm8k":
        for key in ("question", "answer"):
            if not isinstance(row[key], str) or not row[key].strip():
                raise ValueError(f"{where}: `{key}` must be a non-empty string")
    elif fmt == "chat":
        _id(row["id"], "id", where)
        check_messages(row["messages"], where)
    elif fmt == "ids":
        _id(row["id"], "id", where)
        ids = row["input_ids"]
        if not (isinstance(ids, list) and ids and all(type(i) is int and i >= 0 for i in ids)):
            raise ValueError(f"{where}: `input_ids` must be a non-empty list of non-negative integers (token ids)")
    else:
        _id(row["task_id"], "task_id", where)
        if not isinstance(row["prompt"], str) or not row["prompt"].strip():
            raise ValueError(f"{where}: `prompt` must be a non-empty string (the signature and docstring)")


def check_messages(messages: Any, where: str) -> None:
    """ValueError naming `where` unless `messages` is a non-empty list of {role, content} strings ending with a turn
    that is not the assistant's (a prompt: the chat benchmark's rows, the eval prompt files' rows)."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: `messages` must be a non-empty list of {{role, content}}")
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: messages[{i}] must be an object with string `role` and `content`")
    if messages[-1]["role"] == "assistant":
        raise ValueError(f"{where}: the last message is the assistant's: a prompt ends with the user's turn")


def _id(value: Any, key: str, where: str) -> None:
    if not isinstance(value, (str, int)) or isinstance(value, bool):
        raise ValueError(f"{where}: `{key}` must be a string or an integer, got {type(value).__name__}")


def mt_bench_prompts(rows: list[tuple[str, Any]], label: str) -> list[BenchmarkPrompt]:
    """SpecForge's system prompt and each question's first turn."""
    return [
        BenchmarkPrompt(
            where,
            str(row["question_id"]),
            [{"role": "system", "content": MT_BENCH_SYSTEM}, {"role": "user", "content": row["turns"][0]}],
        )
        for where, row in rows
    ]


def gsm8k_question(row: dict[str, str], answer: bool) -> str:
    """SpecForge's get_one_example: "Question: ...\\nAnswer:" and, for a shot, " " + the answer."""
    return "Question: " + row["question"] + "\nAnswer:" + (" " + row["answer"] if answer else "")


def gsm8k_prompts(rows: list[tuple[str, Any]], label: str) -> list[BenchmarkPrompt]:
    """SpecForge's 5-shot text over the first 5 rows, then each row's question (the first 5 too, as SpecForge)."""
    if len(rows) < GSM8K_SHOTS:
        raise ValueError(
            f"{label}: {len(rows)} rows; gsm8k needs at least {GSM8K_SHOTS}: its first {GSM8K_SHOTS} are the "
            "few-shot examples of every question (as SpecForge's benchmark builds them)"
        )
    shots = "".join(gsm8k_question(row, answer=True) + "\n\n" for _, row in rows[:GSM8K_SHOTS])
    return [
        BenchmarkPrompt(where, str(i), [{"role": "user", "content": shots + gsm8k_question(row, answer=False)}])
        for i, (where, row) in enumerate(rows)
    ]


def humaneval_prompts(rows: list[tuple[str, Any]], label: str) -> list[BenchmarkPrompt]:
    """Each task's prompt as the user turn."""
    return [
        BenchmarkPrompt(where, str(row["task_id"]), [{"role": "user", "content": row["prompt"]}]) for where, row in rows
    ]


def chat_prompts(rows: list[tuple[str, Any]], label: str) -> list[BenchmarkPrompt]:
    """Each conversation as it is (role and content of each message)."""
    return [
        BenchmarkPrompt(where, str(row["id"]), [{"role": m["role"], "content": m["content"]} for m in row["messages"]])
        for where, row in rows
    ]


def ids_prompts(rows: list[tuple[str, Any]], label: str) -> list[BenchmarkPrompt]:
    """Each row's token ids as they are."""
    return [BenchmarkPrompt(where, str(row["id"]), [], list(row["input_ids"])) for where, row in rows]


BUILDERS: dict[str, Callable[[list[tuple[str, Any]], str], list[BenchmarkPrompt]]] = {
    "mt_bench": mt_bench_prompts,
    "gsm8k": gsm8k_prompts,
    "humaneval": humaneval_prompts,
    "chat": chat_prompts,
    "ids": ids_prompts,
}
