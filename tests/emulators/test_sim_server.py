"""The simulated SGLang server: pure outputs, the protocol, the capacity model, fault injection."""

from __future__ import annotations

import asyncio
import dataclasses
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from emulators.sim import SimConfig, SimServer, simulate_output
from emulators.sim.__main__ import length_rules
from emulators.sim.config import LengthRule
from tests.emulators.sglang_shapes import FINISHED_META

PROMPT = [101, 102, 103, 104]


@pytest.fixture
def make_server():
    """Start SimServers in background threads; all are stopped at the end of the test."""
    servers: list[SimServer] = []

    def make(**kw) -> SimServer:
        kw.setdefault("decode_s_per_token", 0.001)
        srv = SimServer(**kw).start()
        servers.append(srv)
        return srv

    yield make
    for srv in servers:
        srv.stop()


async def poll(condition, timeout: float = 5.0) -> None:
    """Bounded polling from async test code (the server runs on its own thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.005)


# -- the pure function -------------------------------------------------------------------------


def test_outputs_are_a_pure_function_of_prompt_and_params():
    cfg = SimConfig()
    params = {"max_new_tokens": 1000, "temperature": 0.6, "top_p": 0.95}
    a, b = simulate_output(PROMPT, params, cfg), simulate_output(list(PROMPT), dict(params), cfg)
    assert a == b and a.output_ids
    assert simulate_output([101, 102, 103, 105], params, cfg).output_ids != a.output_ids
    assert simulate_output(PROMPT, params, SimConfig(seed=1)).output_ids != a.output_ids
    assert simulate_output(PROMPT, {**params, "sampling_seed": 7}, cfg).output_ids != a.output_ids
    assert simulate_output(PROMPT, {**params, "temperature": 0.7}, cfg).output_ids != a.output_ids
    # Greedy does not sample: the seed does not matter.
    greedy = {"max_new_tokens": 1000, "temperature": 0}
    assert simulate_output(PROMPT, {**greedy, "sampling_seed": 1}, cfg) == simulate_output(PROMPT, greedy, cfg)


def test_length_distribution_has_the_configured_mean_and_a_long_tail():
    cfg = SimConfig(mean_len=200, sigma=1.0, context_length=1_000_000)
    params = {"max_new_tokens": 100_000}
    lengths = [len(simulate_output([i, i + 1, 7], params, cfg).output_ids) for i in range(2000)]
    mean = statistics.fmean(lengths)
    assert 180 <= mean <= 220, mean
    assert statistics.median(lengths) < 0.8 * mean  # lognormal: the median sits well below the mean
    assert max(lengths) > 4 * mean and min(lengths) >= 1

    fixed = SimConfig(length_dist="fixed", mean_len=37)
    assert {len(simulate_output([i], {"max_new_tokens": 100}, fixed).output_ids) for i in range(20)} == {37}


def test_the_ids_are_the_pinned_stream_of_the_seed():
    """The ids are drawn in bulk (numpy) from 4 little-endian bytes per token; these values were written by the
    per-token loop that came before, so a resumed benchmark sees the same answers as before the change."""
    greedy = {"max_new_tokens": 8, "temperature": 0}
    assert simulate_output(PROMPT, greedy, SimConfig()).output_ids == [
        25065,
        31925,
        20911,
        24654,
        14288,
        27663,
        25162,
        30284,
    ]
    # A stop id inside the id range is kept out of the content (the next id up), and ends the answer.
    tiny = SimConfig(vocab_size=14, length_dist="fixed", mean_len=30)
    with_stop = simulate_output(PROMPT, {"max_new_tokens": 40, "temperature": 0, "stop_token_ids": [12]}, tiny)
    plain = simulate_output(PROMPT, {"max_new_tokens": 40, "temperature": 0}, tiny)
    assert plain.output_ids[:12] == [10, 12, 13, 11, 11, 11, 11, 10, 10, 11, 10, 12] and plain.output_ids[-1] == 1
    assert with_stop.output_ids[:12] == [10, 13, 13, 11, 11, 11, 11, 10, 10, 11, 10, 13]
    assert 12 not in with_stop.output_ids[:-1] and with_stop.output_ids[-1] == 12


def test_a_length_rule_gives_a_datasets_requests_their_own_lengths():
    rules = (LengthRule("B2_code", "lognormal", 3000, 0.5), LengthRule("B7_math", "fixed", 40))
    cfg = SimConfig(mean_len=200, sigma=1.0, context_length=1_000_000, length_rules=rules)
    params = {"max_new_tokens": 100_000}

    def mean(rid):
        return statistics.fmean(len(simulate_output([i, 7], params, cfg, rid).output_ids) for i in range(2000))

    assert 2910 <= mean("x1-B2_code:17") <= 3090
    assert {len(simulate_output([i], params, cfg, f"n-B7_math:{i}").output_ids) for i in range(20)} == {40}
    assert 190 <= mean("x1-B3_other:17") <= 210 and 190 <= mean(None) <= 210  # no rule: the default
    with pytest.raises(ValueError, match="name a dataset twice"):
        SimConfig(length_rules=(LengthRule("B1"), LengthRule("B1")))
    with pytest.raises(ValueError, match="length rule 'B1': length_dist must be"):
        LengthRule("B1", "uniform")


def test_the_length_rules_file_is_read_or_refused_naming_the_entry(tmp_path):
    path = tmp_path / "rules.json"
    path.write_text('{"B1_glaive": {"mean_len": 1577, "sigma": 0.9}, "B8": {"length_dist": "fixed", "mean_len": 9}}')
    assert length_rules(path) == (LengthRule("B1_glaive", mean_len=1577, sigma=0.9), LengthRule("B8", "fixed", 9))
    path.write_text('{"B1_glaive": {"mean": 1577}}')
    with pytest.raises(ValueError, match=r"rules.json: 'B1_glaive': .*unexpected keyword argument 'mean'"):
        length_rules(path)
    path.write_text("[1]")
    with pytest.raises(ValueError, match="want an object of datasets, got list"):
        length_rules(path)


def test_stop_and_length_semantics():
    cfg = SimConfig(length_dist="fixed", mean_len=30, vocab_size=50)
    stop = simulate_output(PROMPT, {"max_new_tokens": 100}, cfg)
    assert len(stop.output_ids) == 30 and stop.natural_length == 30
    assert stop.output_ids[-1] == 1 and stop.finish_reason == {"type": "stop", "matched": 1}
    assert all(10 <= t < 50 for t in stop.output_ids[:-1])
    assert stop.text == " ".join(f"t{t}" for t in stop.output_ids[:-1])  # stop token trimmed
    untrimmed = simulate_output(PROMPT, {"max_new_tokens": 100, "no_stop_trim": True}, cfg)
    assert untrimmed.text.endswith(" t1")

    # A stop id inside the content range never shows up before the end.
    own = simulate_output(PROMPT, {"max_new_tokens": 100, "stop_token_ids": [17, 18]}, cfg)
    assert own.output_ids[-1] == 17 and own.finish_reason == {"type": "stop", "matched": 17}
    assert 17 not in own.output_ids[:-1] and 18 not in own.output_ids[:-1]

    # Natural end == the cap: SGLang 0.5.23 checks the stop token first (stop); 0.4.x the length.
    at_cap = simulate_output(PROMPT, {"max_new_tokens": 30}, cfg)
    assert at_cap == stop
    old = simulate_output(PROMPT, {"max_new_tokens": 30}, dataclasses.replace(cfg, sglang_version="0.4"))
    assert old.finish_reason == {"type": "length", "length": 30} and old.output_ids == stop.output_ids  # same ids
    short = simulate_output(PROMPT, {"max_new_tokens": 12}, cfg)
    assert short.finish_reason == {"type": "length", "length": 12}
    assert short.output_ids == stop.output_ids[:12]  # a smaller cap gives a prefix of the same answer

    forced = simulate_output(PROMPT, {"max_new_tokens": 80, "ignore_eos": True}, cfg)
    assert forced.finish_reason == {"type": "length", "length": 80} and len(forced.output_ids) == 80
    assert forced.output_ids[:29] == stop.output_ids[:29]

    default = simulate_output(PROMPT, None, SimConfig(length_dist="fixed", mean_len=500))
    assert default.finish_reason == {"type": "length", "length": 128}  # SGLang's default max_new_tokens


# -- the protocol ------------------------------------------------------------------------------


def test_generate_single_and_batch_match_the_pure_function(make_server):
    srv = make_server(vocab_size=1000, mean_len=20)
    params = {"max_new_tokens": 50, "temperature": 0.6}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        body = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params, "rid": "r1"}).json()
        expected = simulate_output(PROMPT, params, srv.config)
        assert body["output_ids"] == expected.output_ids and body["text"] == expected.text
        meta = body["meta_info"]
        assert list(meta) == FINISHED_META  # SGLang 0.5.23's _handle_batch_output
        assert meta["id"] == "r1" and meta["finish_reason"] == expected.finish_reason
        assert meta["prompt_tokens"] == 4 and meta["completion_tokens"] == len(expected.output_ids)
        assert meta["cached_tokens"] == 0 and meta["reasoning_tokens"] == 0 and meta["e2e_latency"] > 0
        # Again: the same answer.
        again = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params}).json()
        assert again["output_ids"] == body["output_ids"]

        prompts = [[5, 6], PROMPT, [7]]
        batch = c.post(
            "/generate", json={"input_ids": prompts, "sampling_params": params, "rid": ["a", "b", "c"]}
        ).json()
        assert [b["meta_info"]["id"] for b in batch] == ["a", "b", "c"]
        assert [b["output_ids"] for b in batch] == [simulate_output(p, params, srv.config).output_ids for p in prompts]

        info = c.get("/server_info").json()
        assert info["max_running_requests"] == 16 and info["max_req_input_len"] == 32768 - 6
        assert c.get("/model_info").json()["is_generation"] is True
        assert c.get("/health").status_code == 200 and c.get("/health_generate").status_code == 200
    s = srv.snapshot()
    assert s.requests == 3 and s.sequences == 5 and s.completed == 5
    assert s.served_tokens == len(expected.output_ids) * 2 + sum(len(b["output_ids"]) for b in batch)


def test_the_server_picks_the_length_rule_by_the_requests_rid(make_server):
    srv = make_server(vocab_size=1000, mean_len=20, length_rules=(LengthRule("B9_long", "fixed", 77),))
    params = {"max_new_tokens": 500, "temperature": 0.6}
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        ruled = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params, "rid": "ab-B9_long:3"})
        plain = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params, "rid": "ab-B1:3"})
    assert ruled.json()["output_ids"] == simulate_output(PROMPT, params, srv.config, "ab-B9_long:3").output_ids
    assert len(ruled.json()["output_ids"]) == 77
    assert plain.json()["output_ids"] == simulate_output(PROMPT, params, srv.config).output_ids


def test_bad_input_gets_sglang_error_bodies(make_server):
    srv = make_server(context_length=64)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post("/generate", json={"input_ids": list(range(64)), "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400
        assert r.json() == {
            "error": {"message": "The input (64 tokens) is longer than the model's context length (64 tokens)."}
        }
        # max_req_input_len = 64 - 1 - 5 = 58: a prompt that long is refused as the scheduler does.
        assert c.get("/server_info").json()["max_req_input_len"] == 58
        r = c.post("/generate", json={"input_ids": list(range(58)), "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 400
        assert r.json()["error"]["message"].startswith("Input length (58 tokens) exceeds")
        r = c.post("/generate", json={"input_ids": list(range(57)), "sampling_params": {"max_new_tokens": 1}})
        assert r.status_code == 200

        r = c.post("/generate", content=b"{not json")
        assert r.status_code == 400 and r.json()["object"] == "error" and r.json()["code"] == 400
        r = c.post("/generate", json={"input_ids": [1, "x"]})
        assert r.status_code == 400 and r.json()["type"] == "Bad Request"
        r = c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"top_p": 0}})
        assert r.status_code == 400 and r.json() == {"error": {"message": "top_p must be in (0, 1], got 0.0."}}
        assert c.post("/generate", json={"text": "hello"}).status_code == 400
    assert srv.snapshot().rejected == 6


# -- the capacity model --------------------------------------------------------------------------


def test_capacity_runs_max_running_at_once_and_queues_the_rest(make_server):
    srv = make_server(max_running=4, decode_s_per_token=0.01)
    params = {"max_new_tokens": 30, "ignore_eos": True}  # 30 tokens each: 0.3 s of decode

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
            rs = await asyncio.gather(
                *[c.post("/generate", json={"input_ids": [i, 1, 2], "sampling_params": params}) for i in range(8)]
            )
        return [r.json() for r in rs]

    bodies = asyncio.run(run())
    assert all(b["meta_info"]["completion_tokens"] == 30 for b in bodies)
    s = srv.snapshot()
    assert s.max_running_seen == 4 and s.max_in_flight == 8 and s.queued_sequences == 4
    assert s.served_tokens == 240 and s.completed == 8 and s.in_flight == 0
    assert 2.39 <= s.busy_slot_s <= 2.4 * 2  # 8 sequences x 0.3 s, never faster (late timers: slower)
    # Two batches: the queued four waited for the first four (0.3 s each, less their later arrival).
    assert s.queue_wait_s >= 4 * 0.3 * 0.7
    latencies = sorted(b["meta_info"]["e2e_latency"] for b in bodies)
    assert latencies[0] >= 0.29 and latencies[4] >= 0.5  # one batch alone would take 0.3 s
    assert srv.config.capacity_tokens_per_s == 400


def test_in_flight_counters_follow_the_client_concurrency(make_server):
    srv = make_server(max_running=64, decode_s_per_token=0.002)

    async def run():
        sem = asyncio.Semaphore(3)
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:

            async def one(i):
                async with sem:
                    body = {"input_ids": [i + 5], "sampling_params": {"max_new_tokens": 20}}
                    r = await c.post("/generate", json=body)
                    r.raise_for_status()

            await asyncio.gather(*[one(i) for i in range(12)])

    asyncio.run(run())
    s = srv.snapshot()
    assert s.max_in_flight == 3 and s.max_open_requests == 3 and s.max_running_seen == 3
    assert s.completed == 12 and s.open_requests == 0


# -- abort -------------------------------------------------------------------------------------


def test_abort_returns_a_deterministic_prefix_and_counts_the_waste(make_server):
    srv = make_server(max_running=1, decode_s_per_token=0.01)
    # 30 s of decoding: the aborts land long before it ends, however loaded the machine (200 tokens once finished first)
    params = {"max_new_tokens": 3000, "ignore_eos": True}
    full = simulate_output(PROMPT, params, srv.config).output_ids

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:

            def post(ids, rid):
                return asyncio.create_task(
                    c.post("/generate", json={"input_ids": ids, "sampling_params": params, "rid": rid})
                )

            running = post(
                PROMPT, "long"
            )  # in the slot before the second arrives (sent together, either may come first)
            await poll(lambda: srv.stats.running == 1)
            waiting = post([9], "queued")
            await poll(lambda: srv.stats.in_flight == 2)
            await poll(lambda: srv.snapshot().busy_slot_s >= 0.05)  # >= 5 tokens generated
            assert (await c.post("/abort_request", json={"rid": "queued"})).status_code == 200
            assert (await c.post("/abort_request", json={"rid": "long"})).status_code == 200
            return (await running).json(), (await waiting).json()

    long, queued = asyncio.run(run())
    k = long["meta_info"]["completion_tokens"]
    assert 5 <= k < 3000 and long["output_ids"] == full[:k]
    # Running: SGLang 0.5.23's FINISH_ABORT().to_json() through the normal output path.
    assert long["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert long["meta_info"]["prompt_tokens"] == len(PROMPT)
    # Queued: tokenizer_manager.py _handle_abort_req's answer, no prompt_tokens.
    assert queued["output_ids"] == [] and "prompt_tokens" not in queued["meta_info"]
    assert queued["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    s = srv.snapshot()
    assert s.aborted == 2 and s.aborted_tokens == k and s.served_tokens == 0 and s.in_flight == 0
    assert s.abort_requests == 2 and s.aborted_by_request == 2 and s.aborted_by_disconnect == 0


def test_abort_all_and_client_disconnect_abort(make_server):
    srv = make_server(max_running=2, decode_s_per_token=0.01, disconnect_poll_s=0.3)
    params = {"max_new_tokens": 500, "ignore_eos": True}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
            tasks = [
                asyncio.create_task(c.post("/generate", json={"input_ids": [i], "sampling_params": params}))
                for i in range(3)
            ]
            await poll(lambda: srv.stats.in_flight == 3)
            await c.post("/abort_request", json={"abort_all": True})
            bodies = [(await t).json() for t in tasks]
        # A client that gives up (timeout) makes the server abort its request, as SGLang does -- once
        # its disconnect poll (0.3 s here, SGLang's 4 s by default) notices.
        async with httpx.AsyncClient(base_url=srv.url, timeout=0.1) as c:
            with pytest.raises(httpx.ReadTimeout):
                await c.post("/generate", json={"input_ids": [42], "sampling_params": params})
        return bodies

    bodies = asyncio.run(run())
    assert [b["meta_info"]["finish_reason"]["type"] for b in bodies] == ["abort"] * 3
    s = srv.wait_for(lambda s: s.aborted == 4 and s.in_flight == 0)
    assert s.aborted_by_request == 3 and s.aborted_by_disconnect == 1


# -- fault injection -----------------------------------------------------------------------------


def test_fail_next_answers_errors_then_serves(make_server):
    srv = make_server()
    srv.fail_next(2)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}}
        codes = [c.post("/generate", json=body) for _ in range(3)]
        assert [r.status_code for r in codes] == [503, 503, 200]
        assert codes[0].json()["code"] == 503 and "message" in codes[0].json()
        srv.fail_next(1, status=429)
        assert c.post("/generate", json=body).status_code == 429
        assert c.get("/health").status_code == 200  # only /generate fails by default
    assert srv.snapshot().injected_errors == 3


@pytest.mark.parametrize("reset", [False, True])
def test_drop_next_closes_the_connection_without_an_answer(make_server, reset):
    srv = make_server()
    srv.drop_next(1, reset=reset)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 5}}
        with pytest.raises(httpx.ReadError if reset else httpx.RemoteProtocolError):
            c.post("/generate", json=body)
        assert c.post("/generate", json=body).status_code == 200
    s = srv.snapshot()
    assert s.dropped_connections == 1 and s.sequences == 1 and s.requests == 2


def test_slow_starting_and_reject_if(make_server):
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        srv.set_starting(True)
        assert c.get("/health_generate").status_code == 503 and c.get("/health").status_code == 503
        srv.set_starting(False)
        assert c.get("/health_generate").status_code == 200

        srv.slow(0.2)
        r = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}})
        assert r.status_code == 200 and r.json()["meta_info"]["e2e_latency"] >= 0.19
        srv.slow(0)

        srv.reject_if(lambda ids: 666 in ids)
        r = c.post("/generate", json={"input_ids": [[1, 2], [3, 666]]})
        assert r.status_code == 400 and "reject_if" in r.json()["error"]["message"]
        srv.reject_if(lambda ids: "custom reason" if ids == [7] else False)
        assert c.post("/generate", json={"input_ids": [7]}).json() == {"error": {"message": "custom reason"}}
        assert c.post("/generate", json={"input_ids": [8]}).status_code == 200


def test_down_drops_in_flight_and_up_serves_again(make_server):
    srv = make_server(decode_s_per_token=0.01)
    url = srv.url
    params = {"max_new_tokens": 500, "ignore_eos": True}
    expected = simulate_output(PROMPT, params, srv.config).output_ids

    async def in_flight_then_down():
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            task = asyncio.create_task(c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params}))
            await poll(lambda: srv.stats.running == 1)
            await asyncio.to_thread(srv.down)
            with pytest.raises(httpx.TransportError):
                await task

    asyncio.run(in_flight_then_down())
    with pytest.raises(httpx.ConnectError):
        httpx.get(url + "/health", timeout=5)
    srv.up()
    assert srv.url == url
    with httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/health").status_code == 200
        # A restarted server gives the same answer to the same prompt.
        short = {"max_new_tokens": 5, "ignore_eos": True}
        again = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": short}).json()
        assert again["output_ids"] == expected[:5]
        srv.down(refuse=False)
        r = c.get("/health")
        assert r.status_code == 503 and r.json()["code"] == 503
        srv.up()
        assert c.get("/health").status_code == 200
    s = srv.snapshot()
    assert s.restarts == 2 and s.aborted == 1 and s.in_flight == 0


def test_admin_endpoint_and_stats(make_server):
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        state = c.post("/_fault", json={"fail_next": 1, "status": 500}).json()
        assert state["fail_next"] == 1
        assert c.post("/generate", json={"input_ids": [1]}).status_code == 500
        c.post("/_fault", json={"reject_token": 9})
        assert c.post("/generate", json={"input_ids": [1, 9]}).status_code == 400
        c.post("/_fault", json={"clear": True})
        ok = c.post("/generate", json={"input_ids": [1, 9], "sampling_params": {"max_new_tokens": 3}})
        assert ok.status_code == 200
        stats = c.get("/_stats").json()
        assert stats["injected_errors"] == 1 and stats["rejected"] == 1 and stats["completed"] == 1
        c.post("/_fault", json={"reset_stats": True})
        assert c.get("/_stats").json()["completed"] == 0


@pytest.mark.multiprocess
def test_cli_runs_in_the_foreground():
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "emulators.sim",
            "--port",
            "0",
            "--seed",
            "3",
            "--mean-len",
            "40",
            "--decode-ms",
            "0.5",
            "--api-key",
            "k",
            "--sglang-version",
            "0.5",
            "--disconnect-poll-s",
            "0.5",
            "--reserved-tokens",
            "4",
            "--context-length",
            "1000",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        line = proc.stdout.readline()  # blocks until the server prints its address (or exits)
        assert line.startswith("sim_server listening on http://127.0.0.1:"), line
        url = line.split()[-1]
        params = {"max_new_tokens": 300}
        assert httpx.post(url + "/generate", json={"input_ids": PROMPT}, timeout=10).status_code == 401
        with httpx.Client(base_url=url, timeout=10, headers={"Authorization": "Bearer k"}) as c:
            near = c.post("/generate", json={"input_ids": [5] * 900, "sampling_params": {"max_new_tokens": 100}})
            assert near.status_code == 400 and "904 tokens from the input" in near.json()["error"]["message"]
            body = c.post("/generate", json={"input_ids": PROMPT, "sampling_params": params}).json()
            expected = simulate_output(PROMPT, params, SimConfig(seed=3, mean_len=40))
            assert body["output_ids"] == expected.output_ids
            c.post("/_fault", json={"down": 0.2})  # an outage of 0.2 s, then it listens again
            deadline = time.monotonic() + 10
            saw_outage = False
            while True:  # bounded polling until it is back
                try:
                    if c.get("/health").status_code == 200 and saw_outage:
                        break
                except httpx.TransportError:
                    saw_outage = True
                assert time.monotonic() < deadline, "the CLI server did not come back"
                time.sleep(0.01)
            assert c.get("/_stats").json()["restarts"] == 1
    finally:
        proc.terminate()
        proc.wait(timeout=10)
        proc.stdout.close()


def test_injected_400s_and_bad_fault_specs_have_sglang_bodies(make_server):
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        srv.fail_next(1, status=400, message="nope")
        r = c.post("/generate", json={"input_ids": PROMPT})
        assert r.status_code == 400 and r.json() == {"error": {"message": "nope"}}  # a ValueError's shape
        r = c.post("/_fault", json=[1])
        assert r.status_code == 400
        assert r.json() == {"error": {"message": "bad fault spec: the body must be a JSON object"}}
        r = c.post("/_fault", json={"fail_next": "many"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("bad fault spec: ")
        assert c.post("/generate", json={"input_ids": PROMPT}).status_code == 200  # nothing was armed
    s = srv.snapshot()
    assert s.injected_errors == 1 and s.requests == 2 and s.rejected == 0


def test_drop_next_on_any_path_then_the_server_answers_again(make_server):
    srv = make_server()
    srv.drop_next(2, path=None)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        with pytest.raises(httpx.RemoteProtocolError):
            c.get("/health")
        with pytest.raises(httpx.RemoteProtocolError):
            c.get("/server_info")
        assert c.get("/health").status_code == 200
        assert c.get("/_stats").json()["dropped_connections"] == 2  # admin paths are never dropped
    s = srv.snapshot()
    assert s.dropped_connections == 2 and s.requests == 0  # only /generate counts as a request


def test_restart_cuts_in_flight_requests_and_comes_back_starting(make_server):
    srv = make_server(decode_s_per_token=0.01)
    url = srv.url

    async def in_flight_then_restart():
        async with httpx.AsyncClient(base_url=url, timeout=10) as c:
            body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 500, "ignore_eos": True}}
            task = asyncio.create_task(c.post("/generate", json=body))
            await poll(lambda: srv.stats.running == 1)
            await asyncio.to_thread(srv.restart, starting=True)
            with pytest.raises(httpx.TransportError):
                await task

    asyncio.run(in_flight_then_restart())
    assert srv.url == url
    with httpx.Client(base_url=url, timeout=10) as c:
        assert c.get("/health_generate").status_code == 503  # up, but still starting
        assert c.post("/generate", json={"input_ids": PROMPT}).status_code == 200  # generation is served
    s = srv.snapshot()
    assert s.restarts == 1 and s.aborted == 1 and s.completed == 1 and s.in_flight == 0


def test_duplicate_rids_prefix_aborts_and_auth_are_counted(make_server):
    """SimStats: duplicate_rids, abort_requests, aborted_by_request (prefix matches), queued_aborts, auth_refused."""
    srv = make_server(max_running=2, decode_s_per_token=0.01, api_key="k", admin_api_key="adm")
    params = {"max_new_tokens": 3000, "ignore_eos": True}
    user, admin = {"Authorization": "Bearer k"}, {"Authorization": "Bearer adm"}

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=10, headers=user) as c:
            tasks = [
                asyncio.create_task(
                    c.post("/generate", json={"input_ids": [i + 5], "sampling_params": params, "rid": rid})
                )
                for i, rid in enumerate(["r:1", "r:10", "r:100"])
            ]
            await poll(lambda: srv.stats.in_flight == 3)  # two running, r:100 (or another) queued
            dup = await c.post("/generate", json={"input_ids": [1], "rid": "r:10"})
            assert dup.status_code == 400 and dup.json() == {
                "error": {"message": "Duplicate request ID detected: r:10"}
            }
            assert (await c.post("/abort_request", json={"rid": "r:1"})).status_code == 401  # the admin key only
            assert (await c.post("/abort_request", json={"rid": "r:"}, headers=admin)).status_code == 200  # not held
            assert (await c.post("/abort_request", json={"rid": "r:1"}, headers=admin)).status_code == 200
            return [(await t).json() for t in tasks]

    outs = asyncio.run(run())
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort"] * 3
    assert sum("prompt_tokens" not in o["meta_info"] for o in outs) == 1  # the queued one
    s = srv.snapshot()
    assert (s.duplicate_rids, s.rejected, s.auth_refused, s.abort_requests) == (1, 1, 1, 2)
    assert (s.aborted_by_request, s.queued_aborts, s.aborted, s.in_flight) == (3, 1, 3, 0)
    with pytest.raises(ValueError, match="--admin-api-key does not exist in SGLang 0.4"):
        SimServer(sglang_version="0.4", admin_api_key="adm")


def test_abort_if_aborts_matching_prompts_as_they_start(make_server):
    srv = make_server()
    srv.abort_if(lambda ids: 13 in ids)
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        out = c.post("/generate", json={"input_ids": [[13, 14], [15]], "sampling_params": {"max_new_tokens": 5}}).json()
        assert out[0]["meta_info"]["finish_reason"] == {
            "type": "abort",
            "message": "Aborted",
            "status_code": None,
            "err_type": None,
        }
        assert out[0]["output_ids"] == [] and out[0]["meta_info"]["prompt_tokens"] == 2
        assert out[1]["meta_info"]["finish_reason"]["type"] in ("stop", "length")
        srv.clear_faults()
        again = c.post("/generate", json={"input_ids": [13, 14], "sampling_params": {"max_new_tokens": 5}}).json()
        assert again["meta_info"]["finish_reason"]["type"] != "abort"
    s = srv.snapshot()
    assert s.aborted == 1 and s.aborted_by_request == 0 and s.completed == 2


def test_hold_if_holds_matching_prompts_until_they_are_aborted(make_server):
    """hold_if: a matching prompt never runs (the others do); an abort ends it as a queued one."""
    srv = make_server(decode_s_per_token=0.001)
    srv.hold_if(lambda ids: 13 in ids)

    async def run():
        async with httpx.AsyncClient(base_url=srv.url, timeout=10) as c:
            held = asyncio.ensure_future(
                c.post("/generate", json={"input_ids": [13, 14], "rid": "h1", "sampling_params": {"max_new_tokens": 5}})
            )
            free = await c.post("/generate", json={"input_ids": [15], "sampling_params": {"max_new_tokens": 5}})
            s = await asyncio.to_thread(srv.wait_for, lambda s: s.in_flight == 1 and s.completed == 1, 10)
            assert not held.done() and s.running == 0  # held in the queue: admitted, not running
            assert (await c.post("/abort_request", json={"rid": "h1"})).status_code == 200
            return free.json(), (await held).json()

    free, held = asyncio.run(run())
    assert free["meta_info"]["finish_reason"]["type"] in ("stop", "length")
    assert held["meta_info"]["finish_reason"]["type"] == "abort" and held["output_ids"] == []
    assert "prompt_tokens" not in held["meta_info"]  # SGLang's answer for a request aborted while queued
    s = srv.snapshot()
    assert (s.completed, s.aborted, s.queued_aborts, s.in_flight) == (1, 1, 1, 0)


def test_drop_fraction_cuts_admitted_requests_which_stay_held_until_the_poll(make_server):
    """drop_fraction: seeded draws, one per admitted /generate; a cut request runs on and holds its rid until the
    disconnect poll aborts it (SGLang 0.5.23 tokenizer_manager.py `_stream_one_response`)."""
    import random

    srv = make_server(decode_s_per_token=0.01, disconnect_poll_s=0.4)
    srv.drop_fraction(0.5, seed=7, after_s=0.05)
    draws = random.Random(7)
    expected = [draws.random() < 0.5 for _ in range(8)]
    assert any(expected) and not all(expected)
    params = {"max_new_tokens": 2000, "ignore_eos": True}  # 20 s: only a cut or our abort ends them
    cut = []
    with httpx.Client(base_url=srv.url, timeout=0.5) as c:  # the cut comes after 0.05 s
        for i in range(8):
            rid = f"d{i}"
            try:
                c.post("/generate", json={"input_ids": [i + 5], "rid": rid, "sampling_params": params})
            except httpx.RemoteProtocolError:  # the FIN, with no answer
                cut.append(True)
                if len(cut) == 1:  # re-sent at once: the server still holds the rid
                    r = c.post(
                        "/generate", json={"input_ids": [1], "rid": rid, "sampling_params": {"max_new_tokens": 1}}
                    )
                    assert r.status_code == 400 and "Duplicate request ID detected" in r.json()["error"]["message"]
                continue
            except httpx.ReadTimeout:  # not cut: it runs on (our timeout); the poll aborts it as well
                pass
            cut.append(False)
    assert cut == expected
    s = srv.wait_for(lambda s: s.in_flight == 0, timeout=10)
    assert s.dropped_connections == sum(expected) and s.duplicate_rids == 1
    assert s.aborted_by_disconnect == 8 and s.sequences == 8
    # /_fault takes the same, and clear_faults ends it.
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        state = c.post("/_fault", json={"drop_fraction": 1.0, "drop_seed": 1, "drop_after_s": 0.0}).json()
        assert state["drop_fraction"] == 1.0 and state["drop_after_s"] == 0.0
        with pytest.raises(httpx.RemoteProtocolError):
            c.post("/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 2}})
        assert c.post("/_fault", json={"clear": True}).json()["drop_fraction"] == 0.0
        assert c.post("/generate", json={"input_ids": [3], "sampling_params": {"max_new_tokens": 2}}).status_code == 200


def test_json_true_is_not_a_token_id(make_server):
    """SGLang 0.5.23's dataclass parse lets a JSON true through as an int; its contract gate refuses it."""
    srv = make_server()
    with httpx.Client(base_url=srv.url, timeout=10) as c:
        r = c.post("/generate", json={"input_ids": [5, True]})
    assert r.status_code == 400 and r.json() == {"error": "invalid type: boolean `true`, expected i64"}
    assert srv.snapshot().rejected == 1
    old = make_server(sglang_version="0.4")  # no gate: refused by our own type check (the validation shape)
    with httpx.Client(base_url=old.url, timeout=10) as c:
        r = c.post("/generate", json={"input_ids": [5, True]})
    assert r.status_code == 400 and r.json()["type"] == "Bad Request" and r.json()["code"] == 400
