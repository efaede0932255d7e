"""The generate task's retries: one delay the Prefect UI can show, the doubling kept (flows/generate.py)."""

from __future__ import annotations

import asyncio

from prefect import flow, get_client, task
from prefect.client.schemas.filters import TaskRunFilter, TaskRunFilterFlowRunId
from prefect.runtime import flow_run
from prefect.utilities.math import lower_clamp_multiple

from flows.generate import doubling_retries, generate_responses

FIRST_S = 0.2
JITTER = 0.5  # doubling_retries' jitter factor: each delay within [d x lower_clamp_multiple(1.5), d x 1.5]


class Outage(RuntimeError):
    pass


attempts: list[int] = []


async def retry_outages(task, task_run, state) -> bool:
    """As tasks/generate/tasks.py's condition: retry an outage, nothing else."""
    try:
        await state.aresult()
    except Outage:
        return True
    except BaseException:
        return False
    return False


@task(retry_condition_fn=retry_outages)
async def flaky(fail: list[type[BaseException]]) -> int:
    attempts.append(1)
    if len(attempts) <= len(fail):
        raise fail[len(attempts) - 1]("down")
    return len(attempts)


@flow
async def run_flaky(fail: list[type[BaseException]], retries: int) -> tuple[int, str]:
    result = await flaky.with_options(**doubling_retries(retries, FIRST_S, flaky))(fail)
    return result, flow_run.get_id()


async def task_run_of(flow_run_id: str):
    async with get_client() as client:
        [run] = await client.read_task_runs(
            task_run_filter=TaskRunFilter(flow_run_id=TaskRunFilterFlowRunId(any_=[flow_run_id]))
        )
        return run, await client.read_task_run_states(run.id)


def test_the_policy_is_one_number_and_the_delays_double():
    attempts.clear()
    result, flow_run_id = asyncio.run(run_flaky([Outage, Outage, Outage], retries=3))
    assert result == 4
    run, states = asyncio.run(task_run_of(flow_run_id))
    # what the UI reads: a number (a list renders "NaNs"), the jitter beside it
    assert run.empirical_policy.retry_delay == FIRST_S and run.empirical_policy.retries == 3
    assert run.empirical_policy.retry_jitter_factor == JITTER
    waits = [
        (s.state_details.scheduled_time - s.timestamp).total_seconds() for s in states if s.name == "AwaitingRetry"
    ]
    assert len(waits) == 3
    low = lower_clamp_multiple(1 + JITTER)
    for wait, mean in zip(waits, (FIRST_S, 2 * FIRST_S, 4 * FIRST_S)):
        # the third: >= 0.8 x 0.63 = 0.50 s, more than a constant 0.2 s delay can reach (0.3 s)
        assert mean * low - 0.01 <= wait <= mean * (1 + JITTER) + 0.01, (waits, mean)


def test_the_task_s_own_condition_still_decides():
    attempts.clear()
    try:
        asyncio.run(run_flaky([Outage, ValueError], retries=3))
    except ValueError:
        pass
    else:
        raise AssertionError("a ValueError is not an outage: the task must fail")
    assert len(attempts) == 2  # the outage retried once, the ValueError not at all


def test_generate_keeps_its_outage_condition():
    options = doubling_retries(3, 60.0, generate_responses)
    assert options["retry_delay_seconds"] == 60.0 and options["retries"] == 3
    assert options["retry_condition_fn"] is not generate_responses.retry_condition_fn  # wrapped, not replaced
    assert doubling_retries(0, 60.0, generate_responses)["retry_jitter_factor"] is None
