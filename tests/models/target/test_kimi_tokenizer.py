"""The Kimi build's tokenizer as Kimi-K2.5 publishes its own (models/target/kimi_tokenizer.py, the remote code in
models/target/kimi_k25_remote/tokenization_kimi.py): loaded with trust_remote_code, it gives the byte-level BPE's
ids."""

from __future__ import annotations

import base64
import json
import pickle
from pathlib import Path

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from models.target.kimi_k25_remote.tokenization_kimi import bytes_to_unicode
from models.target.kimi_tokenizer import KIMI_CHAT_TEMPLATE, save_kimi_tokenizer, tiktoken_ranks
from models.target.tiny import KIMI_TOKENIZER_MAX_LENGTH, SAMPLES_DIR
from models.target.tiny_kimi import MEDIA_PAD
from models.target.tiny_tokenizer import CHAT_TEMPLATE, SPECIAL_TOKENS, build_tokenizer, corpus_texts

FILES = sorted(SAMPLES_DIR.glob("*.jsonl"))
VOCAB_SIZE = 2048  # build_kimi_target's default

TEXTS = [
    "Hello, world! It's a test; they'll see.",
    "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|><think>hm</think>ok<|im_end|>",
    f"an image: {MEDIA_PAD}{MEDIA_PAD} and text<|pad|>",
    "emoji 👋🏽🤖🎉 and a flag 🇫🇷",
    "中文：你好，世界。日本語のテキスト、한국어",
    "runs   of    spaces\t\ttabs \n\n\nnewlines\r\n  indented\n    code()\n",
    "   leading and trailing   ",
    "\n",
    " ",
    "unicode spaces\u00a0\u2003\u3000and\u0085next\x0bline",
    "combining e\u0301 and ß İ ǅ",
    "numbers 1234567 3.14159 ١٢٣",
    "<think",
    "</think><think></think>",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi 👋"},
        {"role": "assistant", "content": "<think>greet back</think>\n\nHello!"},
        {"role": "user", "content": "中文可以吗？"},
    ],
    [
        {"role": "user", "content": "Write code."},
        {"role": "assistant", "content": "def f():\n    return 1\n"},
        {"role": "tool", "content": "ok"},
    ],
]


@pytest.fixture(scope="module")
def fast() -> PreTrainedTokenizerFast:
    return build_tokenizer(FILES, VOCAB_SIZE, KIMI_TOKENIZER_MAX_LENGTH, extra=[MEDIA_PAD])


