"""The SGLang-compatible dev server, over a real socket: uvicorn in a thread, httpx as the client."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import torch

from emulators.dev_server.app import create_app
from emulators.dev_server.batcher import Batcher
from emulators.dev_server.sequence import BatchSequence
from emulators.sglang_protocol.sampling import SamplingParams
from tests.emulators.sglang_shapes import FINISHED_META

CONTEXT = 512  # smaller than the tiny target's 4096 positions: over-long prompts stay cheap
PROMPTS = [[20, 31, 42, 53], [100, 7, 250], [300, 301, 302, 303, 304, 305], [64, 65], [900, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def server(tiny_target_dir, serve_app):
    """Base URL of a dev server running on a free loopback port for the whole module."""
    app = create_app(tiny_target_dir, context_length=CONTEXT, max_batch_size=8, model_name="tiny")
    with serve_app(app) as url:
        yield url


@pytest.fixture(scope="module")
def client(server):
    with httpx.Client(base_url=server, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def hf(tiny_target_dir):
    """The same model and tokenizer, loaded directly, as the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).to(torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(tiny_target_dir)


def greedy_reference(model, prompt: list[int], n: int) -> list[int]:
    """Greedy continuation recomputed from scratch each step (no KV cache, no batching)."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def gen(client, **body) -> httpx.Response:
    return client.post("/generate", json=body)


GREEDY = {"temperature": 0, "ignore_eos": True}


def test_generate_input_ids_has_sglang_shape(client, hf):
    r = gen(client, input_ids=PROMPTS[0], rid="one", sampling_params={**GREEDY, "max_new_tokens": 6})
    assert r.status_code == 200
    out = r.json()
    assert list(out) == ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert list(meta) == FINISHED_META  # SGLang 0.5.23 tokenizer_manager.py _handle_batch_output
    assert meta["id"] == "one"
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == len(PROMPTS[0])
    assert meta["completion_tokens"] == len(out["output_ids"]) == 6
    assert meta["cached_tokens"] == 0
    assert isinstance(meta["e2e_latency"], float) and meta["e2e_latency"] > 0
    model, tok = hf
    assert out["output_ids"] == greedy_reference(model, PROMPTS[0], 6)
    assert out["text"] == tok.decode(out["output_ids"], skip_special_tokens=True)


def test_generate_text_is_tokenized_without_template_or_specials(client, hf):
    _, tok = hf
    text = "Hello there, how are you?"
    ids = tok.encode(text, add_special_tokens=False)
    by_text = gen(client, text=text, sampling_params={**GREEDY, "max_new_tokens": 5}).json()
    by_ids = gen(client, input_ids=ids, sampling_params={**GREEDY, "max_new_tokens": 5}).json()
    assert by_text["meta_info"]["prompt_tokens"] == len(ids)
    assert by_text["output_ids"] == by_ids["output_ids"]
    assert len(by_text["meta_info"]["id"]) == 32  # a uuid hex when no rid is given


def test_batch_returns_results_in_input_order(client, hf):
    prompts, lengths = PROMPTS[:3], [2, 3, 4]
    params = [{**GREEDY, "max_new_tokens": n} for n in lengths]
    r = gen(client, input_ids=prompts, rid=["a", "b", "c"], sampling_params=params)
    assert r.status_code == 200
    outs = r.json()
    assert isinstance(outs, list) and [o["meta_info"]["id"] for o in outs] == ["a", "b", "c"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == lengths
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [len(p) for p in prompts]
    model, _ = hf
    assert [o["output_ids"] for o in outs] == [greedy_reference(model, p, n) for p, n in zip(prompts, lengths)]


def test_greedy_is_identical_alone_and_batched(server, client, hf):
    body = lambda p: {"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 12}}  # noqa: E731
    alone = [client.post("/generate", json=body(p)).json()["output_ids"] for p in PROMPTS]

    async def together():
        async with httpx.AsyncClient(base_url=server, timeout=60) as ac:
            rs = await asyncio.gather(*(ac.post("/generate", json=body(p)) for p in PROMPTS))
        return [r.json()["output_ids"] for r in rs]

    assert asyncio.run(together()) == alone
    model, _ = hf
    assert alone == [greedy_reference(model, p, 12) for p in PROMPTS]


def test_engine_batches_mixed_lengths_and_late_joiners_exactly(hf):
    """White-box: drive the batcher's steps by hand so batching (padding, joins) surely happens."""
    model, tok = hf
    loop = asyncio.new_event_loop()
    batcher = Batcher(model, tok, eos_ids=set(), max_batch_size=8)
    params = SamplingParams(temperature=0, ignore_eos=True, max_new_tokens=10)
    seqs = [
        BatchSequence(
            rid=str(i),
            prompt_ids=p,
            params=params,
            max_new_tokens=10,
            created=time.perf_counter(),
            loop=loop,
            future=loop.create_future(),
        )
        for i, p in enumerate(PROMPTS)
    ]
    with torch.inference_mode():
        for s in seqs[:3]:
            batcher._admitted.append(s)
            batcher._prefill(s)
        for _ in range(3):
            assert len(batcher._active) == 3  # three cache lengths, one forward
            batcher._step()
        for s in seqs[3:]:  # two more join mid-way
            batcher._admitted.append(s)
            batcher._prefill(s)
        while batcher._active:
            batcher._step()
    loop.run_until_complete(asyncio.sleep(0))  # deliver the results posted to the loop
    results = [s.future.result() for s in seqs]
    loop.close()
    assert [r["meta_info"]["finish_reason"] for r in results] == [{"type": "length", "length": 10}] * 5
    assert [r["output_ids"] for r in results] == [greedy_reference(model, p, 10) for p in PROMPTS]


def test_stop_token_ids_stop_and_are_trimmed_from_text(client, hf):
    _, tok = hf
    first = gen(client, input_ids=PROMPTS[1], sampling_params={**GREEDY, "max_new_tokens": 1}).json()["output_ids"][0]
    params = {"temperature": 0, "max_new_tokens": 8, "stop_token_ids": [first]}
    out = gen(client, input_ids=PROMPTS[1], sampling_params=params).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": first}
    assert out["output_ids"] == [first]
    assert out["text"] == ""
    kept = gen(client, input_ids=PROMPTS[1], sampling_params={**params, "no_stop_trim": True}).json()
    assert kept["text"] == tok.decode([first], skip_special_tokens=True)
    # ignore_eos disables stop_token_ids too, as in SGLang.
    ignored = gen(client, input_ids=PROMPTS[1], sampling_params={**params, "ignore_eos": True}).json()
    assert ignored["meta_info"]["finish_reason"] == {"type": "length", "length": 8}


def test_sampling_seed_makes_sampling_reproducible(client):
    params = {"temperature": 1.0, "top_p": 0.9, "top_k": 50, "max_new_tokens": 10, "ignore_eos": True}
    a, b = (gen(client, input_ids=PROMPTS[2], sampling_params={**params, "sampling_seed": 7}).json() for _ in range(2))
    assert a["output_ids"] == b["output_ids"] and len(a["output_ids"]) == 10


def test_over_long_prompt_is_rejected_with_sglang_error(client):
    r = gen(client, input_ids=[5] * (CONTEXT + 3))
    assert r.status_code == 400
    assert r.json() == {
        "error": {
            "message": (
                f"The input ({CONTEXT + 3} tokens) is longer than the model's context length ({CONTEXT} tokens)."
            )
        }
    }
    r = gen(client, input_ids=[5] * 100, sampling_params={"max_new_tokens": CONTEXT})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. "
        f"You requested a total of {100 + CONTEXT} tokens"
    )
    # The scheduler's own limit, max_req_input_len = context - 6, applies below the context length.
    r = gen(client, input_ids=[5] * (CONTEXT - 6), sampling_params={"max_new_tokens": 1})
    assert r.status_code == 400
    assert r.json()["error"]["message"] == (
        f"Input length ({CONTEXT - 6} tokens) exceeds the maximum allowed length ({CONTEXT - 6} tokens). "
        "Use a shorter input or enable --allow-auto-truncate."
    )


