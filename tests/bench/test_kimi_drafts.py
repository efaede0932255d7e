"""bench/kimi_drafts.py's choices before its hour of work: which demo a flag accepts, which benchmark the second table
reads, and how a row's eval config is written; on hand-written demo configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from bench.kimi_drafts import LONG_CONTEXT, Params, benchmark_name, vllm_buckets
from settings.layout import RunLayout


def demo_run(tmp_path: Path, shape: str, benchmarks: list[str]) -> Path:
    """A run directory holding only a demo config, as `eagle3 demo --target SHAPE` writes it (the keys read here)."""
    run = tmp_path / shape
    run.mkdir()
    config = {
        "target": {"path": "/targets/x", "tiny_shape": shape},
        "eval": {"benchmarks": [{"name": n, "path": f"/sets/{n}.jsonl"} for n in benchmarks]},
    }
    RunLayout(run).demo_config.write_text(yaml.safe_dump(config))
    return run


def test_a_demo_of_another_target_is_refused_naming_the_target_to_give(tmp_path: Path) -> None:
    long_run = demo_run(tmp_path, "kimi-long", ["long_answers"])
    with pytest.raises(SystemExit, match="a demo of the kimi-long target, not kimi; give --target kimi-long"):
        Params(demo=str(long_run)).validate()
    with pytest.raises(SystemExit, match="--reuse .*a demo of the kimi-long target"):
        Params(reuse=str(long_run)).validate()
    Params(target="kimi-long", demo=str(long_run)).validate()  # the matching target: accepted


def test_a_demo_holding_a_rows_draft_is_refused_for_training_and_taken_for_reuse(tmp_path: Path) -> None:
    run = demo_run(tmp_path, "kimi-long", ["long_answers"])
    (run / "draft-mla-eagle31-yarn").mkdir()  # the row "mla, eagle3.1, YaRN", trained before
    with pytest.raises(SystemExit, match="draft-mla-eagle31-yarn is there from an earlier run.*--reuse"):
        Params(target="kimi-long", demo=str(run)).validate()
    Params(target="kimi-long", reuse=str(run)).validate()


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (Params(target="llama"), "--target llama: must be one of kimi, kimi-long"),
        (Params(epochs=-1), "--epochs -1: must be 0 \\(the demo's\\) or more"),
        (Params(reuse="/a", demo="/b"), "--reuse and --demo: give one"),
        (Params(target="kimi-long", demo="/nowhere"), "--demo /nowhere: no demo config there"),
    ],
)
def test_bad_flags_are_refused_before_any_work(params: Params, message: str) -> None:
    with pytest.raises(SystemExit, match=message):
        params.validate()


def test_the_second_table_reads_the_long_context_set_for_kimi_and_the_demos_own_set_for_kimi_long(
    tmp_path: Path,
) -> None:
    assert benchmark_name("kimi", demo_run(tmp_path, "kimi", [])) == "long_context" == LONG_CONTEXT["name"]
    assert benchmark_name("kimi-long", demo_run(tmp_path, "kimi-long", ["long_answers", "other"])) == "long_answers"


def test_vllm_buckets_says_same_only_when_every_bucket_is_equal() -> None:
    ours = [{"from": 0, "acceptance_length": 1.5, "rounds": 4}, {"from": 512, "acceptance_length": 1.25, "rounds": 8}]
    assert vllm_buckets({"by_context": ours, "vllm_by_context": list(ours)}) == "same in all 2"
    theirs = [ours[0], {"from": 512, "acceptance_length": 1.125, "rounds": 8}]
    assert vllm_buckets({"by_context": ours, "vllm_by_context": theirs}) == "1.500 (4) / 1.125 (8)"
    assert vllm_buckets({"by_context": ours, "vllm_by_context": None}) == "-"
    assert vllm_buckets({"by_context": ours, "vllm_by_context": ours, "vllm_unplaced": 2}) == (
        "same in all 2, 2 prompts unplaced"
    )
