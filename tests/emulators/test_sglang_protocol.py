"""The SGLang protocol shared by the dev and sim servers, as plain functions."""

from __future__ import annotations

import json
import time

import pytest

from emulators.sglang_protocol.auth import Auth
from emulators.sglang_protocol.contract import contract_error
from emulators.sglang_protocol.errors import BadRequest, ContractError, MalformedRequest, error_response
from emulators.sglang_protocol.limits import ModelLimits, num_reserved_tokens
from emulators.sglang_protocol.request import parse_abort, parse_generate
from emulators.sglang_protocol.results import (
    finish_abort,
    finish_length,
    finish_reason,
    finish_stop,
    generate_result,
    queued_abort_result,
    text_token_ids,
)
from emulators.sglang_protocol.rids import HeldRids, abort_matcher
from emulators.sglang_protocol.sampling import SamplingParams, parse_sampling_params
from emulators.sglang_protocol.versions import SGLangVersion


def body(**fields) -> bytes:
    return json.dumps(fields).encode()


def test_single_and_batch_requests_are_split_into_items():
    single = parse_generate(body(input_ids=[5, 6], rid="r", sampling_params={"max_new_tokens": 3}), server="x")
    assert single.single and single.prompts == [[5, 6]] and single.rids == ["r"]
    assert single.sampling_params == [{"max_new_tokens": 3}]

    batch = parse_generate(body(input_ids=[[5], [6, 7]], sampling_params=[{"top_k": 1}, {}]), server="x")
    assert not batch.single and batch.prompts == [[5], [6, 7]]
    assert batch.sampling_params == [{"top_k": 1}, {}]
    assert len(set(batch.rids)) == 2 and all(len(r) == 32 for r in batch.rids)  # uuid hex each

    shared = parse_generate(body(text=["a", "b"], sampling_params={"top_p": 0.5}), server="x")
    assert shared.prompts == ["a", "b"] and shared.sampling_params == [{"top_p": 0.5}] * 2