@pytest.fixture(scope="module")
def kimi_dir(fast: PreTrainedTokenizerFast, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("kimi-tokenizer")
    save_kimi_tokenizer(fast, out, KIMI_CHAT_TEMPLATE)
    return out


@pytest.fixture(scope="module")
def kimi(kimi_dir: Path):
    return AutoTokenizer.from_pretrained(kimi_dir, trust_remote_code=True)


def test_writes_the_files_kimi_publishes(kimi_dir: Path, fast: PreTrainedTokenizerFast) -> None:
    assert sorted(p.name for p in kimi_dir.iterdir()) == [
        "chat_template.jinja",
        "tiktoken.model",
        "tokenization_kimi.py",
        "tokenizer_config.json",
    ]
    config = json.loads((kimi_dir / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "TikTokenTokenizer"
    assert config["auto_map"] == {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]}
    assert {int(i): t["content"] for i, t in config["added_tokens_decoder"].items()} == {
        **dict(enumerate(SPECIAL_TOKENS)),
        VOCAB_SIZE: MEDIA_PAD,
    }
    assert all(t["special"] for t in config["added_tokens_decoder"].values())
    assert (config["bos_token"], config["eos_token"], config["pad_token"], config["unk_token"]) == (
        None,
        "<|im_end|>",
        "<|pad|>",
        None,
    )
    assert config["additional_special_tokens"] == [*SPECIAL_TOKENS[2:], MEDIA_PAD]
    assert config["model_max_length"] == KIMI_TOKENIZER_MAX_LENGTH
    assert (kimi_dir / "chat_template.jinja").read_text() == KIMI_CHAT_TEMPLATE

    # tiktoken.model: every non-special token of the BPE, its bytes at its id
    byte_encoder = bytes_to_unicode()
    ranks = {}
    for line in (kimi_dir / "tiktoken.model").read_text().splitlines():
        token, rank = line.split()
        ranks["".join(byte_encoder[b] for b in base64.b64decode(token))] = int(rank)
    vocab = json.loads(fast.backend_tokenizer.to_str())["model"]["vocab"]
    assert ranks == {t: i for t, i in vocab.items() if i >= len(SPECIAL_TOKENS)}
    assert sorted(ranks.values()) == list(range(len(SPECIAL_TOKENS), VOCAB_SIZE))


def test_loads_as_the_remote_tiktoken_tokenizer(kimi, fast: PreTrainedTokenizerFast) -> None:
    assert type(kimi).__name__ == "TikTokenTokenizer"
    assert type(kimi).__module__.endswith("tokenization_kimi")
    assert len(kimi) == len(fast) == VOCAB_SIZE + 1
    assert kimi.eos_token_id == fast.eos_token_id == 1
    assert kimi.pad_token_id == fast.pad_token_id == 0
    assert kimi.bos_token_id is None and kimi.unk_token_id is None
    assert sorted(kimi.all_special_ids) == sorted(fast.all_special_ids) == [*range(len(SPECIAL_TOKENS)), VOCAB_SIZE]
    assert kimi.get_added_vocab() == fast.get_added_vocab()
    assert kimi.get_vocab() == fast.get_vocab()
    for i, token in enumerate([*SPECIAL_TOKENS, MEDIA_PAD]):
        want = i if i < len(SPECIAL_TOKENS) else VOCAB_SIZE
        assert kimi.convert_tokens_to_ids(token) == fast.convert_tokens_to_ids(token) == want
    assert kimi.convert_ids_to_tokens([300, 1, 1000]) == fast.convert_ids_to_tokens([300, 1, 1000])


def test_corpus_ids_equal_the_fast_tokenizer(kimi, fast: PreTrainedTokenizerFast) -> None:
    texts = list(corpus_texts(FILES))
    assert len(texts) > 200
    differ = [t for t in texts if kimi(t)["input_ids"] != fast(t)["input_ids"] or kimi.encode(t) != fast.encode(t)]
    assert differ == []


@pytest.mark.parametrize("text", TEXTS)
def test_ids_and_decode_equal_the_fast_tokenizer(kimi, fast: PreTrainedTokenizerFast, text: str) -> None:
    ids = fast(text)["input_ids"]
    assert kimi(text)["input_ids"] == ids
    assert kimi.encode(text) == ids  # the tiktoken fast path
    assert kimi.encode(text, add_special_tokens=False) == ids
    assert kimi.decode(ids) == fast.decode(ids) == text
    assert kimi.decode(ids, skip_special_tokens=True) == fast.decode(ids, skip_special_tokens=True)
    assert kimi.convert_tokens_to_string(kimi.convert_ids_to_tokens(ids)) == text


def test_special_tokens_as_text(kimi, fast: PreTrainedTokenizerFast) -> None:
    text = "<|im_end|>x<think>"
    as_text = fast(text, split_special_tokens=True)["input_ids"]
    assert len(as_text) > 2 and 1 not in as_text and 6 not in as_text
    assert kimi.encode(text, allow_special_tokens=False) == as_text
    assert kimi(text, split_special_tokens=True)["input_ids"] == as_text
    assert kimi.encode(text) == [1, *fast.encode("x"), 6]


def test_long_runs_are_cut_for_tiktoken_and_still_equal(kimi, fast: PreTrainedTokenizerFast) -> None:
    for text in (" " * 30_000 + "a", "a" * 30_000, "\n" * 30_000):
        assert kimi.encode(text) == fast.encode(text)


def test_decode_replaces_invalid_utf8(kimi) -> None:
    ids = kimi.encode("👋")
    assert len(ids) > 1  # the emoji's 4 bytes are more than one token
    assert kimi.decode(ids[:1]) == "\ufffd"
    assert kimi.decode(ids) == "👋"


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_chat_template_equals_the_fast_tokenizer(kimi, fast: PreTrainedTokenizerFast, messages) -> None:
    for gen in (True, False):
        want = fast.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=True)
        got = kimi.apply_chat_template(messages, tokenize=True, add_generation_prompt=gen, return_dict=True)
        assert got["input_ids"] == want["input_ids"]
        text = kimi.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert text == fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert kimi.encode(text) == want["input_ids"]


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_thinking_switch(kimi, fast: PreTrainedTokenizerFast, messages) -> None:
    def ids(tok, **kw):
        return tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=True, **kw)[
            "input_ids"
        ]

    default = ids(fast)  # CHAT_TEMPLATE
    assert fast.chat_template == CHAT_TEMPLATE
    assert ids(kimi) == default
    assert ids(kimi, thinking=True) == default
    assert ids(kimi, thinking=False) == [*default, 6, 7]
    text = kimi.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, thinking=False)
    assert text.endswith("<|im_assistant|>assistant<|im_middle|><think></think>")
    # without a generation prompt the switch changes nothing
    no_prompt = kimi.apply_chat_template(messages, tokenize=False, add_generation_prompt=False, thinking=False)
    assert no_prompt == fast.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)


