"""The generate stage against servers that behave as SGLang 0.5.23 does (emulators/sim/, sglang_version 0.5).

Each test is one of SGLang's rules that the client used to get wrong, on data: what is recorded,
what is refused, which requests an abort reaches, which servers are marked down.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from pathlib import Path

from emulators.sim import SimServer, simulate_output
from tasks.generate.prompts import chat_prompt_ids, request_sampling_params
from tasks.responses.rejects import read_rejects
from tasks.serving.client import RetryPolicy
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into, generate_job, responses
from tests.generate_runs import prompt_rows as prompts
from tests.tasks.budget_runs import budget_run_after_short_answers, prompts_from

EOS = 1
MAX_NEW = 48
SAMPLING = request_sampling_params({"max_new_tokens": MAX_NEW, "temperature": 0.7, "top_p": 0.95}, [EOS])
FAST = RetryPolicy(initial_s=0.01, max_s=0.05, jitter=0.0, outage_window_s=20)
POLL_S = 0.5  # the servers' disconnect poll (SGLang: SGLANG_REQUEST_STATE_WAIT_TIMEOUT, ~4 s), short for tests


def sim(**kw) -> SimServer:
    base = dict(
        max_running=4,
        decode_s_per_token=0.002,
        mean_len=16,
        vocab_size=2048,
        eos_token_id=EOS,
        sglang_version="0.5",
        disconnect_poll_s=POLL_S,
        seed=0,
    )
    return SimServer(**{**base, **kw}).start()


async def generate(pool: ServerPool, rows, run_dir: Path, tokenizer, dataset: str = "B1", **kw):
    settings = generate_job(SAMPLING, dataset, **kw)
    return await generate_into(
        run_dir, rows, pool=pool, tokenizer=tokenizer, settings=settings, source=f"{dataset}.jsonl"
    )


def budget_run(server: SimServer, rows, run_dir: Path, tokenizer, token_budget: int, seen, **kw):
    """`budget_run_after_short_answers` at `server` through this module's `generate`: 12 at once, FAST retries."""
    kw.update(token_budget=token_budget, seen=seen, max_concurrency=12, retry=FAST)
    return budget_run_after_short_answers(generate, [server.url], rows, run_dir, tokenizer, SAMPLING, **kw)


def first_can_abort(pool: ServerPool) -> bool:
    """Whether the client of the pool's first server still sends /abort_request."""
    return pool.servers[0].client.can_abort


def down_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if " is down (" in r.getMessage()]


def test_a_budget_reached_while_requests_are_queued_aborts_them_cleanly(tmp_path, tokenizer, caplog):
    """SGLang 0.5.23 answers a request aborted while QUEUED with no prompt_tokens (tokenizer_manager _handle_abort_req).

    Before: every such answer was an InvalidReply, the server was marked down and the prompt sent again.
    """
    server = sim(max_running=1, decode_s_per_token=0.004, mean_len=30, length_dist="fixed")
    rows = prompts(80)
    server.hold_if(prompts_from(tokenizer, rows, 20 + 6))  # queued until stopped, however late the answers are read
    try:
        # the length estimate is so low that the budgeted run sends 12 at once: 1 runs at a time, the 4th answer
        # reaches the budget, and 6 are still held in the server's queue then
        with caplog.at_level(logging.INFO):
            report, invalid = budget_run(
                server, rows, tmp_path, tokenizer, 20 * 4 + 100, lambda pool: pool.invalid_replies
            )
        stats = server.snapshot()
    finally:
        server.stop()
    got = responses(tmp_path)
    assert report.status == "budget reached" and report.aborted >= 5 and stats.queued_aborts >= 2
    assert invalid == {} and down_logs(caplog) == []  # the queued aborts were taken for what they are
    assert len({r["id"] for r in got}) == len(got)  # each prompt at most once
    assert report.completion_tokens <= 20 * 4 + 100 + 2 * MAX_NEW


