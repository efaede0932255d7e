"""Generate through the real SGLang router (the `sglang-router` package) in front of two dev servers.

The router answers /generate and /health_generate like a server, but /abort_request with 404 and
/get_server_info in its own shape; the pool reads the input limit from the router's workers and
stops requests at the budget by closing their connections.
"""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from transformers import AutoTokenizer

from emulators.sglang_protocol.disconnect import DISCONNECT_POLL_S
from models.common.jobs import GenerateJob
from tasks.datasets import PromptRow
from tasks.generate.prompts import request_sampling_params
from tasks.runtime.ports import free_ports
from tasks.serving.client import RetryPolicy
from tasks.serving.launch import launched_servers
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into, prompt_rows, responses

pytestmark = pytest.mark.multiprocess

EOS = 1
# every answer as long as max_new_tokens: the budget test below needs to know the lengths
SAMPLING = request_sampling_params({"max_new_tokens": 24, "temperature": 0.8, "top_p": 0.95, "ignore_eos": True}, [EOS])


IDLE_WITHIN_S = 3 * DISCONNECT_POLL_S + 5  # three of a worker's disconnect polls, and a margin for a loaded machine


def prompts(n: int) -> list[PromptRow]:
    return prompt_rows(n, words=(1, 12))


def test_generate_through_a_real_sglang_router_in_front_of_two_dev_servers(tmp_path, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    url = f"http://127.0.0.1:{free_ports(3)}"
    rows = prompts(100)
    out = tmp_path / "run"

    async def generate(pool, rows, **kw):
        settings = GenerateJob(**{"dataset": "B1", "sampling_params": SAMPLING, "flush_every": 8, **kw})
        return await generate_into(
            out, rows, pool=pool, tokenizer=tokenizer, settings=settings, source="b1.jsonl", vocab_size=len(tokenizer)
        )

    logs = tmp_path / "logs"
    with launched_servers(
        "dev", url, replicas=2, router=True, target=tiny_target_dir, log_dir=logs, health_timeout_s=180
    ) as procs:
        workers = [p.url for p in procs[:2]]
        assert procs[2].url == url and workers == [url[:-5] + str(int(url[-5:]) + i) for i in (1, 2)]
        worker_limit = httpx.get(workers[0] + "/server_info").json()["max_req_input_len"]

        def served() -> list[int]:  # the answers each worker has logged so far
            return [
                sum(" /generate " in line for line in (logs / f"server-{i}.log").read_text().splitlines())
                for i in (0, 1)
            ]

        async def go():
            retry = RetryPolicy(initial_s=0.05, max_s=0.5, outage_window_s=60)
            async with ServerPool([url], max_concurrency=48, retry=retry) as pool:
                # 1-token answers first: the budget's length estimate is then far too low for the second
                # run, which sends 48 requests at once; the two dev servers decode 16 each in lockstep,
                # so 16 still wait when the first answers cross the budget: those must be stopped
                await generate(pool, rows[:20], sampling_params={**SAMPLING, "max_new_tokens": 1})
                before_the_budget = served()
                # 96-token answers: the 16 waiting ones need 96 more decode steps, time enough to be stopped (at 24
                # a CI run once saw all 48 finish before the stop reached them)
                budgeted = await generate(
                    pool, rows[:80], token_budget=20 + 120, sampling_params={**SAMPLING, "max_new_tokens": 96}
                )
                after_the_budget = served()
                rest = await generate(pool, rows)
                return budgeted, rest, pool.servers[0], before_the_budget, after_the_budget

        budgeted, rest, server, before_the_budget, after_the_budget = asyncio.run(go())
        at_the_end = served()

        def loads() -> list[dict[str, int]]:
            return [
                {k: httpx.get(w + "/v1/loads").json()["loads"][0][k] for k in ("num_running_reqs", "num_waiting_reqs")}
                for w in workers
            ]

        # a worker notices a closed request only on its disconnect poll (SGLang's 4 s,
        # emulators/sglang_protocol/disconnect.py): a request the pipeline closed in the last seconds (a retry the
        # router sent to both workers under load: a CI run saw 8 still running on each) is stopped by the next poll,
        # or it never is
        idle, deadline = loads(), time.monotonic() + IDLE_WITHIN_S
        while idle != [{"num_running_reqs": 0, "num_waiting_reqs": 0}] * 2 and time.monotonic() < deadline:
            time.sleep(0.2)
            idle = loads()

    assert server.router and server.max_input == worker_limit  # the limit came from the workers
    assert budgeted.status == "budget reached" and budgeted.aborted >= 1
    assert not server.client.can_abort  # the router has no /abort_request: the requests were closed instead
    assert idle == [{"num_running_reqs": 0, "num_waiting_reqs": 0}] * 2  # nothing left generating
    got = responses(out)
    assert sorted(r["id"] for r in got) == sorted(r.id for r in rows)  # every prompt once, across the three runs
    assert rest.status == "complete"
    # the pipeline gave the router --policy round_robin: its default, cache_aware, sent all 100 to one worker in a
    # CI run (one chat template, one prefix). How evenly round_robin spreads is the router's own business: under
    # load it skips a worker whose health check is late (a CI run saw 0 and 20, then 8 and 56), so the test asks
    # only that both workers served
    router = procs[2].command
    assert router[router.index("--policy") + 1] == "round_robin"
    assert sum(before_the_budget) == 20, before_the_budget  # 1-token answers: none is stopped
    assert min(at_the_end) >= 1 and sum(at_the_end) >= 100, (before_the_budget, after_the_budget, at_the_end)
