"""The SGLang protocol shared by the dev and sim servers, as plain functions."""

from __future__ import annotations

import json

import pytest

from deploy.sglang_protocol import (
    BadRequest,
    MalformedRequest,
    ModelLimits,
    SamplingParams,
    error_response,
    finish_length,
    finish_stop,
    generate_result,
    parse_abort,
    parse_generate,
    parse_sampling_params,
    text_token_ids,
)


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_single_and_batch_requests_are_split_into_items():
    single = parse_generate(body(input_ids=[5, 6], rid="r", sampling_params={"max_new_tokens": 3}), server="x")
    assert single.single and single.prompts == [[5, 6]] and single.rids == ["r"]
    assert single.sampling_params == [{"max_new_tokens": 3}]

    batch = parse_generate(body(input_ids=[[5], [6, 7]], sampling_params=[{"top_k": 1}, None]), server="x")
    assert not batch.single and batch.prompts == [[5], [6, 7]]
    assert batch.sampling_params == [{"top_k": 1}, None]
    assert len(set(batch.rids)) == 2 and all(len(r) == 32 for r in batch.rids)  # uuid hex each

    shared = parse_generate(body(text=["a", "b"], sampling_params={"top_p": 0.5}), server="x")
    assert shared.prompts == ["a", "b"] and shared.sampling_params == [{"top_p": 0.5}] * 2


@pytest.mark.parametrize(
    "raw, error, message",
    [
        (b"{not json", MalformedRequest, "JSON decode error"),
        (b"[1, 2]", MalformedRequest, "The request body must be a JSON object."),
        (body(input_ids=[1], stream=True), BadRequest,
         "stream=True is not supported by the eagle3 test server; use stream=false."),
        (body(), BadRequest, "Either text, input_ids or input_embeds should be provided."),
        (body(input_ids=[1], text="a"), BadRequest, "Either text, input_ids or input_embeds should be provided."),
        (body(input_ids=[]), BadRequest, "input_ids cannot be empty."),
        (body(input_ids=[1, True]), MalformedRequest, "input_ids must be a list of ints"),  # JSON true is no id
        (body(input_ids=[1, [2]]), MalformedRequest, "input_ids must be a list of ints"),
        (body(input_ids="1 2"), MalformedRequest, "input_ids must be a list of ints"),
        (body(text=[]), BadRequest, "The batch is empty."),
        (body(text=3), MalformedRequest, "text must be a string or a list of strings"),
        (body(input_ids=[1], sampling_params=[{}]), BadRequest, "sampling_params has 1 entries for a batch of 1."),
        (body(input_ids=[[1], [2]], rid=["a"]), BadRequest, "rid has 1 entries for a batch of 2."),
        (body(input_ids=[1], rid=["a"]), MalformedRequest, "rid must be a string (single request)"),
    ],
)
def test_bad_generate_bodies_raise_sglang_errors(raw, error, message):
    with pytest.raises(error) as exc:
        parse_generate(raw, server="test server")
    assert type(exc.value) is error and message in str(exc.value)


def test_a_server_without_tokenizer_refuses_text_first():
    with pytest.raises(BadRequest, match="^The sim server has no tokenizer: send input_ids, not text.$"):
        parse_generate(body(text="a", input_ids=[1]), server="sim server", accepts_text=False)


def test_sampling_params_defaults_nulls_and_checks():
    assert parse_sampling_params(None) == SamplingParams() == parse_sampling_params({})
    assert SamplingParams().max_new_tokens == 128 and SamplingParams().skip_special_tokens is True
    # null means "the default", except max_new_tokens: null there means "up to the context".
    assert parse_sampling_params({"temperature": None, "max_new_tokens": None}) == SamplingParams(max_new_tokens=None)
    p = parse_sampling_params({"temperature": 0, "stop_token_ids": [9, 3], "no_stop_trim": True})
    assert p.greedy and p.stop_token_ids == (9, 3) and p.no_stop_trim
    assert parse_sampling_params(p) is p
    with pytest.raises(MalformedRequest, match="sampling_params.top_k must be a number"):
        parse_sampling_params({"top_k": 1.5})
    with pytest.raises(MalformedRequest, match="sampling_params.ignore_eos must be a boolean"):
        parse_sampling_params({"ignore_eos": 1})
    with pytest.raises(BadRequest, match=r"^temperature must be a non-negative finite number, got -1.0.$"):
        parse_sampling_params({"temperature": -1})


