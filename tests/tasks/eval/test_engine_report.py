"""The engine eval's arithmetic and checks (tasks/eval/engine_report.py): SGLang's count, the per-round count,
speedup."""

from __future__ import annotations

import pytest

from models.eval.prompts import EvalPrompt
from tasks.eval.engine_report import acceptance, compare_with_hf, engine_report, spread
from tasks.serving.client import ServerLimits
from tasks.serving.eval_server import Phase, Served, check_command, fit_draft_context, no_rounds_listed
from tasks.serving.sglang import SGLangClient, context_length, speculative_settings
from tasks.serving.vllm import VLLMClient


def lim(info: dict) -> ServerLimits:
    """What SGLangClient.limits reads from this /server_info."""
    return ServerLimits(context_length=context_length(info), speculative=speculative_settings(info), info=info)


def check_speculative_server(info, url, num_steps):
    SGLangClient(url).check_draft(lim(info), num_steps)


def reserved_tokens(info):
    return lim(info).reserved_tokens


def served(source, id, tokens, verify, seconds=1.0, out=None, prompt=20):
    return Served(source, id, tokens, verify, seconds, tuple(out or range(tokens)), prompt)


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
    # vLLM 0.32: --speculative-config JSON (method eagle3), --per-request-spec-decode-metrics adds
    # metrics.speculative_decoding to each reply (entrypoints/generate/base/protocol.py); detailed: with each verify
    # step's accepted drafts in order (config/observability.py)
    import json

    args = VLLMClient.speculative_args("/d", 3)
    assert json.loads(args[1]) == {"method": "eagle3", "model": "/d", "num_speculative_tokens": 3}
    assert args[0] == "--speculative-config" and args[2:] == ["--per-request-spec-decode-metrics", "detailed"]
    assert ServerLimits(context_length=2048).reserved_tokens == 0  # vLLM reports no draft: nothing is reserved


def test_the_engine_s_rounds_are_placed_by_context_position_and_compared_with_hf_round_by_round():
    """vLLM's per-step counts: each round where it starts (prompt + the tokens before it), the last one cut by the
    end; the buckets and the per-prompt rounds set beside the HF backend's."""
    # a1: prompt 6, 10 tokens: the prefill's, then rounds of 4 (starts 7), 1 (11), 4 (12; 3 + 1) -> 10 made.
    # b1: prompt 14, 5 tokens: rounds of 2 (15), 2 (17; accepted 3, cut by the end to what was left).
    a1 = Served("A", "a1", 10, 3, 1.0, tuple(range(10)), 6, (3, 0, 3))
    b1 = Served("B", "b1", 5, 2, 1.0, tuple(range(5)), 14, (1, 3))
    empty = Served("A", "a2", 1, 0, 0.1, (7,), 9, None)  # ended on the prefill's token: vLLM sends no list
    r = engine_report(
        Phase(no_rounds_listed([a1, b1, empty]), {}, 1.0, lim({})), None, 3, 1, "vllm", context_edges=[8, 16]
    )
    assert [row.get("round_tokens") for row in r["per_prompt"]] == [[4, 1, 4], [2, 2], []]
    # by hand: 0-8: a1's round at 7 (4 tokens); 8-16: a1 at 11, 12 (1 + 4), b1 at 15 (2); 16+: b1 at 17 (2)
    assert [(c["label"], c["rounds"], c["tokens"]) for c in r["overall"]["by_context"]] == [
        ("0-8", 1, 4),
        ("8-16", 3, 7),
        ("16+", 1, 2),
    ]
    assert [c["rounds"] for c in r["datasets"]["B"]["by_context"]] == [1, 1] and "unplaced" not in r["overall"]
    hf = {
        "acceptance_length": r["overall"]["per_round"],
        "by_context": r["overall"]["by_context"],
        "per_prompt": [
            {"source": "A", "id": "a1", "new_tokens": 10, "rounds": 3, "round_tokens": [4, 1, 4]},
            {"source": "B", "id": "b1", "new_tokens": 5, "rounds": 2, "round_tokens": [2, 2]},
            {"source": "A", "id": "a2", "new_tokens": 1, "rounds": 0, "round_tokens": []},
        ],
    }
    same = compare_with_hf(r, hf)
    assert same["equal"] and same["same_rounds_in_order"] == same["prompts_compared_round_by_round"] == 3
    # the same totals in another order: equal per prompt, not round by round
    hf["per_prompt"][0]["round_tokens"] = [1, 4, 4]
    other = compare_with_hf(r, hf)
    assert other["same_verify_rounds"] == 3 and other["same_rounds_in_order"] == 2 and not other["equal"]


