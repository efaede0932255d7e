"""The eval stage's plain helpers: merging chunked results, the TTT estimate, the SGLang command."""

from __future__ import annotations

import json
import shlex

import pytest

from models.eval.job import merge_results
from models.eval.speculative_decoding import SpecEvalResult
from tasks.eval.tasks import context_rows, estimates, eval_rows, sglang_command, ttt_estimate


def _result(rounds: int, accepted_total: int, reached: list[int], accepted: list[int], prompts: int) -> SpecEvalResult:
    return SpecEvalResult(
        acceptance_length=(accepted_total + rounds) / rounds,
        per_position_acceptance=[],
        per_position_reached=reached,
        per_position_accepted=accepted,
        rounds=rounds,
        new_tokens=accepted_total + rounds,
        prompts=prompts,
        num_steps=len(reached),
        outputs=[],
        context_edges=[512],
        context_rounds=[rounds, 0],
        context_tokens=[accepted_total + rounds, 0],
    )


def test_merged_chunks_equal_one_pass_over_all_rounds():
    a = _result(10, 12, [10, 6, 4], [6, 4, 2], 2)
    b = _result(30, 6, [30, 5, 1], [5, 1, 0], 3)
    merged = merge_results([a, b])
    assert merged["rounds"] == 40 and merged["prompts"] == 5
    assert merged["acceptance_length"] == pytest.approx((12 + 6 + 40) / 40, abs=1e-4)
    assert merged["per_position_acceptance"] == [round(11 / 40, 4), round(5 / 11, 4), round(2 / 5, 4)]
    assert merged["by_context"] == [
        {"from": 0, "to": 512, "label": "0-512", "rounds": 40, "tokens": 58, "acceptance_length": 1.45}
    ]


def test_ttt_estimate_uses_the_first_num_steps_conditional_rates(tmp_path):
    assert ttt_estimate(tmp_path, 3) is None
    (tmp_path / "train_summary.json").write_text(json.dumps({"eval": {"per_step_cond_acc": [0.5, 0.5, 1.0, 0.9, 0.9]}}))
    est = ttt_estimate(tmp_path, 3)
    assert est["acceptance_length"] == pytest.approx(1 + 0.5 + 0.25 + 0.25)
    assert est["per_position_acceptance"] == [0.5, 0.5, 1.0]
    rows = eval_rows(
        {
            "trained": {
                "acceptance_length": 2.0,
                "per_position_acceptance": [0.5, 0.5, 1.0],
                "rounds": 4,
                "new_tokens": 8,
            },
            "ttt_estimate": est,
        }
    )
    assert [r["draft"] for r in rows] == [
        "trained: measured (speculative decoding)",
        "trained: training-time estimate (teacher-forced, held-out records)",
    ]
    assert rows[0]["pos_3"] == 1.0 and rows[1]["acceptance_length"] == est["acceptance_length"]
    assert "not a measurement" in est["note"] and "at 3 steps" in est["note"]
    # Training unrolled fewer steps than the eval drafts: no estimate rather than a shorter chain's.
    assert ttt_estimate(tmp_path, 6) is None


def test_eval_json_estimates_label_the_training_estimate_and_the_measurement(tmp_path):
    (tmp_path / "train_summary.json").write_text(
        json.dumps({"eval": {"per_step_cond_acc": [0.8, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9]}})
    )
    trained = {
        "acceptance_length": 1.8,
        "replay": {
            "acceptance_length": 1.8,
            "rounds": 40,
            "all_roots": {"acceptance_length": 2.3, "per_step_cond_acc": [0.7, 0.6, 0.5], "roots": 90},
        },
    }
    est = estimates(tmp_path, 3, trained["acceptance_length"], trained["replay"])
    assert est["num_steps"] == 3
    assert est["training_estimate"]["value"] == pytest.approx(2.4)  # 1 + .8 + .4 + .2: at 3 steps, not the 7 trained
    assert est["training_estimate"]["label"].startswith("training-time estimate at 3 steps (teacher-forced")
    assert est["measured"] == {"label": "measured (speculative decoding, 3 steps, on the eval prompts)", "value": 1.8}
    assert (
        est["replay"]["value"] == 1.8
        and est["replay"]["rounds"] == 40
        and "equals the measured" in est["replay"]["label"]
    )
    assert est["all_roots"]["value"] == 2.3 and "every position a root" in est["all_roots"]["label"]
    assert estimates(tmp_path / "none", 3, 1.2)["training_estimate"]["value"] is None


