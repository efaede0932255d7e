"""The tiny target: reproducible builds, Kimi-style template, loadable offline; and the sample data."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.draft.config import default_aux_layers
from models.target.tiny import SAMPLES_DIR, build_tiny_target
from models.target.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS

EXPECTED_IDS = {
    "<|pad|>": 0,
    "<|im_end|>": 1,
    "<|im_user|>": 2,
    "<|im_assistant|>": 3,
    "<|im_system|>": 4,
    "<|im_middle|>": 5,
    "<think>": 6,
    "</think>": 7,
}


def _turns(*contents: str) -> list[dict[str, str]]:
    """Messages of these contents, alternating user, assistant, user, ..."""
    return [{"role": ("user", "assistant")[i % 2], "content": c} for i, c in enumerate(contents)]


CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    *_turns("What is 2+2?", "<think>Add them.</think>\n\n4", "And 3+3?", "<think>Again.</think>\n\n6"),
]


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


def _ids(encoded) -> list[int]:
    # transformers 5 returns a BatchEncoding from apply_chat_template(tokenize=True); 4.x a list.
    return list(encoded["input_ids"] if isinstance(encoded, Mapping) else encoded)


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(a / "model.safetensors"), load_file(b / "model.safetensors")
    assert wa.keys() == wb.keys()
    for name in wa:
        assert torch.equal(wa[name], wb[name]), name


# --- builds -------------------------------------------------------------------------------------


SHORT = 6  # training steps of the builds below: enough to run the training, a few seconds each


@pytest.fixture(scope="module")
def short_builds(tmp_path_factory) -> dict[str, Path]:
    """Seed 0 built twice and seed 1 once, each trained SHORT steps."""
    root = tmp_path_factory.mktemp("short_builds")
    return {
        name: build_tiny_target(root / name, seed=seed, train_steps=SHORT)
        for name, seed in (("a", 0), ("again", 0), ("other", 1))
    }


def test_same_seed_builds_are_identical(short_builds, tiny_target_dir):
    a, again = short_builds["a"], short_builds["again"]
    _assert_same_weights(again, a)
    for name in (
        "tokenizer.json",
        "config.json",
        "generation_config.json",
        "tokenizer_config.json",
        "tiny_target.json",
    ):
        assert (again / name).read_bytes() == (a / name).read_bytes(), name
    # the tokenizer does not depend on the training: the same as the fully trained build's
    assert (a / "tokenizer.json").read_bytes() == (tiny_target_dir / "tokenizer.json").read_bytes()
    info = json.loads((a / "tiny_target.json").read_text())
    assert info["train_steps"] == SHORT and {"train_lr", "train_batch", "train_seq_len"} <= info.keys()


def test_training_changes_the_weights(short_builds, tiny_target_dir):
    trained, short = (
        load_file(tiny_target_dir / "model.safetensors"),
        load_file(short_builds["a"] / "model.safetensors"),
    )
    assert trained.keys() == short.keys()
    assert not torch.equal(trained["lm_head.weight"], short["lm_head.weight"])
    assert json.loads((tiny_target_dir / "tiny_target.json").read_text())["train_steps"] > SHORT


def test_other_seed_changes_weights_not_tokenizer(short_builds):
    a, other = short_builds["a"], short_builds["other"]
    assert (other / "tokenizer.json").read_bytes() == (a / "tokenizer.json").read_bytes()
    wa, wb = load_file(a / "model.safetensors"), load_file(other / "model.safetensors")
    assert wa.keys() == wb.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wb["model.embed_tokens.weight"])
    assert not torch.equal(wa["lm_head.weight"], wb["lm_head.weight"])
    assert json.loads((other / "tiny_target.json").read_text())["seed"] == 1


def test_another_training_length_is_another_build(short_builds, tmp_path):
    """A build with other training parameters is rebuilt, not reused."""
    import shutil

    copy = tmp_path / "t"
    shutil.copytree(short_builds["a"], copy)
    stamp = (copy / "model.safetensors").read_bytes()
    build_tiny_target(copy, seed=0, train_steps=SHORT + 1)
    assert json.loads((copy / "tiny_target.json").read_text())["train_steps"] == SHORT + 1
    assert (copy / "model.safetensors").read_bytes() != stamp


def test_complete_build_is_reused_and_leaves_no_temp_dirs(tiny_target_dir):
    stamp = (tiny_target_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_target(tiny_target_dir, seed=0) == tiny_target_dir
    assert (tiny_target_dir / "model.safetensors").stat().st_mtime_ns == stamp
    assert sorted(p.name for p in tiny_target_dir.parent.iterdir()) == [tiny_target_dir.name]


def test_a_build_says_each_phase_and_its_steps_and_a_reuse_says_nothing(tmp_path, monkeypatch, capsys):
    import re

    from models.target import tiny

    monkeypatch.setattr(tiny, "PROGRESS_EVERY_S", 0.0)  # a line every step (10 s apart in a real build)
    out = tmp_path / "t"
    build_tiny_target(out, train_steps=3, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == (
        f"tiny target: building the llama target in {out} (once; reused while its settings stay): a tokenizer, "
        "then 3 training steps on the sample data"
    )
    assert re.fullmatch(r"tiny target: tokenizer of [\d,]+ tokens, model of [\d,]+ parameters", lines[1]), lines[1]
    steps = [
        re.fullmatch(r"tiny target: training: step (\d)/3, loss \d+\.\d\d, \d+ s(, about \d+ s to go)?", x)
        for x in lines[2:5]
    ]
    assert all(steps), lines[2:5]
    assert [(m[1], m[2] is not None) for m in steps if m] == [("1", True), ("2", True), ("3", False)]
    assert re.fullmatch(rf"tiny target: built in {re.escape(str(out))} \(\d+ s\)", lines[5]) and len(lines) == 6, lines
    build_tiny_target(out, train_steps=3, hidden_size=64, num_heads=2, num_kv_heads=1, intermediate_size=128)
    assert capsys.readouterr().err == ""  # reused: nothing to say


def test_refuses_to_replace_a_foreign_directory(tmp_path):
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        build_tiny_target(foreign)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_too_few_layers_raise(tmp_path):
    with pytest.raises(ValueError, match="at least 8"):
        build_tiny_target(tmp_path / "t", num_layers=7)
    assert not (tmp_path / "t").exists()


# --- tokenizer ----------------------------------------------------------------------------------


def test_loads_offline(tiny_target_dir, tokenizer, model):
    import huggingface_hub.constants

    assert huggingface_hub.constants.HF_HUB_OFFLINE
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert model.config.vocab_size == len(tokenizer) == 2048
    assert model.config.tie_word_embeddings is False
    assert model.config.num_hidden_layers == 8
    assert model.config.hidden_size == 128
    assert model.config.max_position_embeddings == 4096
    assert model.generation_config.eos_token_id == EXPECTED_IDS["<|im_end|>"]
    assert json.loads((tiny_target_dir / "generation_config.json").read_text())["eos_token_id"] == 1


def test_special_token_ids(tokenizer, model):
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS} == EXPECTED_IDS
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == model.config.eos_token_id == 1
    assert tokenizer.pad_token_id == model.config.pad_token_id == 0
    assert tokenizer.bos_token is None
    assert set(SPECIAL_TOKENS) <= set(tokenizer.all_special_tokens)


def test_think_tags_are_single_special_tokens(tokenizer):
    ids = tokenizer.encode("so <think>hmm</think> done", add_special_tokens=False)
    assert ids.count(6) == 1 and ids.count(7) == 1
    assert tokenizer.encode("<think>", add_special_tokens=False) == [6]
    assert tokenizer.encode("</think>", add_special_tokens=False) == [7]
    assert tokenizer.encode("<|im_end|>", add_special_tokens=False) == [1]


def test_encoding_is_lossless_and_adds_nothing(tokenizer):
    text = "def f(x):\n    return x ** 2  # naïve, 日本語, emoji 🙂\n\n\ttabs  and  spaces "
    ids = tokenizer.encode(text)  # add_special_tokens defaults on: no bos/eos may appear
    assert tokenizer.decode(ids) == text
    assert 1 not in ids and 0 not in ids


def test_chat_template_renders_kimi_format_with_history_rewrite(tokenizer):
    rendered = tokenizer.apply_chat_template(CONVERSATION, tokenize=False)
    assert rendered == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        # before the last user message: the reasoning block and the blank line after it are gone
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
        "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
        # the final assistant turn keeps its reasoning
        "<|im_assistant|>assistant<|im_middle|><think>Again.</think>\n\n6<|im_end|>"
    )


def test_generation_prompt(tokenizer):
    rendered = tokenizer.apply_chat_template(CONVERSATION[:4], tokenize=False, add_generation_prompt=True)
    assert rendered == (
        "<|im_system|>system<|im_middle|>You are terse.<|im_end|>"
        "<|im_user|>user<|im_middle|>What is 2+2?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>4<|im_end|>"
        "<|im_user|>user<|im_middle|>And 3+3?<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>"
    )
    ids = _ids(tokenizer.apply_chat_template(CONVERSATION[:4], add_generation_prompt=True, tokenize=True))
    tail = tokenizer.encode("<|im_assistant|>assistant<|im_middle|>", add_special_tokens=False)
    assert tail[0] == 3 and tail[-1] == 5
    assert ids[-len(tail) :] == tail
    assert ids[0] == 4  # <|im_system|>: no bos in front


def test_rerendering_a_finished_conversation_changes_its_ids(tokenizer):
    """The trap later stages must avoid: prompt ids + generated ids != re-rendered conversation."""
    prompt_ids = _ids(tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True))
    output_ids = tokenizer.encode(CONVERSATION[2]["content"], add_special_tokens=False) + [1]
    generated = prompt_ids + output_ids
    assert _ids(tokenizer.apply_chat_template(CONVERSATION[:3])) == generated  # last turn: unchanged
    rerendered = _ids(tokenizer.apply_chat_template(CONVERSATION[:4]))  # now it is history
    assert rerendered[: len(generated)] != generated
    assert 6 not in rerendered[: len(generated)]


def test_history_rewrite_only_touches_leading_reasoning():
    from transformers.utils.chat_template_utils import render_jinja_template

    convo = _turns(
        "a", "no reasoning here", "b", "answer first </think> then a stray tag", "c", "  <think>x</think>   y", "d"
    )
    rendered, _ = render_jinja_template(conversations=[convo], chat_template=CHAT_TEMPLATE)
    assert rendered[0] == (
        "<|im_user|>user<|im_middle|>a<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>no reasoning here<|im_end|>"
        "<|im_user|>user<|im_middle|>b<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>answer first </think> then a stray tag<|im_end|>"
        "<|im_user|>user<|im_middle|>c<|im_end|>"
        "<|im_assistant|>assistant<|im_middle|>y<|im_end|>"
        "<|im_user|>user<|im_middle|>d<|im_end|>"
    )


# --- model --------------------------------------------------------------------------------------


def test_forward_exposes_every_layer(tokenizer, model):
    ids = _ids(tokenizer.apply_chat_template(CONVERSATION, tokenize=True))
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    L = model.config.num_hidden_layers
    assert len(out.hidden_states) == L + 1  # embeddings, then one per decoder layer
    assert out.logits.shape == (1, len(ids), len(tokenizer))
    for h in out.hidden_states:
        assert h.shape == (1, len(ids), 128) and torch.isfinite(h).all()
    aux = [out.hidden_states[k + 1] for k in default_aux_layers(L)]
    assert not torch.equal(aux[0], aux[1]) and not torch.equal(aux[1], aux[2])
    # Peaked next-token distributions (a trained model): well below uniform entropy.
    p = out.logits[0].softmax(-1)
    entropy = -(p * p.clamp_min(1e-12).log()).sum(-1).mean()
    assert entropy < 0.8 * torch.log(torch.tensor(float(len(tokenizer))))


def test_greedy_generate_is_deterministic(tokenizer, model):
    ids = torch.tensor([_ids(tokenizer.apply_chat_template(CONVERSATION[:2], add_generation_prompt=True))])
    a = model.generate(ids, max_new_tokens=8, do_sample=False)
    b = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert torch.equal(a, b) and a.shape[1] > ids.shape[1]


def test_trained_target_answers_in_sentences_and_ends_its_turns(tokenizer, model):
    """Greedy answers to the sample prompts are not short loops and end with <|im_end|> at varied lengths."""
    rows = [r for name in ("gen_code.jsonl", "gen_math.jsonl") for r in _rows(name)][::6]
    lengths, ratios = [], []
    for row in rows:
        messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
        ids = torch.tensor([_ids(tokenizer.apply_chat_template(messages, add_generation_prompt=True))])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=64, do_sample=False)[0, ids.shape[1] :].tolist()
        lengths.append(len(out) if out[-1] == 1 else None)
        ratios.append(len(set(out)) / len(out))  # a 1-3-token loop over 64 tokens: <= 0.05
    ended = [n for n in lengths if n is not None]
    assert len(ended) >= 0.8 * len(rows), lengths
    assert len(set(ended)) >= 4 and min(ended) >= 4, lengths  # varied, and not ending at once
    assert min(ratios) > 0.3 and sum(ratios) / len(ratios) > 0.6, ratios


# --- sample data --------------------------------------------------------------------------------


def _rows(name: str) -> list[dict]:
    path = SAMPLES_DIR / name
    rows = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        assert line.strip(), f"{name}:{lineno} is blank"
        row = json.loads(line)
        assert isinstance(row, dict), f"{name}:{lineno}"
        rows.append(row)
    return rows


def _check_ids(rows: list[dict]) -> None:
    ids = [r["id"] for r in rows if "id" in r]
    assert all(isinstance(i, str) and i for i in ids)
    assert len(ids) == len(set(ids))


def test_sample_passthrough_chat():
    rows = _rows("passthrough_chat.jsonl")
    assert 25 <= len(rows) <= 40
    _check_ids(rows)
    assert all("id" in r for r in rows)
    assistant_turns = with_reasoning = 0
    for r in rows:
        msgs = r["messages"]
        assert all(set(m) == {"role", "content"} and isinstance(m["content"], str) and m["content"] for m in msgs)
        roles = [m["role"] for m in msgs]
        if roles[0] == "system":
            roles = roles[1:]
        assert roles == ["user", "assistant"] * (len(roles) // 2), r["id"]
        assert 1 <= len(roles) // 2 <= 3, r["id"]
        for m in msgs:
            if m["role"] == "assistant":
                assistant_turns += 1
                c = m["content"]
                if c.startswith("<think>"):
                    with_reasoning += 1
                    assert c.count("<think>") == c.count("</think>") == 1, r["id"]
                    assert c.split("</think>", 1)[1].strip(), f"{r['id']}: reasoning without an answer"
                else:
                    assert "<think>" not in c and "</think>" not in c, r["id"]
    assert 0.35 <= with_reasoning / assistant_turns <= 0.7
    assert any(len(r["messages"]) - (r["messages"][0]["role"] == "system") == 6 for r in rows)  # 3 turns


def test_sample_generate_sets():
    code, math, long = _rows("gen_code.jsonl"), _rows("gen_math.jsonl"), _rows("gen_long.jsonl")
    for rows in (code, math, long):
        assert 30 <= len(rows) <= 60
        _check_ids(rows)

    for r in code:
        assert set(r) == {"id", "messages"} and [m["role"] for m in r["messages"]] == ["user"]
    for r in math:
        assert set(r) <= {"id", "prompt"} and isinstance(r["prompt"], str) and r["prompt"]
    no_id = [r for r in math if "id" not in r]
    assert 5 <= len(no_id) < len(math)  # both id paths are exercised
    for r in long:
        assert set(r) == {"id", "messages"}
        assert [m["role"] for m in r["messages"]] == ["system", "user"]

    def median_len(rows):
        sizes = sorted(
            sum(len(m["content"]) for m in r["messages"]) if "messages" in r else len(r["prompt"]) for r in rows
        )
        return sizes[len(sizes) // 2]

    assert median_len(math) < median_len(code) < median_len(long)
    assert median_len(long) > 1000
    assert all("\n\n" in r["messages"][1]["content"] for r in long)  # multi-paragraph


def test_sample_data_stays_small():
    files = sorted(SAMPLES_DIR.glob("*.jsonl"))
    assert {f.name for f in files} >= {"passthrough_chat.jsonl", "gen_code.jsonl", "gen_math.jsonl", "gen_long.jsonl"}
    assert sum(f.stat().st_size for f in files) < 300_000


def test_the_tiny_target_trains_on_the_four_sample_files_only():
    # Every *.jsonl of data/samples/ is the tiny target's corpus (tokenizer and weights): a file added there changes
    # the target, and with it every figure of the demo and of the tests. Other data goes elsewhere (data/formats/).
    from models.target.tiny import SAMPLES_DIR

    assert sorted(p.name for p in SAMPLES_DIR.glob("*.jsonl")) == [
        "gen_code.jsonl",
        "gen_long.jsonl",
        "gen_math.jsonl",
        "passthrough_chat.jsonl",
    ]
