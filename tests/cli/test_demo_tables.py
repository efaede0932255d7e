"""The demo's tables say what they hold: the context table's caption names only the columns it has."""

from __future__ import annotations

from cli.demo import context_caption
from tasks.eval.tasks import context_rows


def bucket(lo: int, hi: int, rounds: int, tokens: int) -> dict:
    return {"from": lo, "to": hi, "label": f"{lo}-{hi}", "rounds": rounds, "tokens": tokens, "acceptance_length": 1.5}


def caption(report: dict) -> str:
    return context_caption(list(context_rows(report)[0]), report)


def test_an_in_process_table_without_benchmarks_names_no_benchmark_or_engine_column():
    # the Kimi demo: eval prompts only, the engine (vLLM) sending no per-round counts for them
    report = {"trained": {"by_context": [bucket(0, 512, 10, 15)]}, "engine": {"engine": "vllm", "overall": {}}}
    said = caption(report)
    assert said == "rounds: the trained draft's verify rounds on the eval prompts (in-process); all in-process"


def test_the_dev_server_s_requests_are_not_called_vllm_s_rounds():
    # the llama demo: a benchmark in-process and through the dev server (SGLang's API: a request's totals only)
    report = {
        "trained": {"by_context": [bucket(0, 512, 10, 15)]},
        "engine": {"engine": "sglang", "overall": {"placed_by": None}},
        "benchmarks": {
            "context_probes": {
                "hf": {"by_context": [bucket(64, 128, 4, 6)]},
                "engine": {"by_context": [bucket(64, 128, 4, 6)], "placed_by": "request"},
            }
        },
    }
    said = caption(report)
    assert "vllm" not in said and "context_probes: the trained draft on that benchmark" in said
    assert "(sglang): as the serving engine counted them, each whole request in the bucket" in said


def test_vllm_s_rounds_are_placed_round_by_round():
    report = {
        "trained": {"by_context": [bucket(0, 512, 10, 15)]},
        "engine": {"engine": "vllm", "overall": {"by_context": [bucket(0, 512, 10, 15)], "placed_by": "round"}},
    }
    said = caption(report)
    assert "benchmark" not in said and "(vllm): as the serving engine counted them, each verify round where" in said