def test_rounds_that_cannot_be_placed_are_named_and_left_out_of_the_buckets():
    # 3 rounds of 1 token make 4 of the 6 tokens: a step without drafts decoded the rest (vLLM's token budget)
    short = Served("A", "s", 6, 3, 1.0, tuple(range(6)), 4, (0, 0, 0))
    fine = Served("A", "f", 3, 1, 1.0, tuple(range(3)), 4, (1,))
    r = engine_report(Phase([short, fine], {}, 1.0, lim({})), None, 3, 1, "vllm", context_edges=[8])
    said = "its per-round counts cannot be placed: 3 rounds make 4 of the answer's 6 tokens"
    assert r["overall"]["unplaced"] == {"s": said}
    assert [(c["rounds"], c["tokens"]) for c in r["overall"]["by_context"]] == [(1, 2)]
    assert "round_tokens" not in r["per_prompt"][0] and r["per_prompt"][1]["round_tokens"] == [2]


def test_an_engine_that_sends_totals_places_whole_requests_whose_rounds_all_start_in_one_bucket():
    """SGLang's spec_verify_ct: a request's rounds start between prompt + 1 and prompt + tokens - 1, so a request
    inside one bucket is that bucket's, exactly; one across an edge is named, not guessed."""
    inside = served("L", "long", 9, 3, prompt=600)  # rounds start at 601..608: all in 512-1024
    across = served("L", "edge", 9, 4, prompt=508)  # 509..516: across 512
    short = served("S", "s", 5, 2, prompt=20)  # 21..24
    one = served("S", "one", 1, 0, prompt=30)  # ended on the prefill's token: no round
    r = engine_report(Phase([inside, across, short, one], {}, 1.0, lim({})), None, 3, 1, context_edges=[512, 1024])
    o = r["overall"]
    assert [(c["label"], c["rounds"], c["tokens"]) for c in o["by_context"]] == [("0-512", 2, 4), ("512-1024", 3, 8)]
    assert o["placed_by"] == "request" and list(o["unplaced"]) == ["edge"] and "509-516" in o["unplaced"]["edge"]
    assert not any("round_tokens" in p for p in r["per_prompt"])  # no per-round counts: none made up
    assert no_rounds_listed([one]) == [one]  # from a server that lists no rounds, none is listed for it either
    assert "same_rounds_in_order" not in compare_with_hf(r, {"acceptance_length": 1.0, "per_prompt": []})


def test_the_wait_for_a_server_s_health_check_says_how_long_every_10_s(monkeypatch, tmp_path):
    import contextlib
    from pathlib import Path

    from settings.server import ServerSettings
    from tasks.runtime.heartbeat import Heartbeat
    from tasks.serving import eval_server

    now = [0.0]
    logged: list[str] = []
    beat = Heartbeat(logged.append, clock=lambda: now[0])
    due: list[str | None] = []

    @contextlib.contextmanager
    def loading(*args, **kwargs):  # the server loads for 24 s, answers, then stops in 12 s
        for step in (9.0, 1.0, 10.0, 4.0):
            now[0] += step
            due.append(beat.due())
        yield ["the server"]
        now[0] += 12.0
        due.append(beat.due())

    monkeypatch.setattr(eval_server, "launched_servers", loading)
    server = eval_server.EvalServer(
        settings=ServerSettings(url="http://127.0.0.1:8000"), launch="dev", target="t", log_dir=tmp_path
    )
    with server.serving(["--speculative-algorithm", "EAGLE3"], "eval-with-draft", _Quiet(), beat) as launched:
        assert launched == ["the server"]
        now[0] += 30.0
        due.append(beat.due())  # the phase's own steps say what they do: nothing from the server's step
    log = Path(tmp_path / "eval-with-draft" / "server.log")
    what = "the dev server with the draft at http://127.0.0.1:8000"
    assert due == [
        None,
        f"engine eval: waiting for {what} to answer its health check (log: {log}): 10 s so far",
        f"engine eval: waiting for {what} to answer its health check (log: {log}): 20 s so far",
        None,
        None,
        f"engine eval: stopping {what}: 12 s so far",
    ]
    assert logged == [f"engine eval: {what} answers its health check after 24 s"]


class _Quiet:
    def info(self, *args) -> None:
        pass