def test_a_request_re_sent_while_the_server_still_holds_its_rid_is_not_refused(tmp_path, tokenizer, caplog):
    """SGLang refuses a rid it still holds (400 "Duplicate request ID detected", tokenizer_manager.py), and holds a
    request whose client went away until its disconnect poll notices.

    Before: a dropped connection's prompt was re-sent with the same rid within the poll, refused, and recorded as a
    `refused` reject (skipped by every later run); the server was also marked down for the dropped connection.
    """
    server = sim(decode_s_per_token=0.001)
    server.drop_fraction(0.2, seed=3)
    rows = prompts(40)
    try:

        async def go():
            async with ServerPool([server.url], max_concurrency=8, retry=FAST) as pool:
                return await generate(pool, rows, tmp_path, tokenizer)

        with caplog.at_level(logging.INFO):
            report = asyncio.run(go())
        stats = server.snapshot()
    finally:
        server.stop()
    got = responses(tmp_path)
    assert stats.dropped_connections >= 3  # the fault really happened
    assert stats.duplicate_rids == 0 and read_rejects(tmp_path / "rejects/B1") == []
    assert sorted(r["id"] for r in got) == sorted(r.id for r in rows) and report.new_responses == len(rows)
    for r in got:  # the server's exact answer, once
        row = next(x for x in rows if x.id == r["id"])
        assert (
            r["output_ids"]
            == simulate_output(chat_prompt_ids(tokenizer, row.messages), SAMPLING, server.config).output_ids
        )
    assert down_logs(caplog) == []  # one dropped connection is not a dead server
    resent = [r.getMessage() for r in caplog.records if "sending again with a new rid" in r.getMessage()]
    assert len(resent) >= stats.dropped_connections  # the log says why each re-send happened


def test_an_abort_reaches_only_the_request_it_names(tokenizer):
    """/abort_request aborts every rid that STARTS WITH the given one (scheduler.py abort_request).

    Before: aborting request B1:p1 (a timeout, a failure) also aborted B1:p10, B1:p11, ... at that server.
    """
    server = sim(decode_s_per_token=0.01, mean_len=400, length_dist="fixed", max_running=8)
    params = {**SAMPLING, "max_new_tokens": 200}
    keys = ["B1:p1", "B1:p10", "B1:p11", "B1:p12"]
    try:

        async def go():
            async with ServerPool([server.url], max_concurrency=8, retry=FAST) as pool:
                await pool.start()
                leases = [await pool.reserve(3) for _ in keys]
                tasks = [
                    asyncio.create_task(pool.generate(lease, [5, 6, 7 + i], params, key))
                    for i, (lease, key) in enumerate(zip(leases, keys))
                ]
                await asyncio.to_thread(server.wait_for, lambda s: s.running == len(keys), 10)
                assert await pool.abort("B1:p1")
                return [t.finish_reason for t in await asyncio.gather(*tasks)]

        finishes = asyncio.run(go())
        stats = server.snapshot()
    finally:
        server.stop()
    assert finishes == ["abort", "length", "length", "length"]
    assert stats.aborted_by_request == 1


def test_an_abort_the_admin_key_guards_falls_back_to_closing_the_request(tmp_path, tokenizer, caplog):
    """With --admin-api-key, /abort_request takes only the admin key (http_server.py ADMIN_OPTIONAL, utils/auth.py).

    Before: the 401 was taken for "aborted"; requests stopped at the budget kept running to their end.
    """
    # 4 run at once (48 tokens each), so of 12 sent, 8 are held in the server's queue when the first 4 reach the
    # budget (hold_if: however late the answers are read)
    server = sim(
        max_running=4,
        decode_s_per_token=0.005,
        mean_len=48,
        length_dist="fixed",
        api_key="user-key",
        admin_api_key="admin-key",
    )
    rows = prompts(40)
    server.hold_if(prompts_from(tokenizer, rows, 20 + 4))
    try:
        # the budgeted run sends 12 at once: those still queued when its budget is reached must be stopped
        with caplog.at_level(logging.INFO):
            report, can_abort = budget_run(
                server, rows, tmp_path, tokenizer, 20 * 4 + 150, first_can_abort, api_key="user-key"
            )
        stats = server.wait_for(lambda s: s.in_flight == 0, timeout=10 + 4 * POLL_S)
    finally:
        server.stop()
    assert report.status == "budget reached" and not can_abort
    assert stats.auth_refused >= 1 and stats.aborted_by_request == 0  # refused (the aborts sent at once, together)
    assert stats.aborted_by_disconnect >= 8  # the server stopped the 8 held ones (they did not run to their end)
    assert report.completion_tokens <= 20 * 4 + 150 + 2 * MAX_NEW
    said = [r.getMessage() for r in caplog.records if "abort_request refused our key" in r.getMessage()]
    assert len(said) == 1 and "admin-key" not in said[0] and "user-key" not in said[0]  # once, and no key in the log