def test_sglang_command_serves_the_draft_with_chain_settings():
    cmd = shlex.split(sglang_command("moonshotai/Kimi-K2.5", "/runs/k/draft/final", 3, True))
    args = dict(zip(cmd[3::2], cmd[4::2]))
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"] and cmd[-1] == "--trust-remote-code"
    assert (
        args["--speculative-algorithm"] == "EAGLE3" and args["--speculative-draft-model-path"] == "/runs/k/draft/final"
    )
    assert args["--speculative-num-steps"] == "3" and args["--speculative-eagle-topk"] == "1"
    assert args["--speculative-num-draft-tokens"] == "4"


def test_context_rows_put_each_source_s_buckets_side_by_side():
    """eval-context: a row per bucket any in-process source reached, in position order, the trained draft's rounds,
    and an empty cell where a source has no round in that bucket."""

    def bucket(lo, hi, rounds, tokens):
        label = f"{lo}+" if hi is None else f"{lo}-{hi}"
        return {
            "from": lo,
            "to": hi,
            "label": label,
            "rounds": rounds,
            "tokens": tokens,
            "acceptance_length": tokens / rounds,
        }

    report = {
        "trained": {"by_context": [bucket(0, 512, 10, 20)]},
        "untrained": {"by_context": [bucket(0, 512, 20, 20)]},
        "benchmarks": {
            "long": {"hf": {"by_context": [bucket(512, 1024, 4, 10), bucket(32768, None, 2, 3)]}},
            "engine_only": {"engine": {"per_round": 1.5}},
        },
    }
    assert context_rows(report) == [
        {"context": "0-512", "rounds": 10, "trained": 2.0, "untrained": 1.0, "long": None},
        {"context": "512-1024", "rounds": 0, "trained": None, "untrained": None, "long": 2.5},
        {"context": "32768+", "rounds": 0, "trained": None, "untrained": None, "long": 1.5},
    ]
    assert context_rows({"engine": {}}) == []  # no in-process eval: no table


def test_spec_eval_progress_says_the_prompts_and_rounds_at_each_10_s_of_silence():
    from models.common.rank_protocol import EVAL, EVAL_PROGRESS
    from tasks.eval.tasks import SpecEvalProgress
    from tasks.runtime.heartbeat import Heartbeat

    now = [0.0]
    beat = Heartbeat(lambda line: None, clock=lambda: now[0])
    shown: list[tuple[float, str]] = []
    progress = SpecEvalProgress(beat, drafts=2, show=lambda percent, text: shown.append((percent, text)))

    def prompts(draft: str, done: range, total: int, rounds: int) -> None:
        for i in done:
            line = EVAL_PROGRESS.format(draft=draft, done=i, total=total, new_tokens=9, rounds=rounds, accepted=3)
            progress.on_message(EVAL.parse(line))

    now[0] = 10.0  # the eval process still loading: no prompt yet
    assert beat.due() == (
        "spec-eval: starting the eval process (importing torch, loading the target and the draft): 10 s so far"
    )
    now[0] = 12.0
    prompts("trained", range(1, 21), 100, 31)
    prompts("trained", range(21, 41), 100, 30)
    now[0] = 19.9
    assert beat.due() is None  # the last line at 10 s: the next at 20 s
    now[0] = 20.0
    assert beat.due() == "spec-eval: trained draft, 40/100 prompts, 1,220 rounds, 8 s"
    prompts("trained", range(41, 101), 100, 10)
    now[0] = 30.0
    assert beat.due() == (
        "spec-eval: trained draft, 100/100 prompts, 1,820 rounds, 18 s (decoded; now replaying its outputs through "
        "the draft)"
    )
    now[0] = 31.0
    prompts("untrained", range(1, 2), 100, 50)  # a new pass: its own rounds and seconds
    now[0] = 40.0
    assert beat.due() == "spec-eval: untrained draft, 1/100 prompts, 50 rounds, 9 s"
    assert shown[39] == (20.0, "eval: trained draft, 40/100 prompts")
    assert shown[-1] == (50.5, "eval: untrained draft, 1/100 prompts")
