"""The eval's one prompt selection: held-out records first, then the prompt files, up to `prompts`."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from models.common.job_files import EvalJobFile
from models.eval.prompts import eval_prompts, read_prompt_file
from models.train.data import held_out
from settings.target import Target

REPO = Path(__file__).resolve().parents[3]
FRACTION = 0.5


def records(tmp_path: Path, n: int = 12) -> tuple[Path, list[str]]:
    rows = [{"id": f"r{i}", "input_ids": [10 + i, 11, 12, 13, 14], "loss_mask": [0, 0, 0, 1, 1]} for i in range(n)]
    out = tmp_path / "records" / "G1"
    out.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), out / "part-00000.parquet")
    return out, [r["id"] for r in rows if held_out("G1", r["id"], FRACTION)]


def job(tmp_path: Path, target: Path, prompts: int, files: list[Path]) -> EvalJobFile:
    records_dir, _ = records(tmp_path) if not (tmp_path / "records").exists() else (tmp_path / "records/G1", None)
    return EvalJobFile(
        prompts=prompts,
        prompt_files=files,
        eval_fraction=FRACTION,
        target=Target(path=str(target)),
        datasets=[{"name": "G1", "records_dir": str(records_dir)}],
        draft_dir=str(tmp_path),
        out=str(tmp_path / "e.json"),
    )


def test_held_out_records_first_then_the_prompt_set_in_file_order(tmp_path, tiny_target_dir):
    _, held = records(tmp_path)
    assert 2 <= len(held) < 12
    prompt_set = REPO / "data/eval/prompts.jsonl"
    got = eval_prompts(job(tmp_path, tiny_target_dir, len(held) + 5, [prompt_set]), vocab_size=2048)
    assert [p.source for p in got] == ["G1"] * len(held) + ["prompts"] * 5
    assert sorted(p.id for p in got[: len(held)]) == sorted(held)
    file_rows = [json.loads(line) for line in prompt_set.read_text().splitlines()]
    assert [p.id for p in got[len(held) :]] == [r["id"] for r in file_rows[:5]]
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    first = file_rows[0].get("messages") or [{"role": "user", "content": file_rows[0]["prompt"]}]
    rendered = tok.apply_chat_template(first, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert got[len(held)].input_ids == list(rendered)
    assert tok.decode(got[len(held)].input_ids).endswith("<|im_assistant|>assistant<|im_middle|>")
    # fewer wanted than held out: the files are still read (and checked) but add nothing
    assert [p.source for p in eval_prompts(job(tmp_path, tiny_target_dir, 2, [prompt_set]))] == ["G1", "G1"]


def test_the_demo_prompt_set_is_a_hundred_varied_prompts():
    rows = read_prompt_file(REPO / "data/eval/prompts.jsonl")
    assert len(rows) == 100 and len({pid for _, pid, _ in rows}) == 100
    assert {pid.split("-")[1] for _, pid, _ in rows} == {"code", "math", "chat", "long"}


@pytest.mark.parametrize(
    "line, problem",
    [
        ('{"id": "a", "prompt": "fine"}\n{"id": "b", "prompt": ', "2: not valid JSON"),
        ('{"id": "a", "text": "no prompt"}', "1: a row needs `messages`"),
        ('\n{"id": "a", "messages": [{"role": "user"}]}', "2: messages[0] must be an object"),
        (
            '{"id": "a", "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}',
            "1: the last message",
        ),
        ('{"id": "a", "prompt": "x"}\n{"id": "a", "prompt": "y"}', "2: id 'a' repeats the row at line 1"),
        ("[1, 2]", "1: a row must be a JSON object"),
    ],
)
def test_a_bad_prompt_row_names_its_file_and_line(tmp_path, line, problem):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(line)
    with pytest.raises(ValueError) as e:  # found before any tokenizer is loaded (there is none at the target path)
        eval_prompts(job(tmp_path, tmp_path / "no-target", 1, [bad]))
    assert f"{bad}:{problem}" in str(e.value)  # FILE:LINE: what is wrong


def test_ids_default_to_a_hash_of_the_content(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "a"}\n{"prompt": "b"}\n{"id": 7, "prompt": "c"}\n')
    ids = [pid for _, pid, _ in read_prompt_file(f)]
    assert len(ids[0]) == 16 and ids[0] != ids[1] and ids[2] == "7"