def test_unimplemented_sampling_params_are_refused_only_when_asked():
    raw = {"stop": ["x"], "frequency_penalty": 0.0, "n": 1}
    assert parse_sampling_params(raw) == SamplingParams()  # the simulation ignores them
    with pytest.raises(BadRequest, match=r"^sampling_params not supported by the dev server: \['stop'\]$"):
        parse_sampling_params(raw, unimplemented_by="dev server")
    noop = {"stop": [], "frequency_penalty": 0, "n": 1}
    assert parse_sampling_params(noop, unimplemented_by="dev server") == SamplingParams()


def test_model_limits_follow_sglangs_scheduler():
    limits = ModelLimits(vocab_size=100, context_length=64)
    assert limits.max_req_len == 63 and limits.max_req_input_len == 58
    params = SamplingParams(max_new_tokens=None)
    assert limits.max_new_tokens(10, params) == 63 - 10 - 1
    assert limits.max_new_tokens(10, SamplingParams(max_new_tokens=5)) == 5
    assert limits.max_new_tokens(70, params) == 0  # never negative
    assert limits.admit([1, 2], {"max_new_tokens": 4}) == SamplingParams(max_new_tokens=4)
    with pytest.raises(BadRequest, match=r"^The input_ids \[1, 100\] contains values greater than the vocab"):
        limits.admit([1, 100], None)
    with pytest.raises(BadRequest, match=r"^The input_ids \[-1\] contains negative values.$"):
        limits.admit([-1], None)
    with pytest.raises(BadRequest, match=r"^The input \(64 tokens\) is longer than the model's context length"):
        limits.admit([1] * 64, None)
    with pytest.raises(BadRequest, match="^Requested token count exceeds .* You requested a total of 74 tokens"):
        limits.admit([1] * 10, {"max_new_tokens": 64})
    with pytest.raises(BadRequest, match=r"^Input length \(58 tokens\) exceeds the maximum allowed length \(58"):
        limits.admit([1] * 58, {"max_new_tokens": 1})


def test_response_shapes():
    assert text_token_ids([4, 5, 1], finish_stop(1), no_stop_trim=False) == [4, 5]
    assert text_token_ids([4, 5, 1], finish_stop(1), no_stop_trim=True) == [4, 5, 1]
    assert text_token_ids([4, 5], finish_length(2), no_stop_trim=False) == [4, 5]
    result = generate_result(rid="r", text="t", output_ids=[4, 5], finish_reason=finish_length(2), prompt_tokens=3,
                             e2e_latency=0.5)
    assert result == {"text": "t", "output_ids": [4, 5], "meta_info": {
        "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3, "completion_tokens": 2,
        "cached_tokens": 0, "reasoning_tokens": 0, "e2e_latency": 0.5}}


def test_error_bodies_have_sglangs_two_shapes():
    assert json.loads(error_response(400, "bad").body) == {"error": {"message": "bad"}}
    r = error_response(503, "down")
    assert r.status_code == 503
    assert json.loads(r.body) == {"object": "error", "message": "down", "type": "503", "param": None, "code": 503}


def test_abort_bodies():
    assert parse_abort(b"") == (None, False)
    assert parse_abort(body(rid="r")) == ("r", False)
    assert parse_abort(body(abort_all=True)) == (None, True)
    with pytest.raises(MalformedRequest, match="The request body must be a JSON object."):
        parse_abort(b"[]")
