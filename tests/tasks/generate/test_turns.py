"""turns: all — every user turn of a conversation answered by the target, in order (tasks/generate/conversations.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from emulators.sim import SimServer
from models.common.jobs import GenerateJob
from tasks.datasets import PromptRow
from tasks.generate.conversations import conversation
from tasks.generate.prompts import chat_prompt_ids, request_sampling_params
from tasks.responses.rejects import read_rejects
from tasks.responses.turn_ids import is_later_turn, split_turn_id, turn_id
from tasks.serving.client import RetryPolicy
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into
from tests.generate_runs import responses as dataset_responses

EOS = 1  # <|im_end|> of the tiny target; also the sim server's eos
FAST = RetryPolicy(initial_s=0.01, max_s=0.05, jitter=0.0, outage_window_s=20)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


def sampling(max_new_tokens: int = 24) -> dict:
    return request_sampling_params({"max_new_tokens": max_new_tokens, "temperature": 0.7, "top_p": 0.95}, [EOS])


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def conversations(n: int) -> list[PromptRow]:
    """Conversation i has 1 + i % 3 user turns, each followed by another model's answer, and a system turn when i is
    even; the generate loader cuts a row after its last user turn, as here."""
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": f"be brief {i}"}] if i % 2 == 0 else []
        turns = 1 + i % 3
        for k in range(1, turns + 1):
            messages.append(user(f"conversation {i} question {k}: " + "why " * (k + i % 4)))
            if k < turns:
                messages.append(assistant(f"another model's answer {k}"))
        rows.append(PromptRow(id=f"c{i}", messages=messages))
    return rows


def run(server: SimServer, rows, run_dir: Path, tokenizer, *, max_new_tokens: int = 24, **kw):
    async def go():
        async with ServerPool([server.url], max_concurrency=6, retry=FAST) as pool:
            job = GenerateJob(dataset="C1", sampling_params=sampling(max_new_tokens), flush_every=3, turns="all", **kw)
            return await generate_into(run_dir, rows, pool=pool, tokenizer=tokenizer, settings=job)

    return asyncio.run(go())


def responses(run_dir: Path) -> list[dict]:
    return dataset_responses(run_dir, "C1")


def expected_prompt(tokenizer, row: PromptRow, turn: int, by_id: dict[str, dict]) -> list[int]:
    """Turn `turn`'s prompt (0-based), built here from the row and the recorded answers: the system turn, the user
    turns up to `turn`, and after each earlier one the target's answer decoded without its end-of-turn token."""
    messages = [m for m in row.messages if m["role"] == "system"]
    users = [m for m in row.messages if m["role"] == "user"]
    for k in range(turn):
        answer = by_id[turn_id(row.id, k)]["output_ids"]
        assert answer[-1] == EOS  # only a finished answer is followed by another turn
        messages += [users[k], assistant(tokenizer.decode(answer[:-1], skip_special_tokens=False))]
    return chat_prompt_ids(tokenizer, [*messages, users[turn]])


def sim(**kw) -> SimServer:
    base = dict(max_running=4, decode_s_per_token=0.0005, mean_len=12, vocab_size=2048, eos_token_id=EOS, seed=0)
    return SimServer(**{**base, **kw}).start()


def test_turn_ids_name_a_conversation_and_its_turn():
    assert turn_id("c7", 3) == "c7#t3" and split_turn_id("c7#t3") == ("c7", 3) and split_turn_id("c7#t0") == ("c7", 0)
    assert split_turn_id("a#t2#t10") == ("a#t2", 10)  # the last suffix is the turn
    assert split_turn_id("c7") is None and split_turn_id("c7#t01") is None and split_turn_id("#t1") is None
    assert [is_later_turn(i) for i in ("c1#t0", "c1#t1", "x", "x#t")] == [False, True, False, False]


def test_a_conversation_is_regenerated_up_to_its_first_tool_call():
    tools = {"role": "system", "content": "tools: get_weather"}
    row = PromptRow(
        id="g1",
        messages=[
            tools,
            user("hello"),
            assistant("hi"),
            user("weather in Paris?"),
            {"role": "assistant", "content": "", "tool_calls": [{"name": "get_weather"}]},
            {"role": "tool", "content": "12 C"},
            assistant("12 C in Paris"),
            user("and in Rome?"),
        ],
    )
    conv = conversation(row)
    assert conv.head == [tools]
    assert conv.users == [user("hello"), user("weather in Paris?")]  # "and in Rome?" comes after the tool call
    conv.answers.append("the target's hi")
    expected = [tools, user("hello"), assistant("the target's hi"), user("weather in Paris?")]
    assert conv.prompt() == PromptRow(id="g1#t1", messages=expected)


def test_every_turn_once_each_prompt_holding_the_targets_own_earlier_answers(tmp_path, tokenizer):
    rows = conversations(9)  # 3 conversations each of 1, 2 and 3 user turns: 18 turns
    server = sim()
    try:
        report = run(server, rows, tmp_path, tokenizer)
    finally:
        server.stop()
    got = responses(tmp_path)
    by_id = {r["id"]: r for r in got}
    assert len(by_id) == len(got)  # each (conversation, turn) once
    ended = 0
    for row in rows:
        turns = 1 + int(row.id[1:]) % 3
        answered = [k for k in range(turns) if turn_id(row.id, k) in by_id]
        assert answered == list(range(len(answered))) and answered  # in order, from the first
        for k in answered:
            assert by_id[turn_id(row.id, k)]["prompt_ids"] == expected_prompt(tokenizer, row, k, by_id)
        last = by_id[turn_id(row.id, answered[-1])]
        if len(answered) < turns:  # ended early: only by an answer cut at the length limit
            assert last["finish_reason"] == "length"
            ended += 1
    assert len(got) == report.responses and report.conversations == 9 and report.ended_conversations == ended
    assert sum(map(is_later_turn, by_id)) >= 3  # later turns were really sent


