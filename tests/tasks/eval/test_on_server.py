"""The engine eval's arithmetic and checks (tasks/eval/on_server.py): SGLang's count, the per-round count, speedup."""

from __future__ import annotations

import pytest

from models.eval.prompts import EvalPrompt
from tasks.engines.client import ServerLimits
from tasks.engines.sglang import SGLangClient, context_length, speculative_settings
from tasks.engines.vllm import VLLMClient
from tasks.eval.on_server import (
    Phase,
    Served,
    acceptance,
    check_command,
    compare_with_hf,
    engine_report,
    fit_draft_context,
    spread,
)


def lim(info: dict) -> ServerLimits:
    """What SGLangClient.limits reads from this /server_info."""
    return ServerLimits(context_length=context_length(info), speculative=speculative_settings(info), info=info)


def check_speculative_server(info, url, num_steps):
    SGLangClient(url).check_draft(lim(info), num_steps)


def reserved_tokens(info):
    return lim(info).reserved_tokens


def served(source, id, tokens, verify, seconds=1.0, out=None):
    return Served(source, id, tokens, verify, seconds, tuple(out or range(tokens)))


WITH = [served("A", "a1", 10, 4, 1.0), served("A", "a2", 1, 0, 0.1), served("B", "b1", 9, 2, 0.5)]


def test_acceptance_sums_tokens_and_rounds_over_requests():
    a = acceptance(WITH)
    assert (a["completion_tokens"], a["verify_rounds"], a["prompts"]) == (20, 6, 3)
    assert a["acceptance_length"] == round(20 / 6, 4)  # SGLang: prefill token counted
    assert a["per_round"] == round((20 - 3) / 6, 4)  # per verify round: each request's first token is not a round's
    assert a["per_request"]["min"] == 2.5 and a["per_request"]["max"] == 4.5  # 10/4, 9/2; the 0-round request has none
    assert acceptance([])["acceptance_length"] is None


def test_spread_of_sorted_values():
    assert spread([]) is None
    s = spread([float(i) for i in range(1, 11)])
    assert s == {"min": 1.0, "p10": 2.0, "median": 5.5, "p90": 10.0, "max": 10.0}


def test_report_per_dataset_speedup_and_unchanged_outputs():
    without = [served("A", "a1", 10, None, 2.0), served("A", "a2", 1, None, 0.1), served("B", "b1", 9, None, 1.5)]
    info = {"speculative_draft_model_path": "/d", "internal_states": [{"avg_spec_accept_length": 2.8333}]}
    r = engine_report(Phase(WITH, {}, 1.6, lim(info)), Phase(without, {}, 3.6, lim({})), num_steps=3, concurrency=1)
    assert r["overall"]["with_draft"]["tokens_per_s"] == round(20 / 1.6, 2)
    assert r["overall"]["without_draft"]["tokens_per_s"] == round(20 / 3.6, 2)
    assert r["overall"]["speedup"] == round((20 / 1.6) / (20 / 3.6), 3)
    assert r["datasets"]["A"]["prompts"] == 2 and r["datasets"]["A"]["per_round"] == round((11 - 2) / 4, 4)
    assert r["datasets"]["B"]["speedup"] == round((9 / 0.5) / (9 / 1.5), 3)
    assert r["server"]["avg_spec_accept_length"] == 2.8333
    assert r["outputs_differ_without_draft"] == 0
    changed = [served("A", "a1", 10, None, out=[7] * 10), *without[1:]]
    assert (
        engine_report(Phase(WITH, {}, 1, lim(info)), Phase(changed, {}, 1, lim({})), 3, 1)[
            "outputs_differ_without_draft"
        ]
        == 1
    )
    alone = engine_report(Phase(WITH, {"x": "too long"}, 1.6, lim(info)), None, 3, 1)
    assert "speedup" not in alone["overall"] and alone["refused"] == {"x": "too long"}


