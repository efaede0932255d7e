"""The Kimi-K2.5-shaped tiny target (a kimi_k25 checkpoint with its remote code: MLA, MoE, YaRN) on the real SGLang
0.5.23 on CPU, with SGLang's own EAGLE-3 worker serving our drafts (.venv-sglang, `make sglang`; tests/sglang_real.py
says what is real).

One demo for the module, `eagle3 demo --target kimi --engine sglang` made shorter (4 epochs, 16 eval prompts):
generate through SGLang (the checkpoint's processor and tiktoken tokenizer as remote code, `--trust-remote-code`),
capture under DeepSpeed ZeRO-3, train the demo's Llama-style draft, and the engine eval through SGLang started with it.
Against independent sources:
- SGLang's own count of verify rounds per request (`spec_verify_ct`) and its completion tokens equal the in-process
  eval's (transformers' target, our draft code) on every prompt, and its greedy output with the draft equals its own
  without it;
- the aux hidden states SGLang's own DeepSeek model captures for EAGLE-3 (srt/models/deepseek_v2.py, read by a test
  plugin through SGLang's hook registry: tests/tasks/serving/sglang_aux_dump.py) equal, numerically, the states our
  capture stored, at the ids our export writes (SGLang adds 1 to them: its rule for ids starting at 1).
The MLA draft (`train.draft_arch: mla`), which SGLang serves with its Kimi-K2.5 class, is trained once for both
engines and served by each in tests/tasks/serving/test_vllm_kimi.py.

Without .venv-sglang every test here skips, saying so.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open

from models.capture.shards import iter_shard_index, read_sample
from models.draft.config import default_aux_layers
from models.export.format import vllm_aux_ids
from tests.run_configs import short_demo
from tests.sglang_real import sglang_python, start_sglang
from tests.tasks.serving.sglang_aux_dump import ENV as AUX_DUMP_ENV
from tests.tasks.serving.sglang_aux_dump import plugin_path
from tests.tasks.serving.test_sglang_eagle3_real import sglang_equals_in_process

pytestmark = [pytest.mark.sglang, pytest.mark.multiprocess, pytest.mark.timeout(2400)]

# The equality needs drafts that get some tokens right, not good ones: short trainings and evals (CI's time)
PROMPTS = 16  # the demo's engine eval
NUM_LAYERS = 8
# Relative to the largest value of the state (as tests/tasks/serving/test_vllm_kimi.py): float32 through two
# implementations (SGLang's MLA over our attention stand-ins, transformers under ZeRO-3).
RTOL = 5e-5


def rel(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """Max abs difference over the largest abs value of `theirs`."""
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


@pytest.fixture(scope="module")
def kimi_sglang_demo(kimi_target_dir, tmp_path_factory, prefect_harness):
    """`eagle3 demo --target kimi --engine sglang`, shorter: (config, what it printed)."""
    sglang_python()
    short = {"train": {"epochs": 4}, "eval": {"prompts": PROMPTS, "max_new_tokens": 32}}
    run_dir = tmp_path_factory.mktemp("kimi-sglang-demo") / "run"
    return short_demo(run_dir, kimi_target_dir, short, engine="sglang", target="kimi")


def test_the_kimi_demo_through_sglang_counts_the_in_process_rounds_prompt_by_prompt(kimi_sglang_demo):
    config, printed = kimi_sglang_demo
    assert config.target.tiny_shape == "kimi" and config.target.trust_remote_code
    assert (Path(config.target.path) / "tiktoken.model").is_file()  # the tokenizer as Kimi-K2.5 publishes it
    assert "--trust-remote-code" in (config.server.command or [])
    report = json.loads((config.layout.draft_dir / "eval.json").read_text())
    sglang_equals_in_process(report, PROMPTS)
    assert report["engine"]["outputs_differ_without_draft"] == 0  # SGLang's greedy tokens, with and without
    said = " ".join(printed.split())
    assert f"engine and HF EQUAL on the same {PROMPTS} prompts ({PROMPTS} with the same verify rounds)" in said
    assert "engine eval: a real SGLang with the draft" in said
    assert json.loads((config.run_dir / "generated-by.json").read_text())["engine"] == "sglang"


def shortest_samples(hidden: Path, n: int = 6) -> list[dict]:
    """The `n` shortest samples (of more than 8 tokens) of the capture in `hidden`."""
    index = sorted(iter_shard_index(hidden), key=lambda r: (r["length"], r["dataset"], r["id"]))
    samples = [read_sample(hidden / r["shard"], r["offset"], r["length"]) for r in index if r["length"] > 8][:n]
    assert len(samples) == n
    return samples


def test_sglang_captures_for_eagle3_the_aux_states_our_capture_stored(kimi_sglang_demo, kimi_target_dir, tmp_path):
    """SGLang with the demo's draft, the dump plugin on its path: each sample's record sent as a prompt (one new
    token, radix cache off so the prefill covers every token) and the states SGLang's model captured for it, against
    the sample our capture stored."""
    config, _ = kimi_sglang_demo
    samples = shortest_samples(config.layout.hidden_dir)
    dumps = tmp_path / "dumps"
    dumps.mkdir()
    from tasks.serving.sglang import SGLangClient

    extra = [*SGLangClient.speculative_args(str(config.layout.draft_dir / "final"), 3), "--disable-radix-cache"]
    env = {"PYTHONPATH": str(plugin_path(tmp_path / "plugin")), AUX_DUMP_ENV: str(dumps)}
    server = start_sglang(kimi_target_dir, tmp_path / "sglang.log", context_length=1024, extra=extra, env=env)
    try:
        for s in samples:
            body = {"input_ids": s["input_ids"].tolist(), "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            assert httpx.post(server.url + "/generate", json=body, timeout=300).status_code == 200
    finally:
        server.stop()
    theirs = {}
    for path in sorted(dumps.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            theirs[tuple(f.get_tensor("input_ids").tolist())] = (f.get_tensor("aux"), f.get_tensor("layers").tolist())
    hidden = json.loads((kimi_target_dir / "config.json").read_text())["text_config"]["hidden_size"]
    ours_ids = default_aux_layers(NUM_LAYERS)
    exported = json.loads((config.layout.draft_dir / "final" / "config.json").read_text())
    # what our export writes for SGLang, which reads eagle_config first (speculative/eagle_utils.py)
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ours_ids == [1, 3, 4]
    worst = 0.0
    for s in samples:
        aux, layers = theirs[tuple(s["input_ids"].tolist())]
        assert layers == vllm_aux_ids(ours_ids) == [2, 4, 5]  # SGLang's +1 for ids starting at 1 (deepseek_v2.py)
        mine = s["aux_hidden"].to(torch.float32)
        assert aux.shape == mine.shape == (len(s["input_ids"]), 3 * hidden)
        for k in range(3):
            part = slice(k * hidden, (k + 1) * hidden)
            assert rel(mine[:, part], aux[:, part]) < RTOL, (k, rel(mine[:, part], aux[:, part]))
            worst = max(worst, rel(mine[:, part], aux[:, part]))
    # a wrong rule (no +1) selects other states: the check can fail
    first, (aux, _) = samples[0], theirs[tuple(samples[0]["input_ids"].tolist())]
    assert rel(first["aux_hidden"].to(torch.float32)[:, 2 * hidden :], aux[:, hidden : 2 * hidden]) > 0.01
    print(f"aux states: ours vs SGLang's own (layers {layers}): max relative diff {worst:.2e}")
