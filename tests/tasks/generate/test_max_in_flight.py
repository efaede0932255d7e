"""datasets[].max_in_flight: a dataset's own limit on requests at once; at 1 a budget stop is exact."""

from __future__ import annotations

import asyncio
import itertools
import random
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from emulators.sim import SimServer, simulate_output
from models.common.jobs import GenerateJob
from tasks.datasets import PromptRow
from tasks.generate.prompts import chat_prompt_ids, request_sampling_params
from tasks.serving.client import RetryPolicy
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into, responses

EOS = 1
SAMPLING = request_sampling_params({"max_new_tokens": 48, "temperature": 0.7, "top_p": 0.95}, [EOS])
FAST = RetryPolicy(initial_s=0.01, max_s=0.05, jitter=0.0, outage_window_s=20)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def prompts(n: int) -> list[PromptRow]:
    rng = random.Random(n)
    return [
        PromptRow(id=f"p{i}", messages=[{"role": "user", "content": f"q{i} " + "word " * rng.randint(1, 20)}])
        for i in range(n)
    ]


def run(server: SimServer, rows, run_dir: Path, tokenizer, **settings):
    async def go():
        async with ServerPool([server.url], max_concurrency=8, retry=FAST) as pool:
            job = GenerateJob(dataset="B1", sampling_params=SAMPLING, flush_every=4, **settings)
            return await generate_into(run_dir, rows, pool=pool, tokenizer=tokenizer, settings=job)

    return asyncio.run(go()), responses(run_dir)


def test_one_in_flight_stops_a_budget_at_the_file_order_prefix_that_reaches_it(tmp_path, tokenizer):
    server = SimServer(max_running=4, decode_s_per_token=0.001, mean_len=16, vocab_size=2048, eos_token_id=EOS, seed=0)
    server.start()
    rows = prompts(40)
    budget = 200
    try:
        report, got = run(server, rows, tmp_path, tokenizer, token_budget=budget, max_in_flight=1)
        stats = server.snapshot()
    finally:
        server.stop()
    # the sim's answer to each prompt, computed here without the loop: the first prompts whose tokens reach the budget
    lengths = [
        len(simulate_output(chat_prompt_ids(tokenizer, r.messages), SAMPLING, server.config).output_ids) for r in rows
    ]
    k = next(i + 1 for i, total in enumerate(itertools.accumulate(lengths)) if total >= budget)
    assert 3 <= k < len(rows)  # the budget binds, after a few answers
    assert [r["id"] for r in got] == [r.id for r in rows[:k]]  # in file order, none more, none fewer
    assert report.status == "budget reached" and report.aborted == 0 and report.wasted_tokens == 0
    assert report.completion_tokens == sum(lengths[:k])
    assert stats.max_in_flight == 1  # one request at a time reached the server


def test_max_in_flight_caps_a_dataset_below_the_pool_limit(tmp_path, tokenizer):
    server = SimServer(max_running=8, decode_s_per_token=0.002, mean_len=16, vocab_size=2048, eos_token_id=EOS, seed=0)
    server.start()
    try:
        report, got = run(server, prompts(30), tmp_path, tokenizer, max_in_flight=3)
        stats = server.snapshot()
    finally:
        server.stop()
    assert report.status == "complete" and sorted(r["id"] for r in got) == sorted(f"p{i}" for i in range(30))
    assert stats.max_in_flight == 3  # the pool would allow 8