def test_a_prompt_the_server_keeps_aborting_becomes_a_named_reject_tried_again_next_run(tmp_path, tokenizer):
    """A request the server aborts on its own is sent again max_requeues times, then it is a reject `aborted`.

    Before: it was dropped silently and the dataset reported "complete" with the prompt missing.
    """
    rows = prompts(12)
    doomed = chat_prompt_ids(tokenizer, rows[5].messages)
    server = sim()
    server.abort_if(lambda ids: ids == doomed)
    try:

        async def go():
            async with ServerPool([server.url], max_concurrency=4, retry=FAST) as pool:
                first = await generate(pool, rows, tmp_path, tokenizer, max_requeues=2)
                server.abort_if(None)  # the cause is gone (a server restarted, an operator stopped aborting)
                second = await generate(pool, rows, tmp_path, tokenizer, max_requeues=2)
                return first, second

        first, second = asyncio.run(go())
        aborted = server.snapshot().aborted
    finally:
        server.stop()
    assert first.new_rejects == 1 and first.reject_causes == {"aborted": 1} and first.new_responses == 11
    assert aborted == 3  # sent 1 + max_requeues times
    assert second.new_responses == 1 and second.reject_causes == {}
    assert sorted(r["id"] for r in responses(tmp_path)) == sorted(r.id for r in rows)


def test_drill_budget_kill_and_dropped_connections_on_a_pool_of_two(tmp_path, tokenizer, caplog):
    """The issue's drill: two 0.5.x servers, 5% of connections dropped, one server killed mid-run, a dataset whose
    budget is reached while requests are queued, and one that must finish: every prompt exactly once, none refused,
    the budget held, and only the killed server marked down."""
    servers = [sim(max_running=3, decode_s_per_token=0.003, mean_len=24) for _ in range(2)]
    for i, s in enumerate(servers):
        s.drop_fraction(0.05, seed=10 + i)
    victim, survivor = servers
    budgeted, whole = prompts(150, "a"), prompts(200, "b")
    try:

        async def go():
            async with ServerPool([s.url for s in servers], max_concurrency=10, retry=FAST) as pool:

                async def kill():
                    await asyncio.to_thread(victim.wait_for, lambda s: s.completed >= 40 and s.in_flight >= 3, 30)
                    await asyncio.to_thread(victim.down)

                killer = asyncio.create_task(kill())
                reports = await asyncio.gather(
                    generate(pool, budgeted, tmp_path, tokenizer, "A", token_budget=1500),
                    generate(pool, whole, tmp_path, tokenizer, "B"),
                )
                await killer
                return reports, pool.rows(), pool.invalid_replies

        with caplog.at_level(logging.INFO):
            (a, b), rows, invalid = asyncio.run(go())
        stats = [s.snapshot() for s in servers]
    finally:
        for s in servers:
            s.stop()
    got_a, got_b = responses(tmp_path, "A"), responses(tmp_path, "B")
    assert sum(s.dropped_connections for s in stats) >= 5 and stats[0].aborted >= 1  # the faults happened
    # every prompt of B exactly once; A's at most once; none refused or otherwise rejected
    assert Counter(r["id"] for r in got_b) == Counter(r.id for r in whole) and b.status == "complete"
    assert len({r["id"] for r in got_a}) == len(got_a) and a.status == "budget reached"
    assert a.reject_causes == b.reject_causes == {} and sum(s.duplicate_rids for s in stats) == 0
    assert a.completion_tokens <= 1500 + 2 * MAX_NEW
    assert invalid == {}
    # only the killed server went down; the survivor answered its health probes
    assert [r["state"] for r in rows] == ["down", "healthy"]
    downs = down_logs(caplog)
    assert downs and all(victim.url in m for m in downs)
    resent = [r.getMessage() for r in caplog.records if "sending again with a new rid" in r.getMessage()]
    assert len(resent) >= sum(s.dropped_connections for s in stats)  # each re-send says why
