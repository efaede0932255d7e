"""`eagle3 demo`: the pipeline so far, on the embedded default (tiny target, dev server, sample data)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rich.console import Console
from rich.table import Table

from flows.config import RunConfig, load_config
from models.tiny_target import build_tiny_target
from tasks.datasets import load_dataset
from tasks.processes import dev_server
from tasks.prompts import chat_prompt_ids, default_stop_ids, request_sampling_params
from tasks.sglang_client import Completion, SGLangClient

REPO = Path(__file__).resolve().parents[1]
DEMO_CONFIG = REPO / "configs" / "demo.yaml"
PROMPTS_PER_DATASET = 2


def demo_config(run_dir: Path | None = None) -> RunConfig:
    """configs/demo.yaml with paths resolved against the repository root."""
    config = load_config(DEMO_CONFIG, base=REPO)
    if run_dir is not None:
        config.run_dir = run_dir.resolve()
    return config


def run_demo(run_dir: Path | None = None, console: Console | None = None, target_dir: Path | None = None) -> list[Completion]:
    """Build the tiny target, serve it, generate a few responses per sample dataset, print them."""
    console = console or Console()
    config = demo_config(run_dir)
    if target_dir is not None:
        config.target.path = str(target_dir)
    console.rule("eagle3 demo")
    target = build_tiny_target(config.target.path)
    console.print(f"tiny target: {target}")

    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(target)
    prompts = []
    for dataset in config.datasets:
        if dataset.kind == "generate":
            rows = load_dataset(dataset.path, "generate", on_bad_row=dataset.on_bad_row).rows
            prompts += [(dataset.name, row) for row in rows[:PROMPTS_PER_DATASET]]

    server = dev_server(target, log_path=config.run_dir / "logs" / "dev-server.log")
    console.print(f"starting the dev server at {server.url} (log: {server.log_path})")
    with server:
        server.wait_healthy(timeout_s=180)
        completions = asyncio.run(_generate(config, server.url, tokenizer, prompts))
    console.print("dev server stopped")

    table = Table(title="generated responses (dev server, tiny random-weight target)", show_lines=True)
    for column in ("dataset", "id", "prompt", "response", "tokens", "finish"):
        table.add_column(column, overflow="fold")
    for (name, row), done in zip(prompts, completions):
        table.add_row(
            name, row.id, _short(row.messages[-1]["content"], 60), _short(done.text, 120),
            f"{done.prompt_tokens}+{done.completion_tokens}", done.finish_reason,
        )
    console.print(table)
    return completions


async def _generate(config: RunConfig, url: str, tokenizer, prompts) -> list[Completion]:
    stop_ids = config.sampling.stop_token_ids or default_stop_ids(tokenizer)
    params = request_sampling_params(config.sampling.model_dump(), stop_ids)
    limit = asyncio.Semaphore(config.server.max_concurrency)

    async def one(client: SGLangClient, name: str, row) -> Completion:
        async with limit:
            return await client.generate(chat_prompt_ids(tokenizer, row.messages), params, rid=f"{name}:{row.id}")

    async with SGLangClient(url, request_timeout_s=config.server.request_timeout_s) as client:
        return await asyncio.gather(*(one(client, name, row) for name, row in prompts))


def _short(text: str, n: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
