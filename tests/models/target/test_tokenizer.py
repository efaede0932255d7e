"""models/target/tokenizer.py: a target whose tokenizer is its own code is loaded only with trust_remote_code, and
refused without it, saying why and what to set, because transformers would otherwise read the vocabulary its own way
and give the special tokens other ids (measured here against the remote tokenizer itself)."""

from __future__ import annotations

import json
import shutil
import threading
from pathlib import Path

import pytest

from models.target.tiny_tokenizer import IM_END
from models.target.tokenizer import RemoteTokenizerNotTrusted, load_tokenizer, remote_tokenizer_class


@pytest.fixture(scope="module")
def kimi_tokenizer_dir(kimi_target_dir, tmp_path_factory) -> Path:
    """The kimi build without its weights: config.json, tiktoken.model and tokenization_kimi.py, no tokenizer.json."""
    out = tmp_path_factory.mktemp("kimi") / "model"
    shutil.copytree(kimi_target_dir, out, ignore=shutil.ignore_patterns("*.safetensors"))
    assert (out / "tiktoken.model").is_file() and not (out / "tokenizer.json").exists()
    return out


def test_a_remote_tokenizer_loads_with_trust_remote_code(kimi_tokenizer_dir):
    tokenizer = load_tokenizer(str(kimi_tokenizer_dir), True)
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and tokenizer.convert_tokens_to_ids(IM_END) == 1
    assert remote_tokenizer_class(str(kimi_tokenizer_dir)) == "tokenization_kimi.TikTokenTokenizer"


def test_a_remote_tokenizer_without_trust_is_refused_saying_what_to_set(kimi_tokenizer_dir):
    with pytest.raises(RemoteTokenizerNotTrusted) as refused:
        load_tokenizer(str(kimi_tokenizer_dir), False)
    said = str(refused.value)
    assert str(kimi_tokenizer_dir) in said and "tokenization_kimi.TikTokenTokenizer" in said
    assert "set target.trust_remote_code: true" in said


def test_why_transformers_without_trust_gives_other_special_ids(kimi_tokenizer_dir):
    """What the refusal prevents: transformers (5.x) loads the checkpoint without its remote code, by its own
    converter of tiktoken.model (no question asked: config.json names kimi_k25, which transformers knows), and its end
    of turn is another id than the checkpoint's own tokenizer gives."""
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(str(kimi_tokenizer_dir), trust_remote_code=True)
    theirs = AutoTokenizer.from_pretrained(str(kimi_tokenizer_dir))
    assert type(theirs).__name__ != "TikTokenTokenizer"
    assert own.convert_tokens_to_ids(IM_END) == 1 != theirs.convert_tokens_to_ids(IM_END)


def test_a_plain_tokenizer_loads_either_way(tiny_target_dir):
    assert remote_tokenizer_class(str(tiny_target_dir)) is None
    for trust in (False, True):
        assert load_tokenizer(str(tiny_target_dir), trust).convert_tokens_to_ids(IM_END) == 1


def test_an_unreadable_tokenizer_config_is_left_to_transformers(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text("{not json")
    assert remote_tokenizer_class(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"auto_map": {"AutoTokenizer": [None, "x.Fast"]}}))
    assert remote_tokenizer_class(str(tmp_path)) == "x.Fast"


def test_tokenizers_load_one_at_a_time_in_a_process(tiny_target_dir, monkeypatch):
    """Generate loads the tokenizer in each dataset task's thread; transformers parses a remote tokenizer's code with
    `ast.parse`, which CPython 3.11 cannot run in two threads at once (python/cpython#106905: SystemError, AST
    constructor recursion depth mismatch). So a second load waits for the first: the first holds on until a second
    load enters or a second has passed, and no two are ever inside together."""
    from transformers import AutoTokenizer

    inside, most, second_entered = [0], [0], threading.Event()
    first = threading.Event()

    def from_pretrained(path, trust_remote_code):
        inside[0] += 1
        most[0] = max(most[0], inside[0])
        if first.is_set():
            second_entered.set()
        else:
            first.set()
            second_entered.wait(timeout=1.0)
        inside[0] -= 1
        return path

    monkeypatch.setattr(AutoTokenizer, "from_pretrained", from_pretrained)
    loads = [threading.Thread(target=load_tokenizer, args=(str(tiny_target_dir), False)) for _ in range(2)]
    loads[0].start()
    assert first.wait(timeout=30)
    loads[1].start()
    for load in loads:
        load.join(timeout=30)
    assert second_entered.is_set() and most[0] == 1
