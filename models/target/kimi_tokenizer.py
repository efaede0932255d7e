"""The Kimi build's tokenizer, written as Kimi-K2.5 publishes its own: tiktoken ranks and remote code, no tokenizer.json
file.

`save_kimi_tokenizer` takes the tiny target's byte-level BPE (models/target/tiny_tokenizer.py, trained once, nothing
re-trained here) and writes in a checkpoint directory:
- `tiktoken.model`: tiktoken's mergeable ranks, `base64(token bytes) rank` per line. The rank of each token is its id
  in the BPE, so tiktoken's ids are the BPE's. tiktoken merges, within a piece, the adjacent pair whose concatenation
  has the lowest rank; the BPE merges the pair listed first in its merges. The two agree when the ranks of the merge
  results rise in merge order, which holds for the trained BPE by construction (its trainer gives each new token the
  next id) and is checked here. The single bytes come first (the trainer's initial alphabet, ids 8..263), then each
  merge's result in merge order; the byte-level vocabulary strings are mapped back to their bytes with GPT-2's
  bytes_to_unicode table.
  The special tokens are not ranks: they are tiktoken special tokens (from tokenizer_config.json). The trainer also
  learned merges whose results *are* special tokens (`<` + `think>` -> `<think>`, id 6, and `</think>`, id 7); those
  are left out: the BPE never reaches them, since any text holding a special token's characters has it split out as
  the special token before the BPE runs, in transformers as in tiktoken.
- `tokenization_kimi.py`: our `TikTokenTokenizer` (models/target/kimi_k25_remote/tokenization_kimi.py). Its `pat_str`
  is GPT-2's split, the byte-level BPE's (HF ByteLevel with `use_regex`), written in tiktoken's spelling.
- `tokenizer_config.json`: `tokenizer_class`, `auto_map` (AutoTokenizer -> the remote class, no fast class), the
  special tokens in `added_tokens_decoder` at the BPE's ids, bos/eos/pad/unk, `additional_special_tokens`,
  `model_max_length`.
- `chat_template.jinja`: `KIMI_CHAT_TEMPLATE`.

With `AutoTokenizer.from_pretrained(dir, trust_remote_code=True)` the ids are the fast tokenizer's for the corpus texts
(tests/models/target/test_kimi_tokenizer.py checks every one). Two ways the two could still differ, neither met by the
corpus: tiktoken encodes a piece that is a whole token as that token without merging (the BPE could, in principle,
never reach it by its merges), and tiktoken merges any adjacent pair whose concatenation is a token (the BPE only the
listed pair); runs of over 25,000 whitespace or non-whitespace characters are cut by the remote code (tiktoken's regex
overflows its stack on them).
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from typing import Any

from transformers import PreTrainedTokenizerFast

from models.target.kimi_k25_remote.tokenization_kimi import bytes_to_unicode
from models.target.tiny_tokenizer import CHAT_TEMPLATE

REMOTE_TOKENIZER = Path(__file__).parent / "kimi_k25_remote" / "tokenization_kimi.py"
TOKENIZER_CLASS = "TikTokenTokenizer"
AUTO_MAP = {"AutoTokenizer": [f"tokenization_kimi.{TOKENIZER_CLASS}", None]}
VOCAB_FILE = "tiktoken.model"

# Kimi-K2.5's thinking switch on the project's template: `thinking=False` (a chat-template kwarg) closes an empty
# reasoning block in the generation prompt, so the model answers directly. Otherwise the rendering is CHAT_TEMPLATE's,
# byte for byte. (Kimi-K2.5's own template opens `<think>` in the prompt when thinking; ours leaves that to the model,
# as CHAT_TEMPLATE always has.)
_GENERATION_PROMPT = "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
assert CHAT_TEMPLATE.endswith(_GENERATION_PROMPT)
KIMI_CHAT_TEMPLATE = CHAT_TEMPLATE[: -len(_GENERATION_PROMPT)] + (
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and thinking is false -%}<think></think>{%- endif -%}"
    "{%- endif -%}"
)


def tiktoken_ranks(tokenizer: PreTrainedTokenizerFast) -> dict[bytes, int]:
    """The mergeable ranks that make tiktoken (with PAT_STR) tokenize as the byte-level BPE `tokenizer`: each
    non-special token's bytes at its id. Raises ValueError where the BPE is not one that converts."""
    state = json.loads(tokenizer.backend_tokenizer.to_str())
    model = state["model"]
    _check_bpe(state)
    vocab: dict[str, int] = model["vocab"]
    special = {t["id"]: t["content"] for t in state["added_tokens"] if t["special"]}
    byte_decoder = {c: b for b, c in bytes_to_unicode().items()}

    def token_bytes(token: str) -> bytes:
        try:
            return bytes(byte_decoder[c] for c in token)
        except KeyError as e:
            raise ValueError(f"vocab entry {token!r} is not byte-level (character {e.args[0]!r})") from None

    ranks = {token_bytes(token): i for token, i in vocab.items() if i not in special}
    if len(ranks) != len(vocab) - len(special.keys() & set(vocab.values())):
        raise ValueError("two vocab entries spell the same bytes")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise ValueError(f"the BPE lacks single bytes {missing[:8]}: tiktoken needs all 256")

    # the merge results' ranks must rise in merge order, one merge per token
    last = max(ranks[bytes([b])] for b in range(256))
    produced: set[int] = set()
    for n, merge in enumerate(model["merges"]):
        a, b = merge if isinstance(merge, list) else merge.split(" ", 1)
        result = vocab.get(a + b)
        if result is None:
            raise ValueError(f"merge {n} {a!r} + {b!r} has no vocab entry")
        if result in special:
            continue  # never reached by the BPE: the special token is split out of the text first
        if result <= last or result in produced:
            raise ValueError(
                f"merge {n} {a!r} + {b!r} -> id {result} comes after id {last}: the BPE's ids are not in merge order, "
                "so tiktoken's ranks cannot be its ids"
            )
        produced.add(result)
        last = result
    unmerged = set(ranks.values()) - produced - {ranks[bytes([b])] for b in range(256)}
    if unmerged:
        raise ValueError(f"vocab ids {sorted(unmerged)[:8]} are neither single bytes nor merge results")
    return ranks


