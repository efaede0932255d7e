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


def _chats(prompt: str) -> list[dict]:
    """ShareGPT rows as a Hub dataset publishes them; the second row's prompt is `prompt`."""
    return [
        {"id": "a", "conversations": [{"from": "human", "value": "Hi there"}, {"from": "gpt", "value": "Hello!"}]},
        {"id": "b", "conversations": [{"from": "human", "value": prompt}]},
    ]


def test_a_hub_dataset_is_sampled_from_the_cache_at_the_run_s_recorded_commit(tmp_path, tokenizer, monkeypatch):
    """The check reads what the run reads (the commit its record pins, not the newer main), records nothing, and
    measures what the same rows measure in a local file."""
    from tasks.datasets import HubDataset
    from tests.hub_cache import offline_hub_cache, publish

    hub = offline_hub_cache(tmp_path, monkeypatch)
    pinned, newer = _chats("word " * 50), _chats("short")
    publish(hub, "1" * 40, pinned, main=False)
    publish(hub, "2" * 40, newer)
    record = tmp_path / "run" / "datasets" / "B9.json"
    record.parent.mkdir(parents=True)
    record.write_text(json.dumps({"repo": "org/chats", "config": None, "split": "train", "revision": "1" * 40}))
    before = record.read_text()
    source = HubDataset("org/chats", record=record)
    report = template_findings(tokenizer, [("B9", source, "generate")])
    local = template_findings(tokenizer, [("B9", jsonl(tmp_path / "pinned.jsonl", pinned), "generate")])
    assert report.longest_prompts == local.longest_prompts and report.longest_prompts["B9"] > 50
    assert [(f.status, f.detail) for f in report.findings] == [(f.status, f.detail) for f in local.findings]
    assert record.read_text() == before


def test_a_hub_dataset_not_in_the_cache_warns_online_and_fails_offline(tmp_path, tokenizer, monkeypatch):
    import huggingface_hub.constants

    from tasks.datasets import HubDataset
    from tests.hub_cache import offline_hub_cache

    offline_hub_cache(tmp_path, monkeypatch)  # empty
    source = HubDataset("org/absent")
    (f,) = template_findings(tokenizer, [("B9", source, "generate")]).findings
    assert f.status == "FAIL" and "not in the local Hugging Face cache and HF_HUB_OFFLINE is set" in f.detail
    assert "hf download --repo-type dataset org/absent" in f.advice
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # online: the stage would download it
    (f,) = template_findings(tokenizer, [("B9", source, "generate")]).findings
    assert f.status == "WARN" and f.detail.startswith("not sampled: hf:org/absent")
    assert "hf download --repo-type dataset org/absent" in f.advice
