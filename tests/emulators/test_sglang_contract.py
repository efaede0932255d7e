"""SGLang 0.5.23's native API, the rules the pipeline relies on, against BOTH emulations over raw HTTP.

Each test is one rule: its docstring states it and cites the SGLang 0.5.23 source (file and function,
relative to the ``sglang`` package) it comes from. Every test runs against the dev server
(emulators/dev_server/, a real tiny model) and the simulated server (emulators/sim/) through the
``emu`` fixture (ids "dev" and "sim"), speaking plain HTTP with httpx, so an emulation that drifts from
SGLang (or from the other one) fails here. Tests marked with a version also run with
``sglang_version="0.4"`` (0.4.x, read in 0.4.10.post2) where the two differ.

The dev server runs an untrained small target built in a fraction of a second (the rules need
tokens, not good ones); requests that must be running or queued for a while ask for thousands of
tokens and are aborted once the rule is checked. Nothing sleeps to synchronise: `poll` waits for a
condition with a deadline.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import json
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import pytest
import torch

from emulators.dev_server.app import create_app
from emulators.dev_server.speculative import Speculative
from emulators.sim import SimServer
from tasks.serving.sglang import SGLangClient
from tests.emulators.sglang_shapes import FINISHED_META
from tests.sglang_real import start_sglang

CONTEXT = 4096
NUM_STEPS = 3  # the draft's --speculative-num-steps; topk 1, S + 1 draft tokens
RESERVED = NUM_STEPS + 1  # compute_num_reserved_tokens() = max(topk * steps, num_draft_tokens)
POLL_S = 0.3  # the servers' disconnect poll (SGLang: 4 s), short for tests
HELD_POLL_S = 4.0  # the disconnect poll in the held-rid test: SGLang's default (srt/environ.py)
LONG = 4000  # max_new_tokens of a request that runs for seconds on either server
FINISH_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
USER, ADMIN = "user-key", "admin-key"


def poll(condition: Callable[[], Any], timeout: float = 10.0, what: str = "condition") -> Any:
    """Bounded polling of a condition the servers reach on their own threads; its truthy value."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s"
        time.sleep(0.005)


