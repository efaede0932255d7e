"""tasks/doctor/chat_template.py on the tiny target's tokenizer, with templates that fail in each way it looks for."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from tasks.doctor.chat_template import template_findings

# Renders system/user/assistant and leaves tool turns out; no generation prompt.
NO_TOOLS = (
    "{% for m in messages %}{% if m['role'] != 'tool' %}<|im_user|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}"
    "<|im_end|>{% endif %}{% endfor %}"
)


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture
def no_tools(tmp_path, tiny_target_dir):
    target = tmp_path / "no-tools"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").write_text(NO_TOOLS)
    return AutoTokenizer.from_pretrained(target)


def jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_a_row_of_nothing_but_loss_fails(tmp_path, tokenizer):
    rows = jsonl(tmp_path / "a.jsonl", [{"id": "r1", "input_ids": [5, 6, 7], "loss_mask": [1, 1, 1]}])
    (f,) = template_findings(tokenizer, [("A9", rows, "passthrough")]).findings
    assert f.status == "FAIL" and f.detail.startswith("100% of 3 tokens get loss (row r1 (pre-tokenized))")


def test_a_dataset_without_a_valid_row_fails(tmp_path, tokenizer):
    rows = jsonl(tmp_path / "b.jsonl", [{"prompt": 7}])
    (f,) = template_findings(tokenizer, [("B9", rows, "generate")]).findings
    assert f.status == "FAIL" and "no valid row in the first 200" in f.detail and "eagle3 validate" in f.advice


def test_the_longest_sampled_prompt_is_measured(tmp_path, tokenizer):
    short, long = "hi", "word " * 300
    rows = jsonl(tmp_path / "c.jsonl", [{"id": "s", "prompt": short}, {"id": "l", "prompt": long}])
    report = template_findings(tokenizer, [("B9", rows, "generate")])
    expected = len(
        tokenizer.apply_chat_template(
            [{"role": "user", "content": long}], add_generation_prompt=True, tokenize=True, return_dict=True
        )["input_ids"]
    )
    assert report.longest_prompts == {"B9": expected} and expected > 300


def test_a_template_that_drops_tool_results_warns(tmp_path, no_tools):
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "Let me look it up."},
        {"role": "tool", "content": "Paris: 18 degrees, light rain"},
        {"role": "assistant", "content": "It is 18 degrees with light rain: take an umbrella."},
    ]
    rows = jsonl(tmp_path / "d.jsonl", [{"id": "t1", "messages": conversation}])
    found = template_findings(no_tools, [("A9", rows, "passthrough")]).findings
    assert [(f.status, f.name) for f in found] == [("PASS", "chat template: A9"), ("WARN", "chat template: A9")]
    assert found[1].detail == "row t1: the template drops its tool result text, which gets no loss in any record"


def test_a_template_without_a_generation_prompt_warns(tmp_path, no_tools):
    rows = jsonl(tmp_path / "e.jsonl", [{"id": "p1", "prompt": "Name three prime numbers."}])
    (f,) = template_findings(no_tools, [("B9", rows, "generate")]).findings
    assert f.status == "WARN" and "add_generation_prompt adds nothing" in f.detail