def test_comparison_with_the_hf_backend_is_per_prompt():
    engine = engine_report(Phase(WITH, {}, 1, lim({})), None, 3, 1)
    hf = {
        "acceptance_length": round(17 / 6, 4),
        "per_prompt": [
            {"source": "A", "id": "a1", "new_tokens": 10, "rounds": 4},
            {"source": "A", "id": "a2", "new_tokens": 1, "rounds": 0},
            {"source": "B", "id": "b1", "new_tokens": 9, "rounds": 2},
        ],
    }
    c = compare_with_hf(engine, hf)
    assert c["equal"] and c["prompts_compared"] == 3 and c["engine_per_round"] == c["hf_acceptance_length"]
    hf["per_prompt"][2]["rounds"] = 3
    c = compare_with_hf(engine, hf)
    assert not c["equal"] and c["same_verify_rounds"] == 2 and c["same_completion_tokens"] == 3


def test_the_server_must_serve_a_chain_draft_of_num_steps():
    ok = {"speculative_algorithm": "EAGLE3", "speculative_num_steps": 3, "speculative_eagle_topk": 1}
    check_speculative_server(ok, "http://s", 3)
    with pytest.raises(ValueError, match="serves no EAGLE-3 draft.*--speculative-algorithm EAGLE3"):
        check_speculative_server({}, "http://s", 3)
    with pytest.raises(ValueError, match="drafts 5 tokens per round.*eval.num_steps is 3"):
        check_speculative_server({**ok, "speculative_num_steps": 5}, "http://s", 3)
    with pytest.raises(ValueError, match="tree"):
        check_speculative_server({**ok, "speculative_eagle_topk": 4}, "http://s", 3)


def test_a_command_that_already_drafts_is_refused():
    check_command(["python", "-m", "sglang.launch_server", "--tp", "8"])
    with pytest.raises(ValueError, match="--speculative-num-steps.*remove them"):
        check_command(["python", "-m", "sglang.launch_server", "--speculative-num-steps", "3"])
    assert SGLangClient.speculative_args("/d", 5) == [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        "/d",
        "--speculative-num-steps",
        "5",
        "--speculative-eagle-topk",
        "1",
        "--speculative-num-draft-tokens",
        "6",
    ]


def test_prompts_are_chosen_with_the_draft_s_reserved_tokens():
    # SGLang 0.5.23 managers/utils.py compute_num_reserved_tokens: max(topk * num_steps, num_draft_tokens) per request
    info = {
        "speculative_algorithm": "EAGLE3",
        "speculative_num_steps": 3,
        "speculative_eagle_topk": 1,
        "speculative_num_draft_tokens": 4,
        "context_length": 100,
    }
    assert reserved_tokens(info) == 4 and reserved_tokens({"context_length": 100}) == 0
    assert reserved_tokens({**info, "speculative_eagle_topk": 4, "speculative_num_draft_tokens": 8}) == 12
    # 100 - 16 new tokens: a prompt of 84 fits a server without the draft, but not one that reserves 4
    prompts = [EvalPrompt("A", f"p{n}", list(range(n))) for n in (80, 81, 84)]
    kept, skipped = fit_draft_context(prompts, lim(info), max_new_tokens=16)
    assert [p.id for p in kept] == ["p80"] and sorted(skipped) == ["p81", "p84"]
    assert "4 reserved for the draft" in skipped["p84"]
    assert fit_draft_context(prompts, lim({"context_length": 100}), 16)[0] == prompts  # no draft: nothing reserved
    assert (
        fit_draft_context(
            prompts, lim({"max_req_len": 99, **{k: v for k, v in info.items() if k != "context_length"}}), 16
        )[0]
        == kept
    )
    assert fit_draft_context(prompts, lim({}), 16) == (prompts, {})  # the server does not say: the server decides
    report = engine_report(Phase(WITH, {}, 1.6, lim(info), skipped), None, 3, 1)
    assert report["skipped"] == skipped and "every 40 decode batches" in report["server"]["note"]


def test_vllm_is_launched_with_its_speculative_config_and_per_request_counts():
    # vLLM 0.32: --speculative-config JSON (method eagle3), --per-request-spec-decode-metrics summary adds
    # metrics.speculative_decoding to each reply (entrypoints/generate/base/protocol.py)
    import json

    args = VLLMClient.speculative_args("/d", 3)
    assert json.loads(args[1]) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert args[0] == "--speculative-config" and args[2:] == ["--per-request-spec-decode-metrics", "summary"]
    assert ServerLimits(context_length=2048).reserved_tokens == 0  # vLLM reports no draft: nothing is reserved
