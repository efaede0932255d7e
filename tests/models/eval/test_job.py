"""The eval job on the tiny target: the benchmarks decoded apart from the eval prompts, each with its own figures
(models/eval/job.py), equal to decoding their questions, rendered here from the published rows, one by one."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch
from transformers import AutoTokenizer

from models.common.job_files import EvalJobFile
from models.eval.job import draft_for_target, run
from models.eval.speculative_decoding import evaluate_acceptance
from settings.target import Target
from tests.drafts import export_random_draft, load_target
from tests.models.eval.test_benchmarks import LLAMA2_SYSTEM

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "data" / "benchmarks"


def test_benchmarks_are_measured_apart_with_the_trained_draft(tmp_path, tiny_target_dir, one_torch_thread_in_module):
    model = load_target(tiny_target_dir)
    final = export_random_draft(model, tmp_path / "draft" / "final", draft_vocab_size=1024)
    records = tmp_path / "records" / "G1"
    records.mkdir(parents=True)
    rows = [{"id": f"r{i}", "input_ids": [10 + i, 11, 12, 13, 14], "loss_mask": [0, 0, 0, 1, 1]} for i in range(12)]
    pq.write_table(pa.Table.from_pylist(rows), records / "part-00000.parquet")
    job = EvalJobFile(
        prompts=2,
        max_new_tokens=6,
        compare_untrained=False,
        eval_fraction=0.5,
        target=Target(path=str(tiny_target_dir)),
        datasets=[{"name": "G1", "records_dir": str(records)}],
        draft_dir=str(final),
        out=str(tmp_path / "raw.json"),
        benchmarks=[
            {"name": "mt", "path": str(SAMPLES / "mt_bench_question.jsonl"), "limit": 2},
            {"name": "he", "path": str(SAMPLES / "humaneval.jsonl"), "limit": 2, "max_new_tokens": 9},
        ],
    )
    result = run(job)
    assert json.loads(Path(job.out).read_text()) == result
    assert result["prompts"] == result["trained"]["prompts"] == 2  # the eval prompts alone, as without benchmarks
    assert list(result["benchmarks"]) == ["mt", "he"]

    # the questions as SpecForge asks them, rendered here with the chat template, decoded one by one
    he_rows = [json.loads(line) for line in (SAMPLES / "humaneval.jsonl").read_text().splitlines()[:2]]
    mt_rows = [json.loads(line) for line in (SAMPLES / "mt_bench_question.jsonl").read_text().splitlines()[:2]]
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    draft = draft_for_target(final, model, torch.float32)
    eos = {tokenizer.eos_token_id}
    mt_questions = [
        [{"role": "system", "content": LLAMA2_SYSTEM}, {"role": "user", "content": r["turns"][0]}] for r in mt_rows
    ]
    for name, questions, ids, max_new in (
        ("he", [[{"role": "user", "content": r["prompt"]}] for r in he_rows], ["Sample/0", "Sample/1"], 9),
        ("mt", mt_questions, ["901", "902"], 6),
    ):
        got = result["benchmarks"][name]
        parts = []
        for messages in questions:
            prompt = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
            parts.append(
                evaluate_acceptance(
                    model, draft, [list(prompt["input_ids"])], num_steps=3, max_new_tokens=max_new, eos_token_ids=eos
                )
            )
        rounds, tokens = sum(p.rounds for p in parts), sum(p.new_tokens for p in parts)
        assert (got["prompts"], got["max_new_tokens"], got["rounds"], got["new_tokens"]) == (2, max_new, rounds, tokens)
        assert [p["id"] for p in got["per_prompt"]] == ids
        assert [(p["new_tokens"], p["rounds"]) for p in got["per_prompt"]] == [(p.new_tokens, p.rounds) for p in parts]
        assert got["acceptance_length_specforge"] == round(tokens / rounds, 4)
        assert got["acceptance_length"] == round(sum(p.acceptance_length * p.rounds for p in parts) / rounds, 4)
        assert len(got["per_position_acceptance"]) == 3
