"""A budgeted generate run that the tests of the generate stage in more than one module set up."""

from __future__ import annotations

import asyncio

from tasks.generate.prompts import chat_prompt_ids
from tasks.serving.pool import ServerPool


def prompts_from(tokenizer, rows, start: int):
    """A sim server's hold_if predicate: true for the prompt ids of rows[start:].

    The budgeted run sends rows in file order, so the requests it sends after the first `start - 20` stay queued at
    the server until they are stopped: whether they are still running when the budget is reached does not depend on
    how fast a loaded machine reads the first answers."""
    held = {tuple(chat_prompt_ids(tokenizer, row.messages)) for row in rows[start:]}
    return lambda ids: tuple(ids) in held


def budget_run_after_short_answers(
    generate, urls: list[str], rows, run_dir, tokenizer, sampling, *, token_budget: int, seen, **pool_options
):
    """Through one ServerPool(urls, **pool_options): rows[:20] with 4-token answers, then all of `rows` under
    `token_budget`. The first run makes the budget's length estimate far too low for the second, so many of its
    requests are in flight (or queued at the server) when its budget is reached.

    `generate(pool, rows, run_dir, tokenizer, **settings)` is the test module's run of the generate loop, `sampling`
    its sampling params. Returns the second run's report and `seen(pool)`, read before the pool closes."""

    async def go():
        async with ServerPool(urls, **pool_options) as pool:
            await generate(pool, rows[:20], run_dir, tokenizer, sampling_params={**sampling, "max_new_tokens": 4})
            report = await generate(pool, rows, run_dir, tokenizer, token_budget=token_budget)
            return report, seen(pool)

    return asyncio.run(go())
