"""`eagle3 demo` end to end: tiny target, dev server subprocess, real /generate over loopback."""

from __future__ import annotations

import io

from rich.console import Console
from transformers import AutoTokenizer

from flows.demo import PROMPTS_PER_DATASET, demo_config, run_demo
from tasks.datasets import load_dataset
from tasks.prompts import chat_prompt_ids


def test_demo_generates_responses_for_each_generate_dataset(tmp_path, tiny_target_dir):
    out = io.StringIO()
    completions = run_demo(run_dir=tmp_path / "run", console=Console(file=out, width=200), target_dir=tiny_target_dir)

    config = demo_config()
    generate = [d for d in config.datasets if d.kind == "generate"]
    assert len(completions) == PROMPTS_PER_DATASET * len(generate)

    tokenizer = AutoTokenizer.from_pretrained(tiny_target_dir)
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rows = [row for d in generate for row in load_dataset(d.path, "generate").rows[:PROMPTS_PER_DATASET]]
    for row, done in zip(rows, completions):
        assert done.rid.endswith(f":{row.id}")
        assert done.prompt_tokens == len(chat_prompt_ids(tokenizer, row.messages))
        assert done.completion_tokens == len(done.output_ids) > 0
        assert done.completion_tokens <= config.sampling.max_new_tokens
        if done.finish_reason == "stop":
            assert done.output_ids[-1] == eos  # the stop token is kept (no_stop_trim)
        else:
            assert done.finish_reason == "length"
            assert done.completion_tokens == config.sampling.max_new_tokens
    printed = out.getvalue()
    assert "generated responses" in printed
    assert "dev server stopped" in printed
    assert (tmp_path / "run" / "logs" / "dev-server.log").exists()
