"""The vLLM client's requests and reply checks, against an in-process transport answering as vLLM 0.32 does.

The reply bodies are the shapes the real vLLM 0.32.0 CPU build answered on this project's tiny target
(tests/tasks/serving/test_vllm_real.py runs the same rules against the real server).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from tasks.serving.client import RetryPolicy
from tasks.serving.errors import BadRequest, InvalidReply, ServerRefused
from tasks.serving.vllm import VLLMClient, completion_body

PROMPT = [5, 17, 33]
PARAMS = {
    "max_new_tokens": 8,
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": -1,
    "stop_token_ids": [1],
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "sampling_seed": 7,
}
MODELS = {
    "object": "list",
    "data": [
        {
            "id": "runs/tiny-target",
            "object": "model",
            "owned_by": "vllm",
            "root": "runs/tiny-target",
            "parent": None,
            "max_model_len": 64,
        }
    ],
}


def reply(token_ids=(291, 550, 1), finish="stop", stop_reason=None, prompt=PROMPT, **extra) -> dict:
    """A /v1/completions reply with return_token_ids, as vLLM 0.32 sends it."""
    return {
        "id": "cmpl-x",
        "object": "text_completion",
        "created": 1,
        "model": "runs/tiny-target",
        "choices": [
            {
                "index": 0,
                "text": "Hi",
                "logprobs": None,
                "finish_reason": finish,
                "stop_reason": stop_reason,
                "token_ids": list(token_ids),
                "prompt_logprobs": None,
                "prompt_token_ids": list(prompt),
            }
        ],
        "usage": {
            "prompt_tokens": len(prompt),
            "total_tokens": len(prompt) + len(token_ids),
            "completion_tokens": len(token_ids),
            "prompt_tokens_details": None,
        },
        **extra,
    }


class Server:
    """Answers /v1/models with MODELS and /v1/completions from a list (repeating the last); keeps the bodies."""

    def __init__(self, *answers, models=MODELS):
        self.answers = list(answers)
        self.models = models
        self.bodies: list[dict] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=self.models)
        self.bodies.append(json.loads(request.content))
        status, body = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        return httpx.Response(status, json=body)


def run(server: Server, coro_fn, **kw):
    async def go():
        retry = RetryPolicy(initial_s=0.001, max_s=0.01, outage_window_s=0.2)
        async with VLLMClient("http://vllm.test:8000", retry=retry, transport=httpx.MockTransport(server), **kw) as c:
            return await coro_fn(c)

    return asyncio.run(go())


def test_sampling_params_are_translated_to_vllm_fields_and_unknown_ones_refused():
    body = completion_body("m", PROMPT, PARAMS, "rid-1")
    assert body == {
        "model": "m",
        "prompt": PROMPT,
        "return_token_ids": True,
        "request_id": "rid-1",
        "max_tokens": 8,
        "temperature": 0.0,
        "top_p": 1.0,
        "top_k": -1,
        "stop_token_ids": [1],
        "skip_special_tokens": False,
        "seed": 7,
    }
    # vLLM accepts unknown fields and ignores them: a name it lacks must not be dropped in silence
    with pytest.raises(ValueError, match="ignore_me.*no vLLM"):
        completion_body("m", PROMPT, {**PARAMS, "ignore_me": 1}, "r")


def test_a_reply_is_parsed_with_the_served_model_named_and_the_stop_id_checked():
    server = Server((200, reply(token_ids=(291, 400), stop_reason=400)))
    done = run(server, lambda c: c.attempt(PROMPT, PARAMS, "rid-1"))
    assert done.output_ids == [291, 400] and done.finish_reason == "stop" and done.finish_detail["matched"] == 400
    assert (done.prompt_tokens, done.completion_tokens, done.spec_verify_ct) == (3, 2, None)
    assert server.bodies[0]["model"] == "runs/tiny-target"  # from /v1/models
    with pytest.raises(InvalidReply, match="stop_token"):  # stop id 400 claimed, another id last
        run(Server((200, reply(token_ids=(291, 5), stop_reason=400))), lambda c: c.attempt(PROMPT, PARAMS, "r"))


@pytest.mark.parametrize(
    "bad, kind",
    [
        (reply(prompt=[5, 17, 34]), "prompt_ids"),  # generated for other ids than sent
        (reply(finish="repetition"), "finish_reason"),  # a reason we never asked for
        (
            {**reply(), "choices": [{**reply()["choices"][0], "token_ids": None}]},
            "output_ids",
        ),  # return_token_ids ignored
        (reply(token_ids=tuple(range(9))), "too_many_tokens"),  # more than max_tokens
    ],
)
def test_impossible_replies_are_invalid(bad, kind):
    with pytest.raises(InvalidReply) as err:
        run(Server((200, bad)), lambda c: c.attempt(PROMPT, PARAMS, "r"))
    assert err.value.kind == kind


def test_the_spec_decode_counts_of_a_reply_are_its_verify_rounds():
    metrics = {
        "speculative_decoding": {
            "num_spec_steps": 2,
            "num_accepted_draft_tokens": 1,
            "mean_acceptance_length": 1.5,
            "acceptance_histogram": [1, 1],
        }
    }
    done = run(Server((200, reply(metrics=metrics))), lambda c: c.attempt(PROMPT, PARAMS, "r"))
    assert done.spec_verify_ct == 2 and done.spec_accepted is None  # summary: no per-step list


def test_detailed_spec_decode_counts_are_the_accepted_drafts_of_each_verify_round_in_order():
    # vLLM 0.32 RequestSpecDecodeMetrics.to_dict at `detailed`: summary's keys plus per_step_accepted/per_step_drafted,
    # one entry per observed step (v1/metrics/stats.py)
    spec = {
        "num_spec_steps": 2,
        "num_accepted_draft_tokens": 1,
        "num_draft_tokens": 6,
        "num_spec_tokens": 3,
        "mean_acceptance_length": 1.5,
        "draft_acceptance_rate": 1 / 6,
        "acceptance_histogram": [1, 1, 0, 0],
        "per_step_accepted": [1, 0],
        "per_step_drafted": [3, 3],
    }
    done = run(Server((200, reply(metrics={"speculative_decoding": spec}))), lambda c: c.attempt(PROMPT, PARAMS, "r"))
    assert (done.spec_verify_ct, done.spec_accepted) == (2, (1, 0))
    for bad, said in (([1], "has 1 steps but num_spec_steps is 2"), ([1, -1], "non-negative ints"), ("10", "list")):
        lying = {"speculative_decoding": {**spec, "per_step_accepted": bad}}
        with pytest.raises(InvalidReply, match=said):
            run(Server((200, reply(metrics=lying))), lambda c: c.attempt(PROMPT, PARAMS, "r"))


def test_max_new_tokens_above_the_context_stops_the_run_before_anything_is_sent():
    # vLLM answers max_tokens > max_model_len with a 400 for every prompt: that is the run's fault, not a prompt's
    server = Server((200, reply()))
    with pytest.raises(ServerRefused, match="max_new_tokens 100 is above the server's max_model_len 64"):
        run(server, lambda c: c.attempt(PROMPT, {**PARAMS, "max_new_tokens": 100}, "r"))
    assert server.bodies == []


def test_a_too_long_prompt_is_a_bad_request_that_says_so():
    message = (
        "This model's maximum context length is 64 tokens. However, your prompt contains at least 65 input tokens, "
        "which exceeds this limit even without any output tokens."
    )
    err = {"error": {"message": message, "type": "BadRequestError", "param": "input_tokens", "code": 400}}
    with pytest.raises(BadRequest) as e:
        run(Server((400, err)), lambda c: c.attempt(PROMPT, PARAMS, "r"))
    assert e.value.too_long and e.value.message == message


def test_a_wrong_model_name_stops_the_run():
    with pytest.raises(ServerRefused, match="serves runs/tiny-target, not 'other'"):
        run(Server((200, reply())), lambda c: c.attempt(PROMPT, PARAMS, "r"), model="other")


def test_an_answer_cut_by_the_context_is_recorded_and_said_once(caplog):
    # vLLM cuts max_tokens to max_model_len - prompt (entrypoints/serve/utils/api_utils.py get_max_tokens)
    cut = reply(token_ids=(5, 6), finish="length")
    with caplog.at_level("WARNING", logger="eagle3.engine"):
        done = run(
            Server((200, cut)), lambda c: asyncio.gather(*(c.attempt(PROMPT, PARAMS, f"r{i}") for i in range(3)))
        )
    assert [d.finish_reason for d in done] == ["length"] * 3
    said = [r.getMessage() for r in caplog.records if "cuts max_tokens" in r.getMessage()]
    assert len(said) == 1 and "2 of the 8 tokens asked" in said[0]


def test_abort_is_by_closing_the_connection(caplog):
    async def go(c):
        return [await c.abort("r") for _ in range(2)], c.can_abort

    with caplog.at_level("INFO", logger="eagle3.engine"):
        answers, can_abort = run(Server((200, reply())), go)
    assert answers == [False, False] and not can_abort
    assert sum("closing their connection" in r.getMessage() for r in caplog.records) == 1


def test_limits_come_from_v1_models():
    limits = run(Server((200, reply())), lambda c: c.limits())
    assert (limits.model, limits.max_input, limits.context_length, limits.reserved_tokens) == (
        "runs/tiny-target",
        64,
        64,
        0,
    )


def test_the_cpu_command_follows_the_target_s_shape(tmp_path, tiny_target_dir):
    """Kimi-K2.5's config.json (tests/kimi_k25_config.json, the published layout): text only, MLA as plain attention;
    a Llama, or a target that is not a local directory, gets the plain command."""
    from tasks.serving.vllm import cpu_command, shape_words
    from tests.kimi_k25 import CONFIG_JSON

    kimi = tmp_path / "kimi"
    kimi.mkdir()
    (kimi / "config.json").write_text(CONFIG_JSON.read_text())
    env, flags = shape_words(str(kimi))
    assert env == ["VLLM_MLA_DISABLE=1"]
    assert flags == ["--limit-mm-per-prompt", '{"image": 0, "video": 0, "vision_chunk": 0}']
    words = cpu_command("python", str(kimi))
    assert words[:5] == [
        "env",
        "VLLM_CPU_KVCACHE_SPACE=1",
        "VLLM_ENABLE_V1_MULTIPROCESSING=0",
        "VLLM_MLA_DISABLE=1",
        "python",
    ]
    assert words[-2:] == flags
    assert shape_words(str(tiny_target_dir)) == ([], [])
    assert shape_words("moonshotai/Kimi-K2.5") == ([], [])
    assert "VLLM_MLA_DISABLE=1" not in cpu_command("python", str(tiny_target_dir))