def test_a_turn_cut_by_the_length_limit_ends_its_conversation(tmp_path, tokenizer):
    rows = conversations(9)
    server = sim(mean_len=400)  # every answer runs into max_new_tokens
    try:
        report = run(server, rows, tmp_path, tokenizer, max_new_tokens=8)
    finally:
        server.stop()
    got = responses(tmp_path)
    assert sorted(r["id"] for r in got) == sorted(turn_id(r.id, 0) for r in rows)  # the first turns only
    assert {r["finish_reason"] for r in got} == {"length"}
    assert report.status == "complete" and report.ended_conversations == 6  # the 6 of 2 or 3 turns


def test_a_budget_stop_mid_conversation_resumes_at_the_next_turn(tmp_path, tokenizer):
    rows = conversations(9)
    server = sim()
    try:
        first = run(server, rows, tmp_path, tokenizer, token_budget=60, max_in_flight=1)
        on_disk = [r["id"] for r in responses(tmp_path)]
        second = run(server, rows, tmp_path, tokenizer)
    finally:
        server.stop()
    assert first.status == "budget reached" and 0 < len(on_disk) < 18
    # one request at a time, next turn first: conversation after conversation, in file order
    order = [split_turn_id(i) for i in on_disk]
    assert order == sorted(order, key=lambda ct: (int(ct[0][1:]), ct[1]))
    got = responses(tmp_path)
    by_id = {r["id"]: r for r in got}
    assert len(by_id) == len(got) and [r["id"] for r in got][: len(on_disk)] == on_disk  # nothing sent twice
    for rid, r in by_id.items():
        conv, k = split_turn_id(rid)
        row = next(x for x in rows if x.id == conv)
        assert r["prompt_ids"] == expected_prompt(tokenizer, row, k, by_id)
    assert second.status == "complete" and second.new_responses == len(got) - len(on_disk)


def test_a_refused_turn_is_a_named_reject_and_ends_its_conversation(tmp_path, tokenizer):
    rows = conversations(9)
    refused = next(r for r in rows if r.id == "c5")  # 3 user turns: c5#t0, c5#t1, c5#t2
    marker = tokenizer.encode("question 2", add_special_tokens=False)
    server = sim()

    def second_turn_of_c5(ids):
        text = tokenizer.decode(ids)
        return "conversation 5 question 2" in text and "message too long for the sim" or None

    server.reject_if(second_turn_of_c5)
    try:
        report = run(server, rows, tmp_path, tokenizer)
        again = run(server, rows, tmp_path, tokenizer)
    finally:
        server.stop()
    assert marker  # the tokenizer knows the words the rule looks for
    ids = {r["id"] for r in responses(tmp_path)}
    assert turn_id(refused.id, 0) in ids and not {turn_id(refused.id, 1), turn_id(refused.id, 2)} & ids
    rejects = read_rejects(tmp_path / "rejects/C1")
    assert [(r["id"], r["cause"]) for r in rejects] == [("c5#t1", "refused")]
    assert report.ended_conversations >= 1 and again.new_responses == 0  # the reject stands: nothing sent again


def test_a_resume_reads_and_decodes_only_the_answers_of_conversations_that_go_on(tmp_path, tokenizer, monkeypatch):
    """A rerun late in a run: most conversations are complete or ended. plan_work finds where each stands from the
    last id and finish reason of its turns, and reads and decodes only the answers of those it continues (before, it
    decoded every answer on disk at every rerun)."""
    import tasks.generate.work as work
    import tasks.responses.checkpoints as checkpoints
    from tasks.responses.checkpoints import responses_table, write_part

    def answer(rid: str, ids: list[int], reason: str = "stop") -> dict:
        return {
            "id": rid,
            "prompt_ids": [5, 6],
            "output_ids": ids,
            "prompt_tokens": 2,
            "completion_tokens": len(ids),
            "finish_reason": reason,
            "text": "",
            "latency": 0.1,
            "cached_tokens": 0,
            "reasoning_tokens": 0,
            "finished_at": 1.0,
        }

    rows = [
        PromptRow(id="done", messages=[user("a"), assistant("x"), user("b")]),  # both turns answered: complete
        PromptRow(id="going", messages=[user("c"), assistant("y"), user("d"), assistant("z"), user("e")]),
        PromptRow(id="cut", messages=[user("f"), assistant("w"), user("g")]),  # its first answer cut by length
    ]
    going_t0 = [300, 301, 302, EOS]
    directory = tmp_path / "responses" / "C1"
    write_part(directory, responses_table([answer("done#t0", [200, EOS]), answer("going#t0", going_t0)]))
    write_part(directory, responses_table([answer("done#t1", [201, 202, EOS]), answer("cut#t0", [7] * 5, "length")]))
    decoded: list[list[int]] = []
    asked: list[set[str]] = []
    decode = tokenizer.decode
    monkeypatch.setattr(tokenizer, "decode", lambda ids, **kw: decoded.append(list(ids)) or decode(ids, **kw))
    real_answers = checkpoints.turn_answers
    monkeypatch.setattr(work, "turn_answers", lambda d, ids: asked.append(set(ids)) or real_answers(d, ids))

    job = GenerateJob(dataset="C1", sampling_params=sampling(), turns="all")
    planned = work.plan_work(rows, job, directory, set(), set(), tokenizer)
    assert asked == [{"going#t0"}] and decoded == [going_t0[:-1]]  # the one answer the continued turn needs
    [queued] = planned.queue
    assert queued.id == turn_id("going", 1)
    assert queued.messages == [user("c"), assistant(decode(going_t0[:-1], skip_special_tokens=False)), user("d")]