def _check_bpe(state: dict[str, Any]) -> None:
    model = state["model"]
    if model.get("type") != "BPE":
        raise ValueError(f"not a BPE tokenizer: {model.get('type')}")
    for key in ("dropout", "unk_token", "continuing_subword_prefix", "end_of_word_suffix"):
        if model.get(key):
            raise ValueError(f"BPE option {key}={model[key]!r} has no tiktoken equivalent")
    if model.get("byte_fallback") or model.get("ignore_merges"):
        raise ValueError("BPE byte_fallback / ignore_merges have no tiktoken equivalent")
    if state.get("normalizer") is not None:
        raise ValueError(f"a normalizer has no tiktoken equivalent: {state['normalizer']}")
    pre = state.get("pre_tokenizer") or {}
    if pre.get("type") != "ByteLevel" or pre.get("add_prefix_space") or not pre.get("use_regex", True):
        raise ValueError(f"the pre-tokenizer must be ByteLevel(add_prefix_space=False, use_regex=True), got {pre}")
    for t in state["added_tokens"]:
        if not t["special"] or t["normalized"] or t["lstrip"] or t["rstrip"] or t["single_word"]:
            raise ValueError(f"added token {t['content']!r}: only plain special tokens convert (tiktoken's kind)")


def save_kimi_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path, chat_template: str) -> None:
    """Write the byte-level BPE `tokenizer` in `out_dir` as Kimi-K2.5 publishes its tokenizer: tiktoken.model,
    tokenization_kimi.py, tokenizer_config.json and chat_template.jinja (`chat_template`, e.g. KIMI_CHAT_TEMPLATE).

    No tokenizer.json: one already in `out_dir` (the fast tokenizer's `save_pretrained`) is removed, so the directory
    holds the tokenizer only as Kimi publishes it."""
    out_dir = Path(out_dir)
    ranks = tiktoken_ranks(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    lines = [base64.b64encode(token).decode("ascii") + f" {rank}\n" for token, rank in sorted(ranks.items(), key=_rank)]
    (out_dir / VOCAB_FILE).write_text("".join(lines), encoding="ascii")
    shutil.copyfile(REMOTE_TOKENIZER, out_dir / REMOTE_TOKENIZER.name)

    added = {i: t for i, t in sorted(tokenizer.added_tokens_decoder.items()) if t.special}
    named = {
        "bos_token": tokenizer.bos_token,
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "unk_token": tokenizer.unk_token,
    }
    config = {
        "tokenizer_class": TOKENIZER_CLASS,
        "auto_map": AUTO_MAP,
        "added_tokens_decoder": {
            str(i): {
                "content": t.content,
                "lstrip": t.lstrip,
                "normalized": t.normalized,
                "rstrip": t.rstrip,
                "single_word": t.single_word,
                "special": True,
            }
            for i, t in added.items()
        },
        **named,
        "additional_special_tokens": [t.content for t in added.values() if t.content not in named.values()],
        "model_max_length": tokenizer.model_max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "chat_template.jinja").write_text(chat_template)
    (out_dir / "tokenizer.json").unlink(missing_ok=True)


def _rank(item: tuple[bytes, int]) -> int:
    return item[1]