def test_save_pretrained_and_pickle_round_trip(kimi, tmp_path: Path) -> None:
    text = TEXTS[1] + TEXTS[3]
    kimi.save_pretrained(tmp_path)
    assert not (tmp_path / "tokenizer.json").exists()
    again = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
    assert type(again).__name__ == "TikTokenTokenizer"
    assert again.encode(text) == kimi.encode(text)
    assert again.added_tokens_decoder == kimi.added_tokens_decoder
    assert pickle.loads(pickle.dumps(kimi)).encode(text) == kimi.encode(text)


def test_a_rebuild_in_the_same_directory_loads_the_new_ranks(tmp_path: Path) -> None:
    """tiktoken's own loader caches tiktoken.model by its path; ours reads the file each time."""
    texts = list(corpus_texts(FILES))[:20]
    for vocab_size in (512, 1024):
        fast = build_tokenizer(FILES, vocab_size, KIMI_TOKENIZER_MAX_LENGTH, extra=[MEDIA_PAD])
        save_kimi_tokenizer(fast, tmp_path, KIMI_CHAT_TEMPLATE)
        kimi = AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)
        assert len(kimi) == vocab_size + 1
        assert [kimi.encode(t) for t in texts] == [fast.encode(t) for t in texts]


def test_replaces_a_tokenizer_json(fast: PreTrainedTokenizerFast, tmp_path: Path) -> None:
    fast.save_pretrained(tmp_path)
    assert (tmp_path / "tokenizer.json").exists()
    save_kimi_tokenizer(fast, tmp_path, KIMI_CHAT_TEMPLATE)
    assert not (tmp_path / "tokenizer.json").exists()
    assert type(AutoTokenizer.from_pretrained(tmp_path, trust_remote_code=True)).__name__ == "TikTokenTokenizer"


def test_refuses_a_bpe_whose_ids_are_not_in_merge_order(fast: PreTrainedTokenizerFast) -> None:
    state = json.loads(fast.backend_tokenizer.to_str())
    merges = state["model"]["merges"]
    merges[0], merges[1] = merges[1], merges[0]
    swapped = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(state)))
    with pytest.raises(ValueError, match="not in merge order"):
        tiktoken_ranks(swapped)
