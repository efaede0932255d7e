"""The SGLang client's status rules and reply checks, against an in-process HTTP transport."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tasks.serving.client import RID_NONCE_HEX, RetryPolicy, request_id
from tasks.serving.errors import AuthError, BadRequest, ServerOutage, ServerRefused, WrongEndpoint
from tasks.serving.sglang import SGLangClient

PROMPT = [5, 6, 7]
PARAMS = {"max_new_tokens": 8, "stop_token_ids": [1], "no_stop_trim": True}


def reply(output_ids=(11, 12, 1), **meta) -> dict:
    """A well-formed SGLang /generate reply for PROMPT; `meta` overrides meta_info fields."""
    info = {
        "id": "r",
        "prompt_tokens": len(PROMPT),
        "completion_tokens": len(output_ids),
        "finish_reason": {"type": "stop", "matched": 1},
        "cached_tokens": 0,
        "e2e_latency": 0.1,
    }
    info.update(meta)
    return {"text": "x", "output_ids": list(output_ids), "meta_info": info}


class Script:
    """Answers requests from a list of (status, body) in order, repeating the last; counts calls per path."""

    def __init__(self, *answers):
        self.answers = list(answers)
        self.calls: dict[str, int] = {}
        self.bodies: list[dict] = []  # the JSON bodies received, in order

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.calls[request.url.path] = self.calls.get(request.url.path, 0) + 1
        if request.content:
            self.bodies.append(json.loads(request.content))
        status, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        content = body if isinstance(body, bytes) else json.dumps(body).encode()
        return httpx.Response(status, content=content, headers={"content-type": "application/json"})


def client(script: Script, window: float = 0.3, **kw) -> SGLangClient:
    retry = RetryPolicy(initial_s=0.001, max_s=0.01, outage_window_s=window)
    return SGLangClient("http://sglang.test:30000", retry=retry, transport=httpx.MockTransport(script), **kw)


def generate(script: Script, **kw):
    async def go():
        async with client(script, **kw) as c:
            return await c.generate(PROMPT, PARAMS, "rid-1"), c

    return asyncio.run(go())


@pytest.mark.parametrize(
    "status, kind",
    [(401, AuthError), (403, AuthError), (404, WrongEndpoint), (405, WrongEndpoint), (409, ServerRefused)],
)
def test_statuses_that_refuse_the_run_stop_at_once_without_retry(status, kind):
    script = Script((status, {"error": {"message": "Invalid API key"}}))
    with pytest.raises(kind) as caught:
        generate(script, auth_hint="check $SGLANG_KEY (server.api_key_env)")
    assert script.calls == {"/generate": 1}  # not retried
    text = str(caught.value)
    assert f"HTTP {status} from http://sglang.test:30000/generate: Invalid API key" in text
    assert "Nothing was rejected" in text
    if kind is AuthError:
        assert "check $SGLANG_KEY (server.api_key_env)" in text
    assert not isinstance(caught.value, BadRequest)


def test_400_is_a_bad_prompt_and_says_whether_it_was_too_long():
    long = Script(
        (
            400,
            {
                "object": "error",
                "message": "The input (9000 tokens) is longer than the model's context length (8192 tokens).",
                "code": 400,
            },
        )
    )
    with pytest.raises(BadRequest) as caught:
        generate(long)
    assert caught.value.too_long and long.calls == {"/generate": 1}
    # the scheduler's words for a prompt of max_req_input_len tokens or more (SGLang 0.5.23 managers/scheduler.py)
    scheduler = Script(
        (
            400,
            {
                "error": {
                    "message": "Input length (9000 tokens) exceeds the maximum allowed length (8186 tokens). "
                    "Use a shorter input or enable --allow-auto-truncate."
                }
            },
        )
    )
    with pytest.raises(BadRequest) as caught:
        generate(scheduler)
    assert caught.value.too_long
    other = Script((400, {"error": {"message": "temperature must be non-negative"}}))
    with pytest.raises(BadRequest) as caught:
        generate(other)
    assert not caught.value.too_long and caught.value.message == "temperature must be non-negative"


def test_retryable_statuses_are_retried_until_an_answer():
    script = Script(
        (503, {"message": "queue full"}), (429, b"rate limited"), (408, b""), (500, b"boom"), (200, reply())
    )
    done, _ = generate(script)
    assert script.calls == {"/generate": 5} and done.output_ids == [11, 12, 1]


@pytest.mark.parametrize(
    "body, kind",
    [
        (reply(completion_tokens=-5), "completion_tokens"),
        (reply(completion_tokens=1000), "completion_tokens"),
        (reply(prompt_tokens=99), "prompt_tokens"),
        (reply(output_ids=(11, "12", 1)), "output_ids"),
        (reply(output_ids=(11, -2, 1)), "output_ids"),
        (reply(output_ids=(), completion_tokens=0, finish_reason={"type": "length", "length": 0}), "empty"),
        (reply(finish_reason=None), "finish_reason"),
        (reply(finish_reason={"type": "done"}), "finish_reason"),
        (reply(output_ids=tuple(range(20, 30))), "too_many_tokens"),
        (reply(output_ids=(11, 12, 13)), "stop_token"),  # says stop matched 1, but 1 is not last
        (reply(output_ids=(11, 5000, 1)), "token_id"),
        ({"text": "x"}, "shape"),
        (b"<html>proxy error</html>", "json"),
        (reply(completion_tokens=True), "completion_tokens"),
        (reply(spec_verify_ct=4), "spec_verify_ct"),  # more verify rounds than tokens
        (reply(spec_verify_ct=-1), "spec_verify_ct"),
    ],
)
def test_impossible_replies_are_retried_never_returned_then_outage(body, kind):
    script = Script((200, body))
    with pytest.raises(ServerOutage) as caught:
        generate(script, vocab_size=1000)
    assert script.calls["/generate"] >= 2  # retried: a faulty server, not a bad prompt
    assert f"invalid reply ({kind})" in str(caught.value)


def test_spec_verify_ct_is_read_when_a_draft_serves():
    done, _ = generate(Script((200, reply(spec_verify_ct=2))))
    assert done.spec_verify_ct == 2
    assert generate(Script((200, reply())))[0].spec_verify_ct is None  # no draft: SGLang sends none


def test_a_lying_reply_is_counted_and_logged_once_then_the_good_one_is_returned(caplog):
    bad = reply(completion_tokens=1000)
    script = Script((200, bad), (200, bad), (200, bad), (200, reply()))
    with caplog.at_level("WARNING", logger="eagle3.engine"):
        done, c = generate(script, window=30)
    assert done.completion_tokens == 3 and c.invalid_replies == {"completion_tokens": 3}
    assert sum("invalid reply (completion_tokens)" in r.getMessage() for r in caplog.records) == 1


def test_an_oversized_reply_is_cut_off_not_buffered():
    script = Script((200, json.dumps(reply(), indent=4).encode() + b" " * 5000), (200, reply()))
    done, c = generate(script, window=30, max_reply_bytes=4096)
    assert c.invalid_replies == {"size": 1} and done.output_ids == [11, 12, 1]


def test_an_aborted_reply_is_returned_without_the_count_checks():
    body = reply(output_ids=(11,), completion_tokens=4, finish_reason={"type": "abort", "message": "aborted"})
    done, _ = generate(Script((200, body)))
    assert done.finish_reason == "abort" and done.completion_tokens == 4


def test_health_wait_stops_at_once_on_a_refused_key_instead_of_waiting():
    script = Script((401, {"detail": "Unauthorized"}))

    async def go():
        async with client(script) as c:
            await c.wait_healthy(timeout_s=600)

    with pytest.raises(AuthError, match="HTTP 401 from http://sglang.test:30000/health_generate: Unauthorized"):
        asyncio.run(go())
    assert script.calls == {"/health_generate": 1}


def test_server_info_falls_back_to_get_server_info():
    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json={"router_manager": True, "workers_count": 2})

    async def go():
        async with SGLangClient("http://r:1", transport=httpx.MockTransport(handler)) as c:
            return await c.server_info()

    assert asyncio.run(go()) == {"router_manager": True, "workers_count": 2}


@pytest.mark.parametrize(
    "meta, output_ids",
    [
        # SGLang 0.5.23, managers/tokenizer_manager.py _handle_abort_req: a request aborted while QUEUED
        (
            {
                "id": "r",
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "weight_version": "default",
                "e2e_latency": 0.2,
                "completion_tokens": 0,
            },
            [],
        ),
        # SGLang 0.4.x: prompt_tokens 0 and no output_ids
        (
            {
                "id": "r",
                "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
                "prompt_tokens": 0,
                "completion_tokens": 0,
                "e2e_latency": 0.2,
            },
            None,
        ),
    ],
)
def test_a_queued_abort_is_an_abort_whatever_its_meta_info_lacks(meta, output_ids):
    body = {"text": "", "meta_info": meta, **({} if output_ids is None else {"output_ids": output_ids})}
    script = Script((200, body))
    done, c = generate(script)
    assert (done.finish_reason, done.output_ids, done.completion_tokens) == ("abort", [], 0)
    assert script.calls == {"/generate": 1} and c.invalid_replies == {}  # not a faulty server: no retry


def test_every_try_is_sent_with_a_fresh_rid_that_is_no_prefix_of_another():
    script = Script((503, {"message": "busy"}), (500, b"boom"), (200, reply()))
    done, _ = generate(script)
    rids = [b["rid"] for b in script.bodies]
    assert done.output_ids == [11, 12, 1] and len(rids) == 3 and len(set(rids)) == 3
    assert all(r.endswith("-rid-1") and len(r) == RID_NONCE_HEX + len("-rid-1") for r in rids)
    # SGLang's /abort_request aborts every rid that starts with the given one (managers/scheduler.py): ours never
    # start with one another, also across labels that are prefixes of each other ("ds:1" and "ds:10")
    many = rids + [request_id("ds:1") for _ in range(200)] + [request_id("ds:10") for _ in range(200)]
    assert not [(a, b) for a in many for b in many if a != b and b.startswith(a)]


def test_a_duplicate_rid_400_is_sent_again_with_a_new_rid_not_rejected():
    dup = (400, {"error": {"message": "Duplicate request ID detected: x-rid-1"}})  # tokenizer_manager.py, 0.5.23
    script = Script(dup, (200, reply()))
    done, _ = generate(script)
    assert done.output_ids == [11, 12, 1] and script.calls == {"/generate": 2}
    assert script.bodies[0]["rid"] != script.bodies[1]["rid"]


def test_the_contract_gate_s_string_error_body_gives_its_message():
    # SGLang 0.5.23 entrypoints/http_server.py generate_request: {"error": "<the schema's error text>"}
    with pytest.raises(BadRequest) as caught:
        generate(Script((400, {"error": "sampling_params.max_new_tokens: expected integer"})))
    assert caught.value.message == "sampling_params.max_new_tokens: expected integer"


@pytest.mark.parametrize("status", [401, 403, 404])
def test_an_abort_the_server_refuses_is_reported_once_and_then_not_asked_again(status, caplog):
    script = Script((status, {"error": "Unauthorized"}))

    async def go():
        async with client(script) as c:
            return [await c.abort(request_id("ds:1")) for _ in range(3)], c.can_abort

    with caplog.at_level("INFO", logger="eagle3.engine"):
        answers, can_abort = asyncio.run(go())
    # False: the caller stops the request by closing its connection instead (before: True, as if aborted)
    assert answers == [False, False, False] and not can_abort
    assert script.calls == {"/abort_request": 1}
    said = [r.getMessage() for r in caplog.records if "abort_request" in r.getMessage()]
    assert len(said) == 1 and ("--admin-api-key" in said[0]) == (status != 404)
