"""One dataset's generate run in a process of its own, for the tests that kill it with SIGKILL and resume it:

    python tests/generate_runner.py URL TOKENIZER_DIR RUN_DIR PROMPTS_JSONL GENERATE_JOB_JSON MAX_CONCURRENCY

PROMPTS_JSONL holds PromptRow fields a line; GENERATE_JOB_JSON a models.common.jobs.GenerateJob (its dataset names the
responses and rejects directories under RUN_DIR). At the end it prints `DONE {"conversations": N, "responses": N}`.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path


def main(argv: list[str]) -> None:
    from transformers import AutoTokenizer

    from models.common.jobs import GenerateJob
    from settings.layout import RunLayout
    from tasks.datasets import PromptRow
    from tasks.generate.loop import generate_dataset
    from tasks.serving.pool import ServerPool

    url, tokenizer_dir, run_dir, prompts_file, job, concurrency = argv
    settings = GenerateJob.model_validate_json(job)
    rows = [PromptRow(**json.loads(line)) for line in Path(prompts_file).read_text().splitlines()]
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    layout = RunLayout(run_dir)

    async def run():
        async with ServerPool([url], max_concurrency=int(concurrency)) as pool:
            return await generate_dataset(
                rows,
                pool=pool,
                tokenizer=tokenizer,
                layout=layout,
                settings=settings,
                source=Path(prompts_file),
                vocab_size=len(tokenizer),
            )

    report = asyncio.run(run())
    print("DONE", json.dumps({"conversations": report.conversations, "responses": report.responses}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