@dataclasses.dataclass
class Emulation:
    """One running server, as the tests see it: a URL and what it answers."""

    kind: str  # "dev" | "sim"
    url: str
    settings: dict[str, Any]
    headers: dict[str, str] = dataclasses.field(default_factory=dict)  # sent with every call unless overridden
    pool: concurrent.futures.ThreadPoolExecutor = dataclasses.field(
        default_factory=lambda: concurrent.futures.ThreadPoolExecutor(max_workers=8)
    )

    def post(
        self,
        path: str,
        body: Any = None,
        *,
        headers: dict[str, str] | None = None,
        content: bytes | None = None,
        timeout: float = 60,
    ) -> httpx.Response:
        h = self.headers if headers is None else headers
        if content is not None:
            return httpx.post(
                self.url + path, content=content, headers={**h, "content-type": "application/json"}, timeout=timeout
            )
        return httpx.post(self.url + path, json=body, headers=h, timeout=timeout)

    def get(self, path: str, *, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.get(self.url + path, headers=self.headers if headers is None else headers, timeout=30)

    def generate(self, body: dict[str, Any], **kw) -> httpx.Response:
        return self.post("/generate", body, **kw)

    def background(self, body: dict[str, Any], **kw) -> concurrent.futures.Future:
        """A /generate sent from another thread: its httpx.Response, later."""
        return self.pool.submit(self.generate, body, **kw)

    def state(self) -> dict[str, Any]:
        """loads[0] of /v1/loads (num_running_reqs, num_waiting_reqs): where SGLang 0.5.23 reports them."""
        return self.get("/v1/loads").json()["loads"][0]

    def internal_state(self) -> dict[str, Any]:
        """internal_states[0] of /server_info (avg_spec_accept_length with a draft)."""
        return self.get("/server_info").json()["internal_states"][0]

    def wait(self, running: int, waiting: int = 0, timeout: float = 10.0) -> None:
        poll(
            lambda: (s := self.state())["num_running_reqs"] == running and s["num_waiting_reqs"] == waiting,
            timeout,
            f"{running} running and {waiting} waiting at the {self.kind} server",
        )

    def abort(self, rid: str = "", abort_all: bool = False, **kw) -> httpx.Response:
        return self.post("/abort_request", {"abort_all": True} if abort_all else {"rid": rid}, **kw)


def long_body(rid: str, prompt: list[int] | None = None) -> dict[str, Any]:
    """A request that decodes for seconds (ignore_eos: no early stop)."""
    return {
        "input_ids": prompt or [5, 6, 7],
        "rid": rid,
        "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True, "temperature": 0},
    }


@pytest.fixture(scope="module")
def small_target_dir(tmp_path_factory) -> Any:
    """An untrained small target (tokenizer + random Llama weights, 8 layers: the least a draft takes)."""
    from models.target.tiny import build_tiny_target

    return build_tiny_target(
        tmp_path_factory.mktemp("small_target") / "model",
        train_steps=0,
        num_layers=8,
        hidden_size=64,
        num_heads=2,
        num_kv_heads=1,
        intermediate_size=128,
        max_position_embeddings=CONTEXT,
    )


@pytest.fixture(scope="module")
def small_target(small_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(small_target_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def small_draft_dir(small_target, tmp_path_factory):
    """A random EAGLE-3 draft for the small target, exported as SGLang loads it (test_dev_server_spec's helper)."""
    from tests.emulators.test_dev_server_spec import export_random_draft

    return export_random_draft(small_target, tmp_path_factory.mktemp("small_draft") / "final")


@pytest.fixture(scope="module")
def servers(small_target_dir, small_draft_dir, serve_app, tmp_path_factory):
    """`servers(kind, **settings)`: a running server of that kind, one per distinct settings, for the module.

    Settings: slots (max_batch_size / max_running, default 8), poll (disconnect_poll_s, default POLL_S),
    version ("0.5" | "0.4"), api_key, admin_api_key, draft (dev: an EAGLE-3 draft; sim: its reserved tokens).
    """
    started: dict[tuple, Emulation] = {}
    real_logs = tmp_path_factory.mktemp("sglang_logs")
    with contextlib.ExitStack() as stack:

        def start(kind: str, **settings: Any) -> Emulation:
            # a default passed or left out: the same server, started once
            settings = {"slots": 8, "poll": POLL_S, "version": "0.5", **settings}
            key = (kind, tuple(sorted(settings.items())))
            if key in started:
                return started[key]
            slots, poll_s, version = settings["slots"], settings["poll"], settings["version"]
            keys = dict(api_key=settings.get("api_key"), admin_api_key=settings.get("admin_api_key"))
            if kind == "real":  # the real SGLang 0.5.23 (tests/sglang_real.py): one start per distinct settings
                if version != "0.5":
                    pytest.skip("the real server is SGLang 0.5.23; 0.4.x is emulated only")
                # its disconnect poll is SGLANG_REQUEST_STATE_WAIT_TIMEOUT, whole seconds (srt/environ.py EnvInt)
                key = (kind, tuple(sorted((k, v) for k, v in settings.items() if k != "poll")))
                if key in started:
                    return started[key]
                extra = [
                    w for k in ("api_key", "admin_api_key") if keys[k] for w in (f"--{k.replace('_', '-')}", keys[k])
                ]
                if settings.get("draft"):  # SGLang's own EAGLE-3 worker (docs/engines.md, "A real SGLang on CPU")
                    extra += SGLangClient.speculative_args(str(small_draft_dir), NUM_STEPS)
                log = real_logs / f"sglang-{len(started)}.log"
                server = start_sglang(
                    small_target_dir,
                    log,
                    context_length=CONTEXT,
                    max_running=slots,
                    extra=extra,
                    env={"SGLANG_REQUEST_STATE_WAIT_TIMEOUT": str(int(HELD_POLL_S))},
                )
                stack.callback(server.stop)
                url = server.url
            elif kind == "dev":
                speculative = (
                    Speculative.from_flags(draft_model_path=small_draft_dir, num_steps=NUM_STEPS)
                    if settings.get("draft")
                    else None
                )
                app = create_app(
                    small_target_dir,
                    context_length=CONTEXT,
                    max_batch_size=slots,
                    model_name="small",
                    disconnect_poll_s=poll_s,
                    sglang_version=version,
                    speculative=speculative,
                    **keys,
                )
                url = stack.enter_context(serve_app(app))
            else:
                sim = SimServer(
                    vocab_size=2048,
                    context_length=CONTEXT,
                    max_running=slots,
                    decode_s_per_token=0.005,
                    length_dist="fixed",
                    mean_len=6,
                    eos_token_id=1,
                    disconnect_poll_s=poll_s,
                    sglang_version=version,
                    reserved_tokens=RESERVED if settings.get("draft") else 0,
                    **keys,
                )
                url = stack.enter_context(sim).url
            emu = Emulation(
                kind, url, settings, headers={"Authorization": f"Bearer {keys['api_key']}"} if keys["api_key"] else {}
            )
            stack.callback(emu.pool.shutdown, wait=False)
            started[key] = emu
            return emu

        yield start
        for emu in started.values():  # nothing left running when the servers stop
            admin = emu.settings.get("admin_api_key") or emu.settings.get("api_key")
            emu.abort(abort_all=True, headers={"Authorization": f"Bearer {admin}"} if admin else {})


@pytest.fixture(params=["dev", "sim", pytest.param("real", marks=[pytest.mark.sglang, pytest.mark.multiprocess])])
def emu(request, servers):
    """`emu(**settings)`: the server of this test's kind (see `servers`); every one it started is idle afterwards."""
    used: list[Emulation] = []

    def get(**settings: Any) -> Emulation:
        server = servers(request.param, **settings)
        used.append(server)
        return server

    yield get
    for server in used:  # abort what a test left running (a failed one), then wait for quiet
        admin = server.settings.get("admin_api_key") or server.settings.get("api_key")
        server.abort(abort_all=True, headers={"Authorization": f"Bearer {admin}"} if admin else {})
        server.wait(running=0, waiting=0)


# -- responses ----------------------------------------------------------------------------------


def test_a_finished_request_has_sglangs_response_shape(emu):
    """A finished /generate is {"text", "output_ids", "meta_info"} ({"output_ids", "meta_info"} from a server
    started with --skip-tokenizer-init, as /server_info says) with meta_info's keys in SGLang's order, counts
    that match the ids, and the rid as "id" (managers/tokenizer_manager.py `_handle_batch_output`)."""
    s = emu()
    r = s.generate(
        {"input_ids": [11, 12, 13, 14], "rid": "shape", "sampling_params": {"max_new_tokens": 5, "temperature": 0}}
    )
    assert r.status_code == 200
    out = r.json()
    skip_tokenizer = s.get("/server_info").json()["skip_tokenizer_init"]
    assert list(out) == ["output_ids", "meta_info"] if skip_tokenizer else ["text", "output_ids", "meta_info"]
    meta = out["meta_info"]
    assert list(meta) == FINISHED_META
    n = len(out["output_ids"])
    assert meta["id"] == "shape" and meta["prompt_tokens"] == 4 and meta["completion_tokens"] == n >= 1
    assert meta["finish_reason"]["type"] in ("stop", "length") and meta["weight_version"] == "default"
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": n}]
    assert meta["num_retractions"] == meta["cached_tokens"] == meta["reasoning_tokens"] == 0
    assert isinstance(meta["e2e_latency"], float) and isinstance(out.get("text", ""), str)
    assert meta["cached_tokens_details"] is None and meta["dp_rank"] is None
    assert 0 < meta["response_sent_to_client_ts"] - time.time() + 60 < 120  # a wall-clock timestamp, now


def test_server_info_is_flat_and_the_queue_counts_are_in_v1_loads(emu):
    """/server_info (and its old name /get_server_info) is one flat body: the version (an emulation's own), the
    server args (context_length, max_running_requests, skip_tokenizer_init as started) and max_req_input_len =
    context - 1 - 5
    at the top level (entrypoints/http_server.py `get_server_info`; managers/scheduler.py max_req_len,
    max_req_input_len); internal_states holds no queue counts: GET /v1/loads does (entrypoints/v1_loads.py), as the
    real server answered."""
    s = emu(slots=1)
    info, old = s.get("/server_info").json(), s.get("/get_server_info").json()
    assert info["version"] == old["version"] == ("0.5.23" if s.kind == "real" else info["version"])  # ours: our own
    assert info["max_req_input_len"] == old["max_req_input_len"] == CONTEXT - 6
    assert info["context_length"] == CONTEXT and info["max_running_requests"] == 1
    assert isinstance(info["skip_tokenizer_init"], bool) and len(info["internal_states"]) == 1
    assert not {"num_running_reqs", "num_waiting_reqs"} & set(info["internal_states"][0])
    running = s.background(long_body("counted"))
    queued = s.background(long_body("waiting", [9, 10]))
    s.wait(running=1, waiting=1)  # /v1/loads: loads[0].num_running_reqs, num_waiting_reqs
    assert s.get("/v1/loads").json()["loads"][0]["max_running_requests"] == 1
    s.abort("waiting"), s.abort("counted")
    assert queued.result(timeout=30).status_code == running.result(timeout=30).status_code == 200


def test_a_batch_is_answered_in_input_order(emu):
    """A batch /generate returns a JSON list in input order, however the items finish
    (managers/tokenizer_manager.py `_handle_batch_request` gathers the items' waiters in order)."""
    s = emu()
    lengths = [5, 2, 4]  # the second finishes first
    r = s.generate(
        {
            "input_ids": [[21, 22], [23], [24, 25, 26]],
            "rid": ["b0", "b1", "b2"],
            "sampling_params": [{"max_new_tokens": n, "ignore_eos": True, "temperature": 0} for n in lengths],
        }
    )
    assert r.status_code == 200
    outs = r.json()
    assert [o["meta_info"]["id"] for o in outs] == ["b0", "b1", "b2"]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == lengths
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [2, 1, 3]


def _stop_at_the_cap(s: Emulation) -> tuple[dict[str, Any], int, list[int]]:
    """A request whose stop token is exactly its max_new_tokens-th token: (body, that token, the ids)."""
    ref = s.generate({"input_ids": [31, 32, 33], "sampling_params": {"max_new_tokens": 8, "temperature": 0}}).json()
    ids, finish = ref["output_ids"], ref["meta_info"]["finish_reason"]
    if finish["type"] == "stop":  # the model's own EOS (the sim's natural end): max_new_tokens = where it came
        return (
            {"input_ids": [31, 32, 33], "sampling_params": {"max_new_tokens": len(ids), "temperature": 0}},
            ids[-1],
            ids,
        )
    token = ids[3]  # else a stop token the greedy output reaches: its first occurrence
    n = ids.index(token) + 1
    params = {"max_new_tokens": n, "temperature": 0, "stop_token_ids": [token]}
    return {"input_ids": [31, 32, 33], "sampling_params": params}, token, ids[:n]


@pytest.mark.parametrize("version", ["0.5", "0.4"])
def test_a_stop_token_at_max_new_tokens_finishes_stop(emu, version):
    """A stop token is checked before the length cap, so an EOS/stop token that is exactly the
    max_new_tokens-th token finishes "stop" (managers/schedule_batch.py `Req.update_finish_state`);
    0.4.x checked the length first: "length" (0.4.10 schedule_batch.py `Req.check_finished`)."""
    s = emu(slots=1, version=version)
    body, token, ids = _stop_at_the_cap(s)
    out = s.generate(body).json()
    assert out["output_ids"] == ids and out["output_ids"][-1] == token
    expected = {"type": "stop", "matched": token} if version == "0.5" else {"type": "length", "length": len(ids)}
    assert out["meta_info"]["finish_reason"] == expected


# -- aborts -------------------------------------------------------------------------------------


@pytest.mark.parametrize("version", ["0.5", "0.4"])
def test_a_queued_abort_is_answered_without_prompt_tokens(emu, version):
    """A request aborted while still queued is answered 200 as managers/tokenizer_manager.py `_handle_abort_req`
    builds it: finish_reason {"type": "abort", "message": "Abort in waiting queue"}, output_ids [], no
    prompt_tokens; 0.4.x sent "Abort before prefill", prompt_tokens 0 and no output_ids (0.4.10, same function)."""
    s = emu(slots=1, version=version)
    running = s.background(long_body("slot"))
    s.wait(running=1)
    queued = s.background(long_body("queued", [8, 9]))
    s.wait(running=1, waiting=1)
    assert s.abort("queued").status_code == 200
    r = queued.result(timeout=30)
    assert r.status_code == 200
    out = r.json()
    if version == "0.5":
        assert list(out) == ["text", "output_ids", "meta_info"] and out["text"] == "" and out["output_ids"] == []
        assert list(out["meta_info"]) == [
            "id",
            "finish_reason",
            "weight_version",
            "e2e_latency",
            "weight_versions",
            "completion_tokens",
            "response_sent_to_client_ts",
        ]
        assert out["meta_info"]["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert out["meta_info"]["completion_tokens"] == 0 and out["meta_info"]["e2e_latency"] > 0
    else:
        assert out == {
            "text": "",
            "meta_info": {
                "id": "queued",
                "finish_reason": {"type": "abort", "message": "Abort before prefill"},
                "prompt_tokens": 0,
                "completion_tokens": 0,
            },
        }
    assert out["meta_info"]["id"] == "queued"
    assert s.abort("slot").status_code == 200
    assert running.result(timeout=30).json()["meta_info"]["finish_reason"]["type"] == "abort"


def test_a_running_abort_finishes_through_the_normal_output_path(emu):
    """A running request aborted by /abort_request finishes like any other, prompt_tokens and the tokens so far
    included, with FINISH_ABORT().to_json() as its finish_reason (managers/scheduler.py `abort_request` sets
    req.to_finish = FINISH_ABORT(); managers/schedule_batch.py `FINISH_ABORT.to_json`)."""
    s = emu(slots=1)
    running = s.background(long_body("run", [41, 42, 43, 44, 45]))
    s.wait(running=1)
    assert s.abort("run").status_code == 200
    out = running.result(timeout=30).json()
    meta = out["meta_info"]
    assert list(meta) == FINISHED_META and meta["finish_reason"] == FINISH_ABORT
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == len(out["output_ids"]) < LONG


def test_abort_request_matches_by_rid_prefix_and_only_a_held_rid(emu):
    """/abort_request reaches the scheduler only for an exact rid the server holds, and an empty rid without
    abort_all is ignored (managers/tokenizer_manager.py `abort_request`); the scheduler then aborts every
    waiting and running request whose rid startswith it (managers/scheduler.py `abort_request`)."""
    s = emu()
    rids = ["a:1", "a:10", "a:123", "a:2"]
    replies = {rid: s.background(long_body(rid, [50 + i])) for i, rid in enumerate(rids)}
    s.wait(running=4)
    assert s.abort("a:").status_code == 200  # a prefix of them all, but not a rid the server holds: nothing
    assert s.abort("").status_code == 200  # ignored
    assert s.abort("a:1").status_code == 200
    for rid in ("a:1", "a:10", "a:123"):
        assert replies[rid].result(timeout=30).json()["meta_info"]["finish_reason"] == FINISH_ABORT
    s.wait(running=1)  # a:2 runs on: the two no-op aborts before did not reach it either
    assert not replies["a:2"].done()
    assert s.abort("a:2").status_code == 200
    assert replies["a:2"].result(timeout=30).json()["meta_info"]["finish_reason"] == FINISH_ABORT


# -- request ids --------------------------------------------------------------------------------


def test_a_held_rid_is_refused_as_a_duplicate(emu):
    """A /generate whose rid the server still holds -- or with one such rid in a batch -- is refused 400
    {"error": {"message": "Duplicate request ID detected: <rid>"}} (managers/tokenizer_manager.py
    `_init_req_state`; entrypoints/http_server.py `_create_error_response`), a rid repeated inside the batch with
    "Duplicate request IDs detected within the request: [<rids>]" (managers/io_struct.py, the batch check);
    the rid is free again once its request has finished."""
    s = emu(slots=1)
    running = s.background(long_body("dup"))
    s.wait(running=1)
    quick = {"sampling_params": {"max_new_tokens": 2, "temperature": 0}}
    for body, message in (
        ({"input_ids": [1, 2], "rid": "dup"}, "Duplicate request ID detected: dup"),
        ({"input_ids": [[1], [2]], "rid": ["fresh", "dup"]}, "Duplicate request ID detected: dup"),
        (
            {"input_ids": [[1], [2]], "rid": ["twice", "twice"]},
            "Duplicate request IDs detected within the request: ['twice']",
        ),
    ):
        r = s.generate({**body, **quick})
        assert r.status_code == 400 and r.json() == {"error": {"message": message}}
    assert s.abort("dup").status_code == 200
    running.result(timeout=30)
    # Nothing of the refused batches is held; "dup" is free again.
    for rid in ("fresh", "twice", "dup"):
        assert s.generate({"input_ids": [3], "rid": rid, **quick}).status_code == 200


def test_a_disconnected_clients_rid_stays_held_until_the_poll(emu):
    """SGLang notices a client that went away only when its wait for the output times out, every
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT (srt/environ.py: 4 s) from the request's start
    (managers/tokenizer_manager.py `_stream_one_response`), then aborts it: until then the request runs and
    a re-send with its rid is refused as a duplicate."""
    s = emu(slots=1, poll=HELD_POLL_S)
    body = json.dumps(long_body("gone")).encode()
    host, port = s.url.removeprefix("http://").split(":")
    sent = time.monotonic()
    with socket.create_connection((host, int(port)), timeout=10) as sock:  # raw HTTP, then hang up
        sock.sendall(
            b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        s.wait(running=1)
    r = s.generate({"input_ids": [4], "rid": "gone", "sampling_params": {"max_new_tokens": 1}})
    assert time.monotonic() - sent < HELD_POLL_S, "the re-send came after the first poll: the machine is too slow"
    assert r.status_code == 400 and r.json() == {"error": {"message": "Duplicate request ID detected: gone"}}
    s.wait(running=0, timeout=HELD_POLL_S + 10)  # the poll noticed and aborted it
    freed = time.monotonic() - sent
    assert HELD_POLL_S - 0.05 <= freed < HELD_POLL_S + 5, freed  # not before the poll; not its natural end
    assert s.generate({"input_ids": [4], "rid": "gone", "sampling_params": {"max_new_tokens": 1}}).status_code == 200


# -- API keys -----------------------------------------------------------------------------------


def test_with_an_admin_key_abort_request_takes_only_the_admin_key(emu):
    """With --admin-api-key, /abort_request (ADMIN_OPTIONAL, entrypoints/http_server.py) takes only the admin
    key: the api key gets 401 {"error": "Unauthorized"} and aborts nothing; the admin key gets 200 and the abort
    happens (srt/utils/auth.py `decide_request_auth`, `add_api_key_middleware`)."""
    s = emu(slots=1, api_key=USER, admin_api_key=ADMIN)
    running = s.background(long_body("guarded"))
    s.wait(running=1)
    r = s.abort("guarded")  # the api key
    assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
    assert s.post("/flush_cache", headers={}).status_code == 401
    s.wait(running=1)
    assert not running.done()
    assert s.abort("guarded", headers={"Authorization": f"Bearer {ADMIN}"}).status_code == 200
    assert running.result(timeout=30).json()["meta_info"]["finish_reason"] == FINISH_ABORT


def test_health_endpoints_are_open_with_keys_set(emu):
    """/health* answer without a key even when keys are set, every other endpoint wants the api key (NORMAL;
    the admin key does not open it) (srt/utils/auth.py `decide_request_auth`)."""
    s = emu(slots=1, api_key=USER, admin_api_key=ADMIN)
    for path in ("/health", "/health_generate"):
        assert s.get(path, headers={}).status_code == 200
    for headers in ({}, {"Authorization": f"Bearer {ADMIN}"}, {"Authorization": "Bearer wrong"}):
        r = s.generate({"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, headers=headers)
        assert r.status_code == 401 and r.json() == {"error": "Unauthorized"}
        assert s.get("/server_info", headers=headers).status_code == 401
    assert s.get("/server_info").status_code == 200 and s.get("/model_info").status_code == 200
    r = s.generate(
        {"input_ids": [1], "sampling_params": {"max_new_tokens": 1}}, headers={"Authorization": f"bearer {USER}"}
    )
    assert r.status_code == 200  # the bearer scheme is case-insensitive


# -- bad input ----------------------------------------------------------------------------------


def test_bad_input_gets_one_of_three_400_bodies(emu):
    """Bad input is a 400 in one of three shapes: a ValueError's {"error": {"message"}} (entrypoints/http_server.py
    `_create_error_response`), the API schema's {"error": "<text>"} for a body the GenerateReqInput dataclass
    admits but api/v1/api_types.py refuses (http_server.py `generate_request` -> entrypoints/api_contract.py
    `generate_contract_error`), and FastAPI's validation body for what the dataclass refuses
    (http_server.py `validation_exception_handler`)."""
    s = emu()
    r = s.generate({"input_ids": [5] * (CONTEXT + 3)})
    assert r.status_code == 400 and r.json() == {
        "error": {
            "message": (
                f"The input ({CONTEXT + 3} tokens) is longer than the model's context length ({CONTEXT} tokens)."
            )
        }
    }
    r = s.generate({"input_ids": [5], "sampling_params": {"max_new_tokens": 2, "temprature": 0}})
    assert r.status_code == 400
    assert r.json() == {
        "error": "unknown field `temprature`, expected one of `max_new_tokens`, `stop`, `stop_token_ids`, "
        "`stop_regex`, `temperature`, `top_p`, `top_k`, `min_p`, `frequency_penalty`, "
        "`presence_penalty`, `repetition_penalty`, `min_new_tokens`, `n`, `json_schema`, `regex`, "
        "`ebnf`, `structural_tag`, `ignore_eos`, `skip_special_tokens`, "
        "`spaces_between_special_tokens`, `no_stop_trim`, `stream_interval`, `logit_bias`, "
        "`sampling_seed`, `custom_params`, `beam_width`, `watermark`, `choice`"
    }
    r = s.generate({"input_ids": [5, True]})  # passes the dataclass's int64 check, not the schema
    assert r.status_code == 400 and r.json() == {"error": "invalid type: boolean `true`, expected i64"}
    r = s.generate({"input_ids": [5], "sampling_params": {"temperature": "hot"}})
    assert r.status_code == 400 and r.json() == {"error": 'invalid type: string "hot", expected f64'}
    r = s.post("/generate", content=b'{"input_ids": [1, 2')
    assert r.status_code == 400
    body = r.json()
    assert set(body) == {"object", "message", "type", "param", "code"}
    assert (body["object"], body["type"], body["param"], body["code"]) == ("error", "Bad Request", None, 400)
    r = s.generate({"input_ids": "5 6"})
    assert r.status_code == 400 and r.json()["type"] == "Bad Request"


def test_flush_cache_only_when_idle(emu):
    """/flush_cache flushes (200) only when no request is running or waiting, else 400 "Flush cache failed."
    (managers/scheduler.py `flush_cache`, entrypoints/http_server.py `flush_cache`)."""
    s = emu(slots=1)
    r = s.post("/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")
    running = s.background(long_body("busy"))
    s.wait(running=1)
    r = s.post("/flush_cache")
    assert r.status_code == 400 and r.text == "Flush cache failed.\n"
    s.abort("busy")
    running.result(timeout=30)


# -- a server with an EAGLE draft ---------------------------------------------------------------


def test_an_eagle_draft_reserves_tokens_in_the_length_checks(emu):
    """With an EAGLE draft the tokenizer manager adds compute_num_reserved_tokens() = max(topk * num_steps,
    num_draft_tokens) to the prompt in both of its length checks (managers/tokenizer_manager.py
    `_validate_one_request`; managers/utils.py `compute_num_reserved_tokens`), so a prompt near the limit is
    refused only by the server with the draft. The dev server and the real SGLang serve a real draft; the sim
    reserves the same tokens (SimConfig.reserved_tokens)."""
    plain, eagle = emu(), emu(draft=True)
    n, new = CONTEXT - 10, 10  # n + new == CONTEXT: allowed; with the reserve it is not
    body = {"input_ids": [7] * n, "sampling_params": {"max_new_tokens": new, "temperature": 0}}
    assert plain.generate(body).status_code == 200
    r = eagle.generate(body)
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith(
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. You requested a "
        f"total of {n + RESERVED + new} tokens: {n + RESERVED} tokens from the input messages and {new} tokens for "
        "the completion."
    )
    ok = {"input_ids": [7] * n, "sampling_params": {"max_new_tokens": new - RESERVED, "temperature": 0}}
    assert eagle.generate(ok).status_code == 200


@pytest.mark.parametrize(  # the sim decodes no draft: it has no such figure
    "emu", ["dev", pytest.param("real", marks=[pytest.mark.sglang, pytest.mark.multiprocess])], indirect=True
)
def test_avg_spec_accept_length_is_folded_every_40_decode_batches(emu, small_target, small_draft_dir):
    """internal_states[0].avg_spec_accept_length in /server_info is lifetime accept tokens / lifetime forward count,
    where the per-interval counters (tokens per verify round, forward count += batch size) are folded into the
    lifetime ones only every decode_log_interval (40) decode batches (managers/scheduler_components/
    metrics_reporter.py `update_spec_metrics`, `report_decode_stats`; internal_state.py `_average_accept_length`):
    absent until the first fold; a /flush_cache on an idle server resets it (scheduler.py `flush_cache` ->
    `reset_metrics`)."""
    from models.eval.speculative_decoding import speculative_decode
    from models.export.eagle3 import load_exported_draft
    from tests.emulators.test_dev_server_spec import folded_avg

    s = emu(draft=True)
    assert s.post("/flush_cache").status_code == 200  # whatever other tests sent, start from nothing
    assert "avg_spec_accept_length" not in s.internal_state()
    draft = load_exported_draft(small_draft_dir, dtype=torch.float32).eval()
    params = {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0}
    kept: list[int] = []  # tokens per verify round, in serving order
    seen_absent = seen_present = False
    for i in range(12):
        prompt = [100 + i, 200 + i, 300 + i]
        out = s.generate({"input_ids": prompt, "sampling_params": params}).json()
        _, rounds = speculative_decode(
            small_target, draft, prompt, num_steps=NUM_STEPS, max_new_tokens=16, eos_token_ids=set()
        )
        assert out["meta_info"]["spec_verify_ct"] == len(rounds)  # one decode batch of size 1 per round
        kept += [r.kept for r in rounds]
        avg = s.internal_state().get("avg_spec_accept_length")
        assert avg == folded_avg(kept, 40), (len(kept), avg)
        seen_absent |= avg is None
        seen_present |= avg is not None and len(kept) % 40 != 0  # rounds since the last fold are not in it
    assert seen_absent and seen_present and len(kept) >= 80
    assert s.post("/flush_cache").status_code == 200
    assert "avg_spec_accept_length" not in s.internal_state()
