"""sampling.seed at the dev server: the same responses whatever the concurrency (and so the batches) they ran in."""

from __future__ import annotations

import asyncio
from pathlib import Path

from transformers import AutoTokenizer

from emulators.dev_server.app import create_app
from models.common.jobs import GenerateJob
from tasks.datasets import PromptRow
from tasks.generate.prompts import prompt_sampling_seed, request_sampling_params
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into, responses

EOS = 1
SAMPLING = request_sampling_params({"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.95, "seed": 3}, [EOS])
ROWS = [
    PromptRow(id=f"p{i}", messages=[{"role": "user", "content": text}])
    for i, text in enumerate(
        [
            "Write a Python function that reverses a list.",
            "What is 17 times 23?",
            "Give me three tips for commit messages.",
            "Explain a race condition.",
            "How many days are in a leap year?",
            "Summarise the passage below.",
            "What is the area of a 9 by 4 rectangle?",
            "Write a C function that removes duplicate characters.",
            "How do I atomically write a file?",
            "Tell me about sorting.",
            "What is a generator?",
            "Name a prime above 90.",
        ]
    )
]


def test_prompt_sampling_seed_is_a_function_of_the_prompt_alone():
    assert "seed" not in SAMPLING  # ours, not SGLang's: each request carries its own sampling_seed instead
    seeds = {prompt_sampling_seed(3, "B1", row.id) for row in ROWS}
    assert len(seeds) == len(ROWS) and all(0 <= s < 2**31 for s in seeds)
    assert prompt_sampling_seed(3, "B1", "p0") == prompt_sampling_seed(3, "B1", "p0")
    assert prompt_sampling_seed(3, "B2", "p0") != prompt_sampling_seed(3, "B1", "p0")
    assert prompt_sampling_seed(4, "B1", "p0") != prompt_sampling_seed(3, "B1", "p0")


def generate(url: str, run_dir: Path, tokenizer, *, slots: int, seed: int | None) -> dict[str, list[int]]:
    settings = GenerateJob(
        dataset="B1", sampling_params=SAMPLING, sampling_seed=seed, flush_every=4, log_interval_s=0.5
    )

    async def go():
        async with ServerPool([url], max_concurrency=slots, request_timeout_s=120) as pool:
            await generate_into(run_dir, ROWS, pool=pool, tokenizer=tokenizer, settings=settings, source="b1.jsonl")

    asyncio.run(go())
    return {r["id"]: r["output_ids"] for r in responses(run_dir)}


def test_seeded_responses_do_not_depend_on_concurrency(tiny_target_dir, serve_app, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    with serve_app(create_app(tiny_target_dir, context_length=512, max_batch_size=8, model_name="tiny")) as url:
        one = generate(url, tmp_path / "one", tokenizer, slots=1, seed=3)  # each request alone in its batch
        eight = generate(url, tmp_path / "eight", tokenizer, slots=8, seed=3)  # up to 8 decoded together
        unseeded = generate(url, tmp_path / "unseeded", tokenizer, slots=8, seed=None)
    assert len(one) == len(ROWS) and one == eight
    assert unseeded != one  # without the seed the server draws its own randomness
    assert len({tuple(v) for v in one.values()}) > 1