@pytest.mark.parametrize(
    "body, fragment",
    [
        ({"input_ids": [5], "sampling_params": {"temperature": -1}}, "temperature must be a non-negative"),
        ({"input_ids": [5], "sampling_params": {"top_p": 0}}, "top_p must be in (0, 1]"),
        ({"input_ids": [5], "sampling_params": {"top_p": 1.5}}, "top_p must be in (0, 1]"),
        ({"input_ids": [5], "sampling_params": {"top_k": 0}}, "top_k must be -1 (disable) or at least 1"),
        ({"input_ids": [5], "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens must be at least 0"),
        ({"input_ids": [5], "text": "hi"}, "Either text, input_ids or input_embeds should be provided."),
        ({"sampling_params": {}}, "Either text, input_ids or input_embeds should be provided."),
        ({"input_ids": [5, 10**6]}, "contains values greater than the vocab size"),
        ({"input_ids": [5], "stream": True}, "stream=True is not supported"),
        ({"input_ids": [5], "sampling_params": {"stop": ["x"]}}, "not supported by the dev server: ['stop']"),
        ({"input_ids": [[5], [6]], "sampling_params": [{}]}, "sampling_params has 1 entries for a batch of 2"),
    ],
)
def test_bad_requests_get_400_with_sglang_error_body(client, body, fragment):
    r = client.post("/generate", json=body)
    assert r.status_code == 400
    assert set(r.json()) == {"error"} and fragment in r.json()["error"]["message"]


def test_malformed_json_gets_400_validation_body(client):
    r = client.post("/generate", content=b'{"input_ids": [1, 2', headers={"content-type": "application/json"})
    assert r.status_code == 400
    body = r.json()
    assert body["object"] == "error" and body["code"] == 400 and body["type"] == "Bad Request"
    r = gen(client, input_ids="not ids")
    assert r.status_code == 400 and r.json()["object"] == "error"


def _abort_while_running(server, bodies: list[dict], abort: dict) -> list[dict]:
    """Send long requests, then repeat `abort` until all of them have come back (bounded)."""

    async def go():
        async with httpx.AsyncClient(base_url=server, timeout=60) as ac:
            tasks = [asyncio.ensure_future(ac.post("/generate", json=b)) for b in bodies]
            deadline = time.monotonic() + 30
            # An abort for a rid the server has not registered yet is a no-op (as in SGLang), so
            # keep sending it until the requests finish.
            while not all(t.done() for t in tasks):
                assert time.monotonic() < deadline, "aborted requests did not come back"
                assert (await ac.post("/abort_request", json=abort)).status_code == 200
                await asyncio.wait(tasks, timeout=0.05)
            return [t.result() for t in tasks]

    responses = asyncio.run(go())
    assert all(r.status_code == 200 for r in responses)
    return [r.json() for r in responses]


def test_abort_by_rid_returns_tokens_so_far(server):
    long = {"input_ids": PROMPTS[0], "rid": "abort-me", "sampling_params": {**GREEDY, "max_new_tokens": 480}}
    (out,) = _abort_while_running(server, [long], {"rid": "abort-me"})
    assert out["meta_info"]["id"] == "abort-me"
    # Running (or out of the queue): FINISH_ABORT().to_json() through the normal output path.
    assert out["meta_info"]["finish_reason"] == {
        "type": "abort",
        "message": "Aborted",
        "status_code": None,
        "err_type": None,
    }
    assert out["meta_info"]["prompt_tokens"] == len(PROMPTS[0])
    assert out["meta_info"]["completion_tokens"] == len(out["output_ids"]) < 480


def test_abort_all(server):
    bodies = [{"input_ids": p, "sampling_params": {**GREEDY, "max_new_tokens": 480}} for p in PROMPTS[:2]]
    outs = _abort_while_running(server, bodies, {"abort_all": True})
    assert [o["meta_info"]["finish_reason"]["type"] for o in outs] == ["abort", "abort"]


def test_health_endpoints(client):
    assert client.get("/health").status_code == 200
    assert client.get("/health_generate").status_code == 200


def test_server_and_model_info(client, tiny_target_dir):
    info = client.get("/server_info").json()
    assert info["context_length"] == CONTEXT
    assert info["max_req_input_len"] == CONTEXT - 6  # SGLang: max_req_len (context - 1) - 5
    assert info["max_running_requests"] == 8
    assert info["max_total_num_tokens"] >= CONTEXT and info["version"]
    model = client.get("/model_info").json()
    assert model["model_path"] == str(tiny_target_dir) and model["is_generation"] is True
    assert client.get("/get_model_info").json() == model


def test_dev_and_sim_servers_answer_bad_input_alike(client):
    """One protocol module: the simulated server refuses what the dev server refuses, in the same words."""
    from emulators.sim import SimServer

    vocab = client.get("/server_info").json()["vocab_size"]
    bad = [
        {"input_ids": [5] * (CONTEXT + 3)},
        {"input_ids": [5] * 100, "sampling_params": {"max_new_tokens": CONTEXT}},
        {"input_ids": [5] * (CONTEXT - 6), "sampling_params": {"max_new_tokens": 1}},
        {"input_ids": [5, vocab]},
        {"input_ids": [5, -1]},
        {"input_ids": []},
        {"input_ids": [5, True]},
        {"input_ids": "5 6"},
        {"sampling_params": {}},
        {"input_ids": [5], "sampling_params": {"top_p": 0}},
        {"input_ids": [5], "sampling_params": {"temperature": "hot"}},
        {"input_ids": [[5], [6]], "sampling_params": [{}]},
        {"input_ids": [[5], [6]], "rid": ["a"]},
        {"input_ids": [5], "rid": 7},
    ]
    with SimServer(vocab_size=vocab, context_length=CONTEXT) as sim, httpx.Client(base_url=sim.url, timeout=10) as sc:
        for body in bad:
            dev, simulated = client.post("/generate", json=body), sc.post("/generate", json=body)
            assert dev.status_code == simulated.status_code == 400, body
            assert dev.json() == simulated.json(), body
        for path in ("/generate", "/abort_request"):
            dev, simulated = client.post(path, content=b"[1"), sc.post(path, content=b"[1")
            assert dev.status_code == simulated.status_code == 400 and dev.json() == simulated.json()
        dev_info, sim_info = client.get("/server_info").json(), sc.get("/server_info").json()
        assert set(dev_info) == set(sim_info)
        assert {k: dev_info[k] for k in ("context_length", "max_req_len", "max_req_input_len", "vocab_size")} == {
            k: sim_info[k] for k in ("context_length", "max_req_len", "max_req_input_len", "vocab_size")
        }
        assert set(client.get("/model_info").json()) == set(sc.get("/model_info").json())


def test_cli_flags_reach_the_app(monkeypatch, tiny_target_dir):
    """SGLang's --api-key / --admin-api-key, and --disconnect-poll-s, --sglang-version, --decode-log-interval."""
    import emulators.dev_server.cli as dev

    seen = {}
    monkeypatch.setattr(dev, "serve", lambda model, host, port, **kw: seen.update(kw))
    dev.main(
        [
            "--model",
            str(tiny_target_dir),
            "--api-key",
            "k",
            "--admin-api-key",
            "adm",
            "--disconnect-poll-s",
            "0.5",
            "--sglang-version",
            "0.5",
            "--decode-log-interval",
            "7",
        ]
    )
    assert (
        seen["api_key"],
        seen["admin_api_key"],
        seen["disconnect_poll_s"],
        seen["sglang_version"],
        seen["decode_log_interval"],
    ) == ("k", "adm", 0.5, "0.5", 7)
    with pytest.raises(SystemExit) as exc:
        dev.main(["--model", str(tiny_target_dir), "--sglang-version", "0.4", "--admin-api-key", "adm"])
    assert exc.value.code == 2
    with pytest.raises(ValueError, match="--admin-api-key does not exist in SGLang 0.4"):
        create_app(tiny_target_dir, sglang_version="0.4", admin_api_key="adm")
