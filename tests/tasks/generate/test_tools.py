"""A generate row's `tools` (tool definitions) reach the target: read by the loader, rendered by the chat template."""

from __future__ import annotations

import asyncio
import copy
import json
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from emulators.sim import SimServer
from models.common.jobs import GenerateJob
from tasks.datasets import DatasetError, load_dataset
from tasks.generate.prompts import request_sampling_params
from tasks.serving.client import RetryPolicy
from tasks.serving.pool import ServerPool
from tests.generate_runs import generate_into, responses

REPO = Path(__file__).resolve().parents[3]
B8 = REPO / "data/formats/kimi/B8_toolcalls.jsonl"
EOS = 1
# The tiny target's template with the tool definitions as a system turn first, as templates with tools do
TOOLS_FIRST = "{%- if tools -%}<|im_system|>tools<|im_middle|>{{ tools | tojson }}<|im_end|>{%- endif -%}"


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    tok = copy.deepcopy(tok)
    tok.chat_template = TOOLS_FIRST + tok.chat_template
    return tok


def test_the_tools_of_a_row_are_read_as_a_list_or_a_json_string(tmp_path):
    rows = [json.loads(line) for line in B8.read_text().splitlines()]
    assert rows[0]["tools"]  # the sample carries tool definitions
    loaded = load_dataset(B8, "generate").rows
    assert [r.tools for r in loaded] == [r.get("tools") or None for r in rows]
    as_string = tmp_path / "b8.jsonl"
    as_string.write_text("".join(json.dumps({**r, "tools": json.dumps(r["tools"])}) + "\n" for r in rows))
    assert [r.tools for r in load_dataset(as_string, "generate").rows] == [r.tools for r in loaded]


@pytest.mark.parametrize(
    "tools, said",
    [
        ("{not json", "row 1: 'tools' is a string but not JSON"),
        ({"name": "f"}, "row 1: 'tools' must be a list of tool definitions or a JSON string of one, got object"),
        (["f"], "row 1: 'tools[0]' must be an object (a tool definition), got string"),
    ],
)
def test_bad_tools_are_a_bad_row_naming_the_file_and_row(tmp_path, tools, said):
    path = tmp_path / "bad.jsonl"
    path.write_text(json.dumps({"id": "x", "messages": [{"role": "user", "content": "hi"}], "tools": tools}) + "\n")
    with pytest.raises(DatasetError) as err:
        load_dataset(path, "generate")
    assert str(path) in str(err.value) and said in str(err.value).replace("line 1", "row 1")


def test_generate_sends_the_tools_through_the_chat_template(tmp_path, tokenizer):
    rows = load_dataset(B8, "generate").rows
    with SimServer(max_running=4, decode_s_per_token=0.0005, mean_len=8, vocab_size=2048, eos_token_id=EOS) as srv:

        async def go():
            async with ServerPool([srv.url], max_concurrency=4, retry=RetryPolicy(initial_s=0.01, max_s=0.05)) as pool:
                job = GenerateJob(dataset="B8", sampling_params=request_sampling_params({"max_new_tokens": 8}, [EOS]))
                return await generate_into(tmp_path, rows, pool=pool, tokenizer=tokenizer, settings=job)

        report = asyncio.run(go())
    got = {r["id"]: r for r in responses(tmp_path, "B8")}
    assert report.new_responses == len(rows) == len(got)
    for row in rows:
        prompt = tokenizer.decode(got[row.id]["prompt_ids"])
        names = [t["function"]["name"] for t in row.tools or []]
        # the definitions first, as the template writes them, then the conversation
        assert prompt.startswith("<|im_system|>tools<|im_middle|>") == bool(names)
        assert all(f'"name": "{n}"' in prompt for n in names)
