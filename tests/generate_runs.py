"""The generate loop run into a test's run directory, and what it wrote there, for the tests of more than one module."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow.parquet as pq

from models.common.jobs import GenerateJob
from settings.layout import RunLayout
from tasks.datasets import PromptRow
from tasks.generate.loop import generate_dataset
from tasks.responses.checkpoints import live_parts


def prompt_rows(
    n: int, prefix: str = "p", words: tuple[int, int] = (1, 20), question: str = "q{i} "
) -> list[PromptRow]:
    """`n` one-message prompts with ids prefix0, prefix1, ...: `question` (with {i}), then a seeded number of words."""
    rng = random.Random(n)
    return [
        PromptRow(
            id=f"{prefix}{i}",
            messages=[{"role": "user", "content": question.format(i=i) + "word " * rng.randint(*words)}],
        )
        for i in range(n)
    ]


def generate_job(sampling: dict, dataset: str = "B1", **kw) -> GenerateJob:
    """A dataset's settings that flush every 8 responses (or 0.5 s) and log every 0.2 s, with `sampling` as its
    sampling_params unless `kw` sets them; `kw` sets the rest."""
    base = {"flush_every": 8, "flush_interval_s": 0.5, "log_interval_s": 0.2}
    return GenerateJob(**{"dataset": dataset, "sampling_params": sampling, **base, **kw})


def generate_into(
    run_dir: Path,
    rows,
    *,
    pool,
    tokenizer,
    settings: GenerateJob,
    source: str = "x",
    vocab_size: int | None = None,
    **kw,
):
    """`generate_dataset(rows, ...)` (a coroutine) writing run_dir/responses/DATASET and run_dir/rejects/DATASET."""
    return generate_dataset(
        rows,
        pool=pool,
        tokenizer=tokenizer,
        layout=RunLayout(run_dir),
        source=Path(source),
        settings=settings,
        vocab_size=vocab_size,
        **kw,
    )


def response_row(id: str, prompt_ids: list[int], output_ids: list[int], finish_reason: str = "stop") -> dict:
    """A row of a responses part as the generate loop writes it, with no text, latency, cached or reasoning tokens."""
    return {
        "id": id,
        "prompt_ids": prompt_ids,
        "output_ids": output_ids,
        "prompt_tokens": len(prompt_ids),
        "completion_tokens": len(output_ids),
        "finish_reason": finish_reason,
        "text": "",
        "latency": 0.0,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "finished_at": 1.0,
    }


def responses(run_dir: Path, dataset: str = "B1") -> list[dict]:
    """Every response row in the live parts of run_dir/responses/DATASET, part by part."""
    return [r for p in live_parts(run_dir / "responses" / dataset) for r in pq.read_table(p).to_pylist()]
