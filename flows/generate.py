"""Flow `generate`: one task per dataset; passthrough datasets are copied, generate datasets go through the
serving engine (SGLang or vLLM)."""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

from prefect import Task, flow, get_run_logger
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from flows.stage_run import stage_run
from models.common.jobs import GenerateJob
from settings.dataset import DatasetGenerateSettings
from settings.generate import GenerateSettings
from settings.run import RunConfig
from tasks.datasets.hub import dataset_source
from tasks.generate.prompts import request_sampling_params
from tasks.generate.tasks import (
    check_generated_by,
    copy_passthrough_task,
    generate_responses,
    publish_generate_summary,
    publish_server_table,
    server_pool,
)
from tasks.serving.pool import ServerPool


@flow(name="generate", flow_run_name="generate {config_path}", log_prints=True)
async def generate(config_path: str, retry_rejects: bool = False) -> list[dict]:
    """Stage 1: fan out one task per dataset, all sharing one pool of servers and its per-server limits."""
    with stage_run(config_path, "generate") as config:
        async with server_pool(config.server, get_run_logger()) as pool:  # shared by every dataset
            # responses made by another engine or target are refused before the first request (after the datasets
            # are read, and once the server answers: it says what it is), so a run with nothing left to send runs on
            pool.before_first_request = lambda: check_generated_by(
                layout=config.layout,
                pool=pool,
                engine=config.server.engine,
                launch=config.server.launch,
                command=config.server.command,
                target_path=config.target.path,
            )
            calls = (dataset_task(config, i, pool, retry_rejects) for i in range(len(config.datasets)))
            results = await asyncio.gather(*calls, return_exceptions=True)
            if pool.refused_start is not None:  # every dataset that had work was refused the same way: say it once
                raise pool.refused_start
            if pool.started_at is not None:
                await publish_server_table(rows=pool.rows(), config_name=Path(config_path).stem)
        rows = await publish_generate_summary(run_dir=config.run_dir, config_name=Path(config_path).stem)
    failures = [(d.name, r) for d, r in zip(config.datasets, results) if isinstance(r, BaseException)]
    if failures:
        raise GenerateFailed(failures) from failures[0][1]
    return rows


class GenerateFailed(RuntimeError):
    """Some datasets failed; every error is named, the first one whole (it usually says what to do)."""

    def __init__(self, failures: list[tuple[str, BaseException]]):
        name, first = failures[0]
        others = ", ".join(n for n, _ in failures[1:])
        also = f" (also failed: {others})" if others else ""
        super().__init__(
            f"generate failed for {name}{also}: {first}. Everything written is kept: "
            "re-run the same command to resume once the cause is fixed"
        )


def dataset_task(config: RunConfig, index: int, pool: ServerPool, retry_rejects: bool = False):
    """The task call for dataset `index`: a copy for passthrough, generation otherwise."""
    dataset = config.datasets[index]
    if dataset.kind == "passthrough":
        return asyncio.to_thread(
            copy_passthrough_task,
            name=dataset.name,
            source=dataset_source(dataset, config.layout),
            on_bad_row=dataset.on_bad_row,
            layout=config.layout,
            row_format=dataset.row_format,
        )
    gen = config.generate
    settings = GenerateJob(
        **gen.pick(GenerateSettings),
        **dataset.pick(DatasetGenerateSettings),
        dataset=dataset.name,
        sampling_params=request_sampling_params(config.sampling.model_dump(), config.sampling.stop_token_ids or []),
        sampling_seed=config.sampling.seed,
        retry_rejects=retry_rejects,
    )
    task = generate_responses.with_options(**doubling_retries(gen.retries, gen.retry_delay_s, generate_responses))
    return task(
        name=dataset.name,
        source=dataset_source(dataset, config.layout),
        on_bad_row=dataset.on_bad_row,
        target_path=config.target.path,
        trust_remote_code=config.target.trust_remote_code,
        settings=settings,
        layout=config.layout,
        pool=pool,
        row_format=dataset.row_format,
    )


def doubling_retries(retries: int, first_delay_s: float, task: Task) -> dict[str, Any]:
    """with_options for `task`: `retries` retries after `first_delay_s` x 1, 2, 4, ... with jitter; one delay shown.

    A list of delays (what prefect's own `exponential_backoff` returns) is stored as the task run's
    `empirical_policy.retry_delay`, and the Prefect UI shows a list as "NaNs" (its task-run details format the field as
    seconds: prefect/server/ui, 3.9.1) or "None" (ui-v2: `typeof retry_delay == "number"`). So the task is given the
    first delay, which the UI shows, and its retry condition sets the next one before the engine reads it
    (prefect/task_engine.py `handle_retry`: the condition runs, then `task.retry_delay_seconds` is read).
    """
    condition = task.retry_condition_fn

    async def retry_and_double(task: Task, task_run: TaskRun, state: State) -> bool:
        retry = condition is None or await _maybe_await(condition(task, task_run, state))
        if retry:  # run_count: the attempts so far (1 after the first failure): the next waits first_delay_s x 2**(n-1)
            task.retry_delay_seconds = first_delay_s * 2 ** max(task_run.run_count - 1, 0)
        return retry

    return {
        "retries": retries,
        "retry_delay_seconds": first_delay_s,
        "retry_condition_fn": retry_and_double,
        # Prefect types with_options' retry_jitter_factor float | NotSet, but takes None as Task() does (no jitter)
        "retry_jitter_factor": 0.5 if retries else None,
    }


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value
