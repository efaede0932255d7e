"""turns: all against the dev server (the tiny target served as SGLang serves it): SIGKILLed mid-conversation, then
resumed. Every (conversation, turn) once; each turn's prompt the chat template over the conversation with the
target's own earlier answers; the records' loss on the generated ids only."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from models.common.jobs import GenerateJob, RecordsJob
from tasks.generate.prompts import chat_prompt_ids, request_sampling_params
from tasks.records.build import build_records
from tasks.responses.checkpoints import live_parts
from tasks.responses.turn_ids import split_turn_id, turn_id
from tasks.runtime.ports import free_ports
from tasks.serving.launch import launched_servers

pytestmark = pytest.mark.multiprocess

REPO = Path(__file__).resolve().parents[3]
TURNS = 3


def conversation_rows(n: int) -> list[dict]:
    rows = []
    for i in range(n):
        messages = [{"role": "system", "content": "You answer briefly."}]
        for k in range(TURNS):
            messages.append({"role": "user", "content": f"Tell me fact {k + 1} about the number {i}."})
            if k < TURNS - 1:
                messages.append({"role": "assistant", "content": "Another model's answer, not used."})
        rows.append({"id": f"c{i}", "messages": messages})
    return rows


def on_disk(run_dir: Path) -> list[dict]:
    return [r for p in live_parts(run_dir / "responses/C1") for r in pq.read_table(p).to_pylist()]


def mid_conversation(rows: list[dict], eos: int) -> set[str]:
    """Conversations with some turns on disk, every one of them whole, and turns still to answer."""
    turns = defaultdict(list)
    for r in rows:
        conv, _ = split_turn_id(r["id"])
        turns[conv].append(r)
    return {c for c, rs in turns.items() if len(rs) < TURNS and all(r["output_ids"][-1] == eos for r in rs)}


@pytest.mark.slow
def test_turns_all_killed_mid_conversation_resumes_each_turn_once(tmp_path, tiny_target_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    sampling = request_sampling_params({"max_new_tokens": 64, "temperature": 0.3, "top_p": 0.95}, [eos])
    rows = conversation_rows(8)
    prompts_file = tmp_path / "conversations.jsonl"
    prompts_file.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    url = f"http://127.0.0.1:{free_ports(1)}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    with launched_servers("dev", url, target=tiny_target_dir, log_dir=tmp_path / "logs", health_timeout_s=180):
        job = GenerateJob(
            dataset="C1", sampling_params=sampling, sampling_seed=0, flush_every=2, flush_interval_s=0.2, turns="all"
        )
        runner = str(REPO / "tests" / "generate_runner.py")
        args = [sys.executable, runner, url, str(tiny_target_dir), str(run_dir), str(prompts_file)]
        args += [job.model_dump_json(), "4"]
        proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        # kill -9 as soon as a conversation is on disk part-way (polling the parts: no sleep decides it). The
        # runner is stopped (SIGSTOP) while the parts are read: what they show is what the kill leaves, even on a
        # loaded machine where a read takes long enough for more parts to land (a read that finds none part-way
        # lets it go on).
        killed_mid: set[str] = set()
        try:
            while proc.poll() is None and not killed_mid:
                time.sleep(0.02)  # a poll interval, not a wait for anything: the parts on disk decide
                os.kill(proc.pid, signal.SIGSTOP)
                if (run_dir / "responses/C1").exists():
                    killed_mid = mid_conversation(on_disk(run_dir), eos)
                if not killed_mid:
                    os.kill(proc.pid, signal.SIGCONT)
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
            _, err = proc.communicate(timeout=60)
        assert proc.returncode == -signal.SIGKILL, err[-2000:]  # killed, not finished
        before = on_disk(run_dir)
        assert mid_conversation(before, eos) == killed_mid and killed_mid  # the kill left conversations part-way
        final = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert final.returncode == 0, final.stderr[-2000:]
    report = json.loads(final.stdout.split("DONE", 1)[1])

    got = on_disk(run_dir)
    by_id = {r["id"]: r for r in got}
    assert len(by_id) == len(got)  # every (conversation, turn) at most once
    assert [r["id"] for r in got][: len(before)] == [r["id"] for r in before]  # what was on disk stayed as it was
    continued = 0
    for row in rows:
        answered = [k for k in range(TURNS) if turn_id(row["id"], k) in by_id]
        assert answered == list(range(len(answered))) and answered  # in order, from the first
        if len(answered) < TURNS:  # ended early: only by an answer that is not whole
            assert by_id[turn_id(row["id"], answered[-1])]["output_ids"][-1] != eos
        users = [m for m in row["messages"] if m["role"] == "user"]
        history = [row["messages"][0]]
        for k in answered:  # the prompt: the template over the system turn, the user turns, the target's answers
            r = by_id[turn_id(row["id"], k)]
            assert r["prompt_ids"] == chat_prompt_ids(tokenizer, [*history, users[k]])
            answer = tokenizer.decode(r["output_ids"][:-1], skip_special_tokens=False)
            history += [users[k], {"role": "assistant", "content": answer}]
        continued += row["id"] in killed_mid and len(answered) > sum(
            split_turn_id(i)[0] == row["id"] for i in (r["id"] for r in before)
        )
    assert continued >= 1  # a conversation cut by the kill got its next turns after the resume
    assert report == {"conversations": len(rows), "responses": len(got)}

    records_dir = run_dir / "records/C1"
    build_records(
        "C1",
        "generate",
        run_dir / "responses/C1",
        records_dir,
        run_dir / "rejects/C1",
        RecordsJob(vocab_size=len(tokenizer), stop_token_ids=[eos]),
    )
    records = [r for p in live_parts(records_dir) for r in pq.read_table(p).to_pylist()]
    whole = {i for i, r in by_id.items() if r["output_ids"][-1] == eos}
    assert sorted(r["id"] for r in records) == sorted(whole)  # one record per whole turn
    for rec in records:
        r = by_id[rec["id"]]
        assert rec["input_ids"] == r["prompt_ids"] + r["output_ids"]
        assert rec["loss_mask"] == [0] * len(r["prompt_ids"]) + [1] * len(r["output_ids"])  # the generated ids only