@pytest.mark.parametrize(
    "raw, error, message",
    [
        (b"{not json", MalformedRequest, "JSON decode error"),
        (b"[1, 2]", MalformedRequest, "The request body must be a JSON object."),
        (
            body(input_ids=[1], stream=True),
            BadRequest,
            "stream=True is not supported by the eagle3 test server; use stream=false.",
        ),
        (body(), BadRequest, "Either text, input_ids or input_embeds should be provided."),
        (body(input_ids=[1], text="a"), BadRequest, "Either text, input_ids or input_embeds should be provided."),
        (body(input_ids=[]), BadRequest, "input_ids cannot be empty."),
        # GenerateReqInput's dataclass parse refuses these (FastAPI's validation body) ...
        (body(input_ids=[1, [2]]), MalformedRequest, "input_ids must be a list of ints"),
        (body(input_ids="1 2"), MalformedRequest, "input_ids must be a list of ints"),
        (body(text=[]), BadRequest, "The batch is empty."),
        (body(text=3), MalformedRequest, "text must be a string or a list of strings"),
        (body(input_ids=[1], sampling_params=[{}]), BadRequest, "sampling_params has 1 entries for a batch of 1."),
        (body(input_ids=[[1], [2]], rid=["a"]), BadRequest, "rid has 1 entries for a batch of 2."),
        (body(input_ids=[1], rid=["a"]), MalformedRequest, "rid must be a string (single request)"),
        (body(input_ids=[1], sampling_params=[{}, None]), MalformedRequest, "sampling_params must be an object"),
        (body(input_ids=[1], rid=7), MalformedRequest, "rid must be a string"),
        # ... the API schema these (SGLang 0.5.23 entrypoints/api_contract.py; the JSON true passes the
        # C-loop int64 validator of srt/utils/field_validators.py) ...
        (body(input_ids=[1, True]), ContractError, "invalid type: boolean `true`, expected i64"),
        (body(input_ids=[True, 1]), ContractError, "invalid type: boolean `true`, expected a sequence"),
        (body(input_ids=[[1], [True]]), ContractError, "invalid type: boolean `true`, expected i64"),
        (
            body(input_ids=[1], sampling_params={"temperature": "hot"}),
            ContractError,
            'invalid type: string "hot", expected f64',
        ),
        (
            body(input_ids=[1], sampling_params={"top_k": 1.5}),
            ContractError,
            "invalid type: floating point `1.5`, expected i64",
        ),
        (
            body(input_ids=[1], sampling_params={"ignore_eos": 1}),
            ContractError,
            "invalid type: integer `1`, expected a boolean",
        ),
        (
            body(input_ids=[1], sampling_params={"stop_token_ids": [1, "x"]}),
            ContractError,
            'invalid type: string "x", expected i64',
        ),
        (
            body(input_ids=[1], sampling_params={"tempreature": 0}),
            ContractError,
            "unknown field `tempreature`, expected one of `max_new_tokens`, `stop`, `stop_token_ids`, ",
        ),
        (body(input_ids=[1], stream="yes"), ContractError, 'invalid type: string "yes", expected a boolean'),
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


def test_sglang_04_has_no_contract_gate():
    """0.4.x: no schema gate (http_server.py generate_request); wrong types fall to our own malformed check."""
    old = SGLangVersion("0.4")
    with pytest.raises(MalformedRequest, match="input_ids must be a list of ints"):
        parse_generate(body(input_ids=[1, True]), server="x", version=old)
    req = parse_generate(body(input_ids=[1], sampling_params={"tempreature": 0}), server="x", version=old)
    assert req.sampling_params == [{"tempreature": 0}]  # the servers' own rules decide
    with pytest.raises(MalformedRequest, match="sampling_params.top_k must be a number"):
        parse_sampling_params({"top_k": 1.5})
    with pytest.raises(ValueError, match="sglang_version must be one of"):
        SGLangVersion("0.3")


def test_contract_gate_admits_what_the_schema_admits():
    ok = {
        "input_ids": [[1, 2], [3]],
        "rid": ["a", "b"],
        "stream": False,
        "return_logprob": "ignored here",
        "sampling_params": [
            {
                "max_new_tokens": None,
                "temperature": 1,
                "stop": "x",
                "stop_token_ids": [2],
                "logit_bias": {"5": -1},
                "custom_params": {"any": [1]},
                "choice": ["a"],
                "watermark": {"enabled": True},
            },
            {},
        ],
    }
    assert contract_error(ok) is None
    assert contract_error({"sampling_params": {"watermark": {"seed": 1}}}) == (
        "unknown field `seed`, expected one of `enabled`, `key`, `context_window`"
    )


def test_model_limits_reserve_the_draft_tokens():
    """SGLang 0.5.23 _validate_one_request adds compute_num_reserved_tokens() to both tokenizer checks."""
    assert num_reserved_tokens(eagle_topk=1, num_steps=3, num_draft_tokens=4) == 4
    assert num_reserved_tokens(eagle_topk=4, num_steps=3, num_draft_tokens=8) == 12
    plain, eagle = ModelLimits(vocab_size=100, context_length=64), ModelLimits(100, 64, reserved_tokens=4)
    assert plain.admit([1] * 10, {"max_new_tokens": 54}).max_new_tokens == 54  # 10 + 54 = 64: not over
    with pytest.raises(BadRequest, match="You requested a total of 68 tokens: 14 tokens from the input messages"):
        eagle.admit([1] * 10, {"max_new_tokens": 54})
    assert eagle.admit([1] * 10, {"max_new_tokens": 50}).max_new_tokens == 50
    assert eagle.max_req_input_len == plain.max_req_input_len == 58  # the scheduler's limit reserves nothing
    big = ModelLimits(100, 64, reserved_tokens=8)
    with pytest.raises(BadRequest, match=r"^The input \(64 tokens\) is longer than the model's context length"):
        big.admit([1] * 56, {"max_new_tokens": 1})
    # 0.4.10: nothing reserved, and a total of exactly the context is refused.
    old = ModelLimits(100, 64, reserved_tokens=4, sglang_version="0.4")
    assert old.admit([1] * 10, {"max_new_tokens": 53}).max_new_tokens == 53
    with pytest.raises(BadRequest, match="You requested a total of 64 tokens: 10 tokens"):
        old.admit([1] * 10, {"max_new_tokens": 54})


def test_finish_order_stop_before_length():
    """0.5.23 update_finish_state: stop token first; 0.4.10 check_finished: the length cap first."""
    assert finish_reason([5, 7], 2, {7}) == {"type": "stop", "matched": 7}
    assert finish_reason([5, 7], 2, {7}, SGLangVersion("0.4")) == {"type": "length", "length": 2}
    assert finish_reason([5, 6], 2, {7}) == {"type": "length", "length": 2}
    assert finish_reason([7], 2, {7}, SGLangVersion("0.4")) == {"type": "stop", "matched": 7}
    assert finish_reason([5], 2, {7}) is None
    assert finish_reason([7, 5], 2, ()) == {"type": "length", "length": 2}


def test_response_shapes():
    assert text_token_ids([4, 5, 1], finish_stop(1), no_stop_trim=False) == [4, 5]
    assert text_token_ids([4, 5, 1], finish_stop(1), no_stop_trim=True) == [4, 5, 1]
    assert text_token_ids([4, 5], finish_length(2), no_stop_trim=False) == [4, 5]
    before = time.time()
    args = dict(rid="r", text="t", output_ids=[4, 5], finish_reason=finish_length(2), prompt_tokens=3, e2e_latency=0.5)
    result = generate_result(**args)
    assert before <= result["meta_info"].pop("response_sent_to_client_ts") <= time.time()  # the last key
    assert result == {
        "text": "t",
        "output_ids": [4, 5],
        "meta_info": {  # 0.5.23 _handle_batch_output
            "id": "r",
            "finish_reason": {"type": "length", "length": 2},
            "prompt_tokens": 3,
            "weight_version": "default",
            "num_retractions": 0,
            "reasoning_tokens": 0,
            "completion_tokens": 2,
            "cached_tokens": 0,
            "weight_versions": [{"version": "default", "start": 0, "end": 2}],
            "cached_tokens_details": None,
            "dp_rank": None,
            "e2e_latency": 0.5,
        },
    }
    assert list(generate_result(**{**args, "text": None})) == ["output_ids", "meta_info"]  # --skip-tokenizer-init
    old = generate_result(
        rid="r",
        text="t",
        output_ids=[4, 5],
        finish_reason=finish_length(2),
        prompt_tokens=3,
        e2e_latency=0.5,
        spec_verify_ct=1,
        version=SGLangVersion("0.4"),
    )
    assert old["meta_info"] == {
        "id": "r",
        "finish_reason": {"type": "length", "length": 2},
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "cached_tokens": 0,
        "spec_verify_ct": 1,
        "e2e_latency": 0.5,
    }
    assert finish_abort() == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def test_queued_abort_shapes():
    """tokenizer_manager.py _handle_abort_req: 0.5.23 has no prompt_tokens, 0.4.10 no output_ids."""
    queued = queued_abort_result(rid="q", e2e_latency=0.25)
    assert list(queued["meta_info"])[-1] == "response_sent_to_client_ts"
    queued["meta_info"].pop("response_sent_to_client_ts")
    assert queued == {
        "text": "",
        "output_ids": [],
        "meta_info": {
            "id": "q",
            "finish_reason": {"type": "abort", "message": "Abort in waiting queue"},
            "weight_version": "default",
            "e2e_latency": 0.25,
            "weight_versions": [{"version": "default", "start": 0, "end": 0}],
            "completion_tokens": 0,
        },
    }
    assert queued_abort_result(rid="q", e2e_latency=0.25, version=SGLangVersion("0.4")) == {
        "text": "",
        "meta_info": {
            "id": "q",
            "finish_reason": {"type": "abort", "message": "Abort before prefill"},
            "prompt_tokens": 0,
            "completion_tokens": 0,
        },
    }


def test_error_bodies_have_sglangs_two_shapes():
    assert json.loads(error_response(400, "bad").body) == {"error": {"message": "bad"}}
    r = error_response(503, "down")
    assert r.status_code == 503
    assert json.loads(r.body) == {"object": "error", "message": "down", "type": "503", "param": None, "code": 503}


def test_abort_bodies():
    assert parse_abort(b"") == ("", False)  # io_struct.py AbortReq: rid None -> ""
    assert parse_abort(body(rid="r")) == ("r", False)
    assert parse_abort(body(abort_all=True)) == ("", True)
    with pytest.raises(MalformedRequest, match="The request body must be a JSON object."):
        parse_abort(b"[]")
    with pytest.raises(MalformedRequest, match="rid must be a string"):
        parse_abort(body(rid=5))


def test_held_rids_and_the_prefix_abort():
    held = HeldRids()
    held.claim(["a:1", "a:10"])
    with pytest.raises(BadRequest, match="^Duplicate request ID detected: a:1$"):
        held.claim(["b", "a:1"])
    with pytest.raises(BadRequest, match=r"^Duplicate request IDs detected within the request: \['c'\]$"):
        held.claim(["c", "c"])
    assert "b" not in held and "c" not in held  # a refused claim holds nothing
    match = abort_matcher("a:1", False, held)
    assert [r for r in ("a:1", "a:10", "a:123", "a:2") if match(r)] == ["a:1", "a:10", "a:123"]
    assert abort_matcher("a:", False, held) is None  # a prefix of held rids, but not held itself
    assert abort_matcher("", False, held) is None  # empty rid without abort_all: ignored
    assert abort_matcher("", True, held)("anything")
    held.release("a:1")
    assert abort_matcher("a:1", False, held) is None
    old = HeldRids(SGLangVersion("0.4"))  # 0.4.10 overwrites rid_to_state: no refusal
    old.claim(["x", "x"])
    old.release("x")
    assert "x" in old and len(old) == 1


def test_auth_follows_decide_request_auth():
    """utils/auth.py decide_request_auth: health open; ADMIN_OPTIONAL takes the admin key when set."""
    both = Auth(api_key="k", admin_api_key="adm")
    assert both.decide("GET", "/health_generate", None) is None
    assert both.decide("POST", "/generate", None) == 401
    assert both.decide("POST", "/generate", "Bearer k") is None
    assert both.decide("POST", "/generate", "bearer k") is None  # the scheme is case-insensitive
    assert both.decide("POST", "/generate", "Bearer adm") == 401  # NORMAL: the api key only
    assert both.decide("POST", "/abort_request", "Bearer k") == 401
    assert both.decide("POST", "/abort_request", "Bearer adm") is None
    assert both.decide("OPTIONS", "/generate", None) is None
    api_only, admin_only = Auth(api_key="k"), Auth(admin_api_key="adm")
    assert api_only.decide("POST", "/flush_cache", "Bearer k") is None
    assert (
        admin_only.decide("POST", "/generate", None) is None and admin_only.decide("POST", "/flush_cache", None) == 401
    )
    old = Auth(api_key="k", version=SGLangVersion("0.4"))  # 0.4.10 utils.py add_api_key_middleware
    assert old.decide("POST", "/abort_request", "Bearer k") is None and old.decide("GET", "/health", None) is None
    assert old.decide("POST", "/generate", "bearer k") == 401  # an exact string compare
    with pytest.raises(ValueError, match="--admin-api-key does not exist in SGLang 0.4"):
        Auth(admin_api_key="adm", version=SGLangVersion("0.4"))
