"""The eval's benchmarks on the pipeline's side: Hub benchmarks read from the local cache into the job's files, the
published anchors, eval.json's benchmarks section and its table artifact (tasks/eval/benchmarks.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.common.job_files import EvalJobFile
from settings.eval import BenchmarkSpec
from settings.target import Target
from tasks.datasets import DatasetNotFoundError
from tasks.eval import tasks as eval_tasks
from tasks.eval.benchmarks import (
    benchmark_rows,
    benchmark_section,
    benchmark_table_text,
    published_anchors,
    resolve_benchmarks,
)
from tests.hub_cache import offline_hub_cache, publish

REPO = Path(__file__).resolve().parents[3]
SAMPLES = REPO / "data" / "benchmarks"
COMMIT = "3" * 40


def test_a_local_benchmark_keeps_its_file_and_gets_its_format(tmp_path):
    (got,) = resolve_benchmarks([BenchmarkSpec(name="he", path=str(SAMPLES / "humaneval.jsonl"))], tmp_path)
    assert got.path == str(SAMPLES / "humaneval.jsonl") and got.format == "humaneval" and got.limit == 80
    assert list(tmp_path.iterdir()) == []  # nothing written for a local file


def test_a_hub_benchmark_is_read_from_the_local_cache_into_the_job_s_file(tmp_path, monkeypatch):
    hub = offline_hub_cache(tmp_path, monkeypatch)
    rows = [json.loads(line) for line in (SAMPLES / "gsm8k_test.jsonl").read_text().splitlines()]
    publish(hub, COMMIT, rows, repo="openai/gsm8k", split="test")
    spec = BenchmarkSpec(name="gsm8k", path="hf:openai/gsm8k", limit=3)
    (got,) = resolve_benchmarks([spec], tmp_path / "jobs" / "benchmarks")
    written = tmp_path / "jobs" / "benchmarks" / "gsm8k.jsonl"
    assert got.path == str(written) and got.format == "gsm8k" and got.limit == 3
    assert (got.split, got.config) == (None, None)  # the job reads a local file
    assert [json.loads(line) for line in written.read_text().splitlines()] == rows
    # a row the format refuses is named by the Hub dataset and its row, before any job is written (Parquet: null)
    publish(hub, "4" * 40, [*rows[:6], {"question": "no answer"}], repo="openai/gsm8k", split="test")
    with pytest.raises(ValueError, match=r"^hf:openai/gsm8k \(test\) row 7: `answer` must be a non-empty string"):
        resolve_benchmarks([spec], tmp_path / "again")
    # not in the cache: the download command, never a download
    with pytest.raises(DatasetNotFoundError, match="hf download --repo-type dataset openai/openai_humaneval"):
        resolve_benchmarks([BenchmarkSpec(name="he", path="hf:openai/openai_humaneval")], tmp_path)


def test_the_published_anchors_are_found_by_the_target_s_name():
    kimi = published_anchors("moonshotai/Kimi-K2.5", "gsm8k")
    assert [(a["draft"], a["acceptance_length"]) for a in kimi] == [
        ("lightseekorg/kimi-k2.5-eagle3", 3.20),
        ("lightseekorg/kimi-k2.5-eagle3-mla", 3.02),
    ]
    assert "3 steps, topk 1, 4 draft tokens" in kimi[0]["settings"]
    assert published_anchors("/models/kimi-k2.5/", "mt_bench")[0]["acceptance_length"] == 2.69  # a local copy
    llama = published_anchors("meta-llama/Llama-3.1-8B-Instruct", "humaneval")
    assert [a["acceptance_length"] for a in llama] == [3.34]
    assert [a["acceptance_length"] for a in published_anchors("nvidia/Kimi-K2.6", "mt_bench")] == [2.62]
    assert published_anchors("nvidia/Kimi-K2.6", "gsm8k") == []  # only MT-bench was published
    assert published_anchors("/runs/tiny-target", "mt_bench") == []


def job(tmp_path: Path, target: str, benchmarks: list[dict]) -> EvalJobFile:
    final = tmp_path / "draft" / "final"
    final.mkdir(parents=True, exist_ok=True)
    return EvalJobFile(
        target=Target(path=target),
        draft_dir=str(final),
        out=str(tmp_path / "raw.json"),
        num_steps=3,
        max_new_tokens=64,
        benchmarks=benchmarks,
    )


HF_BENCH = {  # models/eval/job.py decode_benchmark's entry
    "acceptance_length": 2.0,
    "acceptance_length_specforge": 2.25,
    "per_position_acceptance": [0.6, 0.5, 0.4],
    "rounds": 40,
    "new_tokens": 90,
    "prompts": 10,
    "max_new_tokens": 9,
    "per_prompt": [],
}
HF = {
    "prompts": 4,
    "device": "cpu",
    "trained": {"acceptance_length": 1.5, "per_position_acceptance": [0.3, 0.2, 0.1], "rounds": 8, "new_tokens": 16},
    "benchmarks": {"gsm8k": HF_BENCH, "mine": {**HF_BENCH, "acceptance_length_specforge": 1.5, "prompts": 2}},
}


def test_the_section_and_table_set_ours_beside_the_target_s_anchor(tmp_path):
    j = job(
        tmp_path,
        "moonshotai/Kimi-K2.5",
        [
            {"name": "gsm8k", "path": "g.jsonl", "format": "gsm8k", "max_new_tokens": 9},
            {"name": "mine", "path": "m.jsonl", "format": "mt_bench", "anchor": 3.0},
        ],
    )
    engine = {"benchmarks": {"gsm8k": {"prompts": 10, "acceptance_length": 2.24, "per_round": 1.99}}}
    section = benchmark_section(j, HF, engine)
    g = section["gsm8k"]
    assert (g["format"], g["prompts"], g["max_new_tokens"], g["num_steps"]) == ("gsm8k", 10, 9, 3)
    assert (g["acceptance_length"], g["per_round"]) == (2.25, 2.0)  # SpecForge's count beside the anchor
    assert g["hf"]["per_position_acceptance"] == [0.6, 0.5, 0.4] and g["engine"]["acceptance_length"] == 2.24
    assert g["anchor"]["acceptance_length"] == 3.20 and g["anchor"]["draft"] == "lightseekorg/kimi-k2.5-eagle3"
    assert [a["acceptance_length"] for a in g["published"]] == [3.20, 3.02]
    # an anchor in the config wins over the published one, which is still listed
    mine = section["mine"]
    assert mine["anchor"] == {"acceptance_length": 3.0, "source": "eval.benchmarks (mine).anchor in the config"}
    assert [a["acceptance_length"] for a in mine["published"]] == [2.69, 2.94]
    rows = benchmark_rows(section)
    assert rows == [
        {
            "benchmark": "gsm8k",
            "format": "gsm8k",
            "questions": 10,
            "acceptance_length": 2.25,
            "per_round": 2.0,
            "engine": 2.24,
            "anchor": 3.20,
            "of_anchor": 0.703,
            "anchor_draft": "lightseekorg/kimi-k2.5-eagle3",
        },
        {
            "benchmark": "mine",
            "format": "mt_bench",
            "questions": 2,
            "acceptance_length": 1.5,
            "per_round": 2.0,
            "engine": None,
            "anchor": 3.0,
            "of_anchor": 0.5,
            "anchor_draft": "eval.benchmarks (mine).anchor in the config",
        },
    ]
    text = benchmark_table_text(rows).splitlines()
    header = "benchmark format questions acceptance length per round engine anchor of anchor anchor draft"
    assert text[0].split() == header.split()
    assert text[1].split() == "gsm8k gsm8k 10 2.250 2.000 2.240 3.200 0.703 lightseekorg/kimi-k2.5-eagle3".split()
    assert text[2].split()[5] == "-"  # no engine figure


def test_engine_only_and_no_anchor(tmp_path):
    j = job(tmp_path, "/runs/tiny-target", [{"name": "he", "path": "h.jsonl", "format": "humaneval"}])
    engine = {"benchmarks": {"he": {"prompts": 8, "acceptance_length": 1.4, "per_round": 1.3}}}
    (row,) = benchmark_rows(benchmark_section(j, None, engine))
    assert (row["acceptance_length"], row["per_round"], row["engine"]) == (1.4, 1.3, None)
    assert (row["anchor"], row["of_anchor"], row["anchor_draft"]) == (None, None, "none published for this target")


def test_publish_eval_writes_the_section_and_the_benchmark_table(tmp_path, monkeypatch):
    tables = {}

    def create_table_artifact(table, key, description):
        tables[key] = (table, description)

    monkeypatch.setattr(eval_tasks, "create_table_artifact", create_table_artifact)
    j = job(tmp_path, "moonshotai/Kimi-K2.5", [{"name": "gsm8k", "path": "g.jsonl", "format": "gsm8k"}])
    report = eval_tasks.publish_eval.fn(j, HF, None, "cfg", tmp_path / "draft" / "eval.json", None)
    saved = json.loads((tmp_path / "draft" / "eval.json").read_text())
    assert saved["benchmarks"] == report["benchmarks"] and saved["benchmarks"]["gsm8k"]["acceptance_length"] == 2.25
    assert saved["trained"] == HF["trained"] and saved["prompts"] == 4  # the overall figures as before
    table, description = tables["eval-benchmarks-cfg"]
    assert [(r["benchmark"], r["acceptance_length"], r["anchor"]) for r in table] == [("gsm8k", 2.25, 3.20)]
    assert "3 steps, top-k 1, 4 draft tokens" in description
    assert set(tables) == {"eval-summary-cfg", "eval-benchmarks-cfg"}
    # without benchmarks: no section, no table
    tables.clear()
    without = {k: v for k, v in HF.items() if k != "benchmarks"}
    plain = eval_tasks.publish_eval.fn(job(tmp_path / "p", "t", []), without, None, "cfg", tmp_path / "p.json", None)
    assert "benchmarks" not in plain
    assert set(tables) == {"eval-summary-cfg"}
