"""The generate loop against a simulated SGLang server on a real loopback socket, with faults."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest

from emulators.sim import SimConfig, SimServer, simulate_output
from models.common.jobs import GenerateJob
from tasks.datasets import PromptRow
from tasks.generate.prompts import chat_prompt_ids, request_sampling_params
from tasks.responses.checkpoints import done_ids, live_parts, summarize
from tasks.serving.client import RetryPolicy
from tasks.serving.errors import ServerOutage
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into, generate_job, prompt_rows, responses

REPO = Path(__file__).resolve().parents[3]
EOS = 1  # <|im_end|> of the tiny target; also the sim server's eos
SAMPLING = request_sampling_params({"max_new_tokens": 64, "temperature": 0.7, "top_p": 0.95}, [EOS])


def prompts(n: int, prefix: str = "p") -> list[PromptRow]:
    return prompt_rows(n, prefix, words=(1, 30), question="question {i}: ")


def settings(**kw) -> GenerateJob:
    return generate_job(SAMPLING, **kw)


def run(
    server: SimServer,
    rows,
    run_dir: Path,
    *,
    slots: int = 8,
    retry: RetryPolicy | None = None,
    timeout: float = 30.0,
    tokenizer,
    **kw,
):
    async def go():
        retry_policy = retry or RetryPolicy(initial_s=0.01, max_s=0.1, outage_window_s=10)
        async with ServerPool(
            [server.url], max_concurrency=slots, request_timeout_s=timeout, retry=retry_policy
        ) as pool:
            return await generate_into(
                run_dir, rows, pool=pool, tokenizer=tokenizer, settings=settings(**kw), source="b1.jsonl"
            )

    return asyncio.run(go())


def run_with_fault(server: SimServer, rows, run_dir: Path, *, tokenizer, retry: RetryPolicy, after: int, fault):
    """A run over 2 slots during which `await fault()` strikes, once the server has completed `after` requests."""

    async def go():
        async with ServerPool([server.url], max_concurrency=2, retry=retry) as pool:

            async def strike():
                await asyncio.to_thread(server.wait_for, lambda s: s.completed >= after, 20)
                await fault()

            striker = asyncio.create_task(strike())
            try:
                return await generate_into(run_dir, rows, pool=pool, tokenizer=tokenizer, settings=settings())
            finally:
                await striker

    return asyncio.run(go())


def expected_output(tokenizer, row: PromptRow, config: SimConfig):
    return simulate_output(chat_prompt_ids(tokenizer, row.messages), SAMPLING, config)


@pytest.fixture
def server():
    with SimServer(max_running=4, decode_s_per_token=0.0005, mean_len=20, vocab_size=2048, eos_token_id=EOS) as srv:
        yield srv


def test_every_prompt_once_with_the_servers_exact_output(server, tmp_path, tokenizer):
    rows = prompts(40)
    report = run(server, rows, tmp_path, tokenizer=tokenizer)
    got = {r["id"]: r for r in responses(tmp_path)}
    assert sorted(got) == sorted(r.id for r in rows)
    assert report.status == "complete" and report.new_responses == 40 and report.rejects == 0
    for row in rows:
        want = expected_output(tokenizer, row, server.config)
        assert got[row.id]["output_ids"] == want.output_ids
        assert got[row.id]["prompt_ids"] == chat_prompt_ids(tokenizer, row.messages)
        assert got[row.id]["finish_reason"] == want.finish_reason["type"]
    assert report.completion_tokens == sum(len(r["output_ids"]) for r in got.values())
    assert len(live_parts(tmp_path / "responses/B1")) >= 40 // 8  # flushed every 8 responses


def test_in_flight_never_exceeds_the_shared_limit_across_datasets(tmp_path, tokenizer):
    with SimServer(max_running=64, decode_s_per_token=0.002, mean_len=20, vocab_size=2048) as srv:

        async def go():
            async with ServerPool([srv.url], max_concurrency=5) as pool:  # one server, one limit, two datasets
                return await asyncio.gather(
                    *(
                        generate_into(
                            tmp_path,
                            prompts(30, prefix=name),
                            pool=pool,
                            tokenizer=tokenizer,
                            settings=settings(dataset=name),
                        )
                        for name in ("B1", "B2")
                    )
                )

        reports = asyncio.run(go())
        stats = srv.snapshot()
    assert [r.new_responses for r in reports] == [30, 30]
    assert stats.max_in_flight == 5  # saturated, and never above the limit


def test_503_bursts_and_dropped_connections_are_retried(server, tmp_path, tokenizer):
    rows = prompts(20)
    server.fail_next(6, status=503)
    server.drop_next(3)
    report = run(server, rows, tmp_path, tokenizer=tokenizer)
    stats = server.snapshot()
    assert stats.injected_errors == 6 and stats.dropped_connections == 3
    assert report.new_responses == 20
    got = {r["id"]: r["output_ids"] for r in responses(tmp_path)}
    assert all(got[row.id] == expected_output(tokenizer, row, server.config).output_ids for row in rows)


def test_429_from_a_router_is_retried(server, tmp_path, tokenizer):
    server.fail_next(4, status=429)
    assert run(server, prompts(5), tmp_path, tokenizer=tokenizer).new_responses == 5


def test_a_400_is_never_retried_and_goes_to_rejects(server, tmp_path, tokenizer):
    rows = prompts(12)
    bad = {chat_prompt_ids(tokenizer, rows[i].messages)[-6] for i in (2, 7)}  # a token only those prompts have
    server.reject_if(lambda ids: "poisoned prompt" if any(ids[-6] == b for b in bad) and len(ids) > 6 else None)
    report = run(server, rows, tmp_path, tokenizer=tokenizer)
    rejected = pq.read_table(live_parts(tmp_path / "rejects/B1")[0]).to_pylist()
    assert report.new_rejects == len(rejected) == server.snapshot().rejected  # one request each: no retry
    assert {r["id"] for r in rejected} >= {"p2", "p7"}
    assert all("HTTP 400" in r["reason"] and "poisoned prompt" in r["reason"] for r in rejected)
    assert done_ids(tmp_path / "responses/B1").isdisjoint(r["id"] for r in rejected)
    # a resume neither retries the rejects nor repeats the rest
    again = run(server, rows, tmp_path, tokenizer=tokenizer)
    assert again.new_responses == 0 and again.new_rejects == 0


def test_over_long_prompts_are_rejected_before_sending(tmp_path, tokenizer):
    rows = prompts(6) + [PromptRow(id="long", messages=[{"role": "user", "content": "word " * 400}])]
    with SimServer(max_running=4, decode_s_per_token=0.0005, mean_len=10, context_length=200, vocab_size=2048) as srv:
        report = run(srv, rows, tmp_path, tokenizer=tokenizer, sampling_params={**SAMPLING, "max_new_tokens": 16})
        assert srv.snapshot().sequences == 6  # the long one never reached the server
    (reject,) = pq.read_table(live_parts(tmp_path / "rejects/B1")[0]).to_pylist()
    assert reject["id"] == "long" and "max_req_input_len" in reject["reason"]
    assert report.new_responses == 6


def test_budget_stops_within_one_response_and_aborts_in_flight(tmp_path, tokenizer):
    rows = prompts(300)
    with SimServer(max_running=16, decode_s_per_token=0.001, mean_len=30, vocab_size=2048, eos_token_id=EOS) as srv:
        report = run(srv, rows, tmp_path, tokenizer=tokenizer, slots=16, token_budget=2000)
        stats = srv.snapshot()
    spent = summarize(tmp_path / "responses/B1").completion_tokens
    assert report.status == "budget reached"
    # past the budget by the crossing response, plus any that had already finished on the server
    # when the abort arrived (kept: those tokens are spent either way)
    assert 2000 <= spent <= 2000 + 3 * 64
    assert report.completion_tokens == spent
    assert stats.aborted == report.aborted  # aborted requests are not recorded...
    assert report.wasted_tokens == stats.aborted_tokens
    ids = [r["id"] for r in responses(tmp_path)]
    assert len(ids) == len(set(ids)) < 300

    # raising the budget continues where it stopped, never repeating a prompt
    with SimServer(max_running=16, decode_s_per_token=0.001, mean_len=30, vocab_size=2048, eos_token_id=EOS) as srv:
        more = run(srv, rows, tmp_path, tokenizer=tokenizer, slots=16, token_budget=4000)
    ids = [r["id"] for r in responses(tmp_path)]
    assert len(ids) == len(set(ids)) and more.new_responses > 0
    assert 4000 <= summarize(tmp_path / "responses/B1").completion_tokens <= 4000 + 3 * 64


def test_max_prompts_caps_the_dataset(server, tmp_path, tokenizer):
    report = run(server, prompts(30), tmp_path, tokenizer=tokenizer, max_prompts=7)
    assert sorted(r["id"] for r in responses(tmp_path)) == sorted(f"p{i}" for i in range(7))
    assert report.responses == 7


def test_outage_fails_cleanly_keeps_work_and_resumes(server, tmp_path, tokenizer):
    rows = prompts(30)
    server.config  # noqa: B018
    done_first = 10
    retry = RetryPolicy(initial_s=0.01, max_s=0.05, outage_window_s=0.5)
    with pytest.raises(ServerOutage):
        run_with_fault(
            server,
            rows,
            tmp_path,
            tokenizer=tokenizer,
            retry=retry,
            after=done_first,
            fault=lambda: asyncio.to_thread(server.down),
        )
    kept = {r["id"] for r in responses(tmp_path)}
    # what finished before the outage was flushed on the way out; the server counts a request done just before
    # its answer goes out, so the (2-slot) cut may still drop the last two answers on the wire
    assert len(kept) >= done_first - 2
    server.up()
    report = run(server, rows, tmp_path, tokenizer=tokenizer)
    ids = [r["id"] for r in responses(tmp_path)]
    assert sorted(ids) == sorted(r.id for r in rows)  # complete, and nobody twice
    assert report.new_responses == 30 - len(kept)


def test_slow_server_times_out_and_the_request_is_aborted(server, tmp_path, tokenizer):
    server.slow(5.0)
    retry = RetryPolicy(initial_s=0.01, max_s=0.05, outage_window_s=0.6)
    with pytest.raises(ServerOutage, match="ReadTimeout"):
        run(server, prompts(2), tmp_path, tokenizer=tokenizer, timeout=0.2, retry=retry)
    server.wait_for(lambda s: s.aborted >= 2, timeout=10)  # timed-out requests were not left running


def test_server_side_abort_is_sent_again(server, tmp_path, tokenizer):
    rows = prompts(12)
    server.slow(0.3)

    async def go():
        async with ServerPool([server.url], max_concurrency=4) as pool:

            async def abort_some():
                await asyncio.to_thread(server.wait_for, lambda s: s.in_flight >= 4, 10)
                await asyncio.to_thread(server.abort_all)  # e.g. the server drained its queue
                server.slow(0)

            killer = asyncio.create_task(abort_some())
            report = await generate_into(tmp_path, rows, pool=pool, tokenizer=tokenizer, settings=settings())
            await killer
            return report

    report = asyncio.run(go())
    assert report.aborted >= 4
    assert sorted(r["id"] for r in responses(tmp_path)) == sorted(r.id for r in rows)


@pytest.mark.multiprocess
@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_equals_a_clean_run(tmp_path, tiny_target_dir, tokenizer):
    rows = prompts(60)
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"id": r.id, "messages": r.messages}) + "\n" for r in rows))
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with SimServer(max_running=6, decode_s_per_token=0.002, mean_len=25, vocab_size=2048, eos_token_id=EOS) as srv:
        job = GenerateJob(dataset="B1", sampling_params=SAMPLING, flush_every=3, flush_interval_s=0.2)
        args = [
            sys.executable,
            str(REPO / "tests" / "generate_runner.py"),
            srv.url,
            str(tiny_target_dir),
            str(tmp_path / "run"),
            str(prompts_file),
            job.model_dump_json(),
            "6",
        ]
        kills = 0
        for _ in range(3):
            before = srv.snapshot().completed
            proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
            target = before + rng.randint(3, 12)  # a random moment: after this many more answers
            try:
                srv.wait_for(
                    lambda s, target=target, proc=proc: s.completed >= target or proc.poll() is not None, timeout=60
                )
            finally:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
                    kills += 1
                proc.wait()
        final = subprocess.run(args, env=env, capture_output=True, text=True, timeout=120)
        assert final.returncode == 0, final.stderr[-2000:]
        assert "DONE" in final.stdout
    assert kills >= 2
    got = responses(tmp_path / "run")
    ids = [r["id"] for r in got]
    assert sorted(ids) == sorted(r.id for r in rows)  # every prompt exactly once
    by_id = {r["id"]: r for r in got}
    for row in rows:  # and the same answers as a clean run against this deterministic server
        want = expected_output(tokenizer, row, srv.config)
        assert by_id[row.id]["output_ids"] == want.output_ids
        assert by_id[row.id]["completion_tokens"] == len(want.output_ids)
    assert summarize(tmp_path / "run/responses/B1").completion_tokens == sum(len(r["output_ids"]) for r in got)


def test_cancellation_aborts_in_flight_requests_and_keeps_what_finished(tmp_path, tokenizer):
    with SimServer(max_running=4, decode_s_per_token=0.01, mean_len=20, vocab_size=2048, eos_token_id=EOS) as srv:

        async def go():
            async with ServerPool([srv.url], max_concurrency=4) as pool:
                task = asyncio.create_task(
                    generate_into(tmp_path, prompts(40), pool=pool, tokenizer=tokenizer, settings=settings())
                )
                await asyncio.to_thread(srv.wait_for, lambda s: s.completed >= 8 and s.running >= 2, 20)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task

        asyncio.run(go())
        stats = srv.wait_for(lambda s: s.in_flight == 0, timeout=10)  # nothing left running on the server
        assert stats.aborted >= 1
    kept = responses(tmp_path)
    # the server counts a request done just before its answer goes out: with 4 slots, up to 4 answers
    # can still be on the wire when the cancellation lands (on a loaded machine this happens)
    assert len(kept) >= 8 - 4 and len({r["id"] for r in kept}) == len(kept)


# -- faults that must stop the run, and rejects that must come back (issue 11) --------------------


def test_a_401_mid_run_stops_without_rejecting_anything_and_a_rerun_finishes(server, tmp_path, tokenizer):
    from tasks.serving.errors import AuthError

    rows = prompts(30)

    async def rotate_key():
        server.fail_next(10_000, status=401, message="Invalid API key")

    retry = RetryPolicy(initial_s=0.01, max_s=0.05, outage_window_s=10)
    with pytest.raises(AuthError, match="HTTP 401 .*Invalid API key.*Nothing was rejected"):
        run_with_fault(server, rows, tmp_path, tokenizer=tokenizer, retry=retry, after=8, fault=rotate_key)
    assert not (tmp_path / "rejects/B1").exists() or not live_parts(tmp_path / "rejects/B1")
    refused = server.snapshot().injected_errors
    assert 1 <= refused <= 2  # the first 401 stopped the run: at most the other in-flight slot also got one
    kept = {r["id"] for r in responses(tmp_path)}
    assert len(kept) >= 8

    server.clear_faults()
    report = run(server, rows, tmp_path, tokenizer=tokenizer)
    assert sorted(r["id"] for r in responses(tmp_path)) == sorted(r.id for r in rows)
    assert report.new_responses == 30 - len(kept) and report.rejects == 0


class LyingTransport(httpx.AsyncHTTPTransport):
    """Forwards to the real (simulated) server, then rewrites the first `n` /generate replies with `lie`."""

    def __init__(self, n: int, lie):
        super().__init__()
        self.left, self.lie = n, lie

    async def handle_async_request(self, request):
        response = await super().handle_async_request(request)
        if request.url.path != "/generate" or self.left <= 0 or response.status_code != 200:
            return response
        self.left -= 1
        body = json.loads(await response.aread())
        self.lie(body)
        return httpx.Response(200, json=body)


def test_replies_with_impossible_counts_are_never_recorded(server, tmp_path, tokenizer):
    def lie(body):
        body["meta_info"]["completion_tokens"] = -5 if body["meta_info"]["completion_tokens"] % 2 else 1000

    rows = prompts(20)

    async def go():
        transport = LyingTransport(6, lie)
        retry = RetryPolicy(initial_s=0.01, max_s=0.05, outage_window_s=30)
        async with ServerPool([server.url], max_concurrency=4, retry=retry, transport=transport) as pool:
            report = await generate_into(tmp_path, rows, pool=pool, tokenizer=tokenizer, settings=settings())
            return report, pool.invalid_replies

    report, invalid = asyncio.run(go())
    assert invalid == {"completion_tokens": 6}
    got = responses(tmp_path)
    assert sorted(r["id"] for r in got) == sorted(r.id for r in rows) and report.rejects == 0
    assert all(r["completion_tokens"] == len(r["output_ids"]) > 0 for r in got)
    assert report.completion_tokens == sum(len(r["output_ids"]) for r in got)


def test_a_failed_checkpoint_write_stops_the_run_at_once_and_a_rerun_finishes(server, tmp_path, tokenizer, monkeypatch):
    import errno

    from models.common.file_errors import WriteFailed
    from tasks.responses import checkpoints

    rows = prompts(60)
    real_write = checkpoints.write_part
    written = []

    def write_part(directory, table, **kw):
        if len(written) >= 2:  # the disk fills after two parts
            raise OSError(errno.ENOSPC, "No space left on device")
        written.append(table.num_rows)
        return real_write(directory, table, **kw)

    monkeypatch.setattr(checkpoints, "write_part", write_part)
    with pytest.raises(WriteFailed) as caught:
        run(server, rows, tmp_path, tokenizer=tokenizer, slots=4, flush_every=5, flush_interval_s=30)
    served = server.snapshot().completed
    text = str(caught.value)
    assert f"cannot write {tmp_path / 'responses/B1'}: disk full:" in text and "bytes free on" in text
    assert "kept: 10 responses of B1" in text and "to resume: free space" in text
    assert len(responses(tmp_path)) == 10 and written == [5, 5]  # both parts whole and readable
    # the stop is immediate: lost = the unflushed window (5) + what was in flight (4), nothing sent after
    assert served - 10 <= 5 + 4

    monkeypatch.setattr(checkpoints, "write_part", real_write)
    run(server, rows, tmp_path, tokenizer=tokenizer)
    ids = [r["id"] for r in responses(tmp_path)]
    assert sorted(ids) == sorted(r.id for r in rows)  # every prompt exactly once


def test_a_damaged_part_stops_generate_before_sending_and_names_the_file(server, tmp_path, tokenizer):
    from tasks.responses.parquet_io import DamagedPart

    rows = prompts(20)
    run(server, rows[:10], tmp_path, tokenizer=tokenizer, flush_every=5)
    part = live_parts(tmp_path / "responses/B1")[0]
    part.write_bytes(part.read_bytes()[: part.stat().st_size // 2])  # a partial copy
    sent = server.snapshot().requests
    with pytest.raises(DamagedPart) as caught:
        run(server, rows, tmp_path, tokenizer=tokenizer)
    assert server.snapshot().requests == sent  # nothing was sent
    text = str(caught.value)
    assert str(part) in text and "not a readable Parquet file" in text and "Nothing was sent" in text
    quarantine = tmp_path / "quarantine/responses/B1"
    assert f"mkdir -p {quarantine} && mv {part} {quarantine}/" in text

    quarantine.mkdir(parents=True)
    part.rename(quarantine / part.name)
    run(server, rows, tmp_path, tokenizer=tokenizer)
    ids = [r["id"] for r in responses(tmp_path)]
    assert sorted(ids) == sorted(r.id for r in rows)  # the quarantined part's prompts again, once


def test_too_long_rejects_come_back_when_the_context_grows(tmp_path, tokenizer):
    rows = prompts(6) + [PromptRow(id="long", messages=[{"role": "user", "content": "word " * 400}])]
    small = dict(max_running=4, decode_s_per_token=0.0005, mean_len=10, vocab_size=2048, eos_token_id=EOS)
    params = {**SAMPLING, "max_new_tokens": 16}
    with SimServer(context_length=200, **small) as srv:
        first = run(srv, rows, tmp_path, tokenizer=tokenizer, sampling_params=params)
        again = run(srv, rows, tmp_path, tokenizer=tokenizer, sampling_params=params)
    assert first.new_rejects == 1 and again.new_rejects == 1 and again.new_responses == 0
    (reject,) = [r for p in live_parts(tmp_path / "rejects/B1") for r in pq.read_table(p).to_pylist()]
    assert reject["id"] == "long" and reject["cause"] == "too_long"  # checked again, still one reject
    with SimServer(context_length=4096, **small) as srv:
        grown = run(srv, rows, tmp_path, tokenizer=tokenizer, sampling_params=params)
    assert grown.new_responses == 1 and grown.rejects == 0
    assert sorted(r["id"] for r in responses(tmp_path)) == sorted(r.id for r in rows)
    assert not live_parts(tmp_path / "rejects/B1")


def test_server_refusals_stay_skipped_unless_retry_rejects(server, tmp_path, tokenizer):
    rows = prompts(10)
    poisoned = chat_prompt_ids(tokenizer, rows[3].messages)
    server.reject_if(lambda ids: "unsupported content" if ids == poisoned else None)
    run(server, rows, tmp_path, tokenizer=tokenizer)
    server.reject_if(None)
    assert run(server, rows, tmp_path, tokenizer=tokenizer).new_responses == 0  # skipped: it would fail again
    report = run(server, rows, tmp_path, tokenizer=tokenizer, retry_rejects=True)
    assert report.new_responses == 1 and report.rejects == 0
    assert sorted(r["id"] for r in responses(tmp_path)) == sorted(r.id for r in rows)
    assert not live_parts(tmp_path / "rejects/B1")
