"""The tiny target's tokenizer: Kimi-style special tokens and chat template, a byte-level BPE trained on the corpus.

`build_tokenizer` trains it on the text of the corpus rows (models/target/tiny.py passes data/samples/*.jsonl);
`save_tokenizer` writes it in the tokenizer_config.json that transformers 4.x and 5.x both load.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

# Added as special tokens in this order, so their ids are 0..7 in every build.
PAD, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK, END_THINK = SPECIAL_TOKENS = (
    "<|pad|>",
    "<|im_end|>",  # eos and end-of-turn, like Kimi
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
)

# Modelled on Kimi-K2's template: `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>` per message.
# Like Kimi/Qwen3, an assistant message *before the last user message* loses its leading
# `<think>...</think>` block (and the whitespace after it): re-rendering a finished conversation
# does NOT reproduce the ids the model generated. Later stages must keep generated ids instead.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set role = m['role'] -%}"
    "{%- if role == 'system' -%}<|im_system|>"
    "{%- elif role == 'user' -%}<|im_user|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>"
    "{%- elif role == 'tool' -%}<|im_system|>"
    "{%- else -%}{{ raise_exception('unsupported role: ' ~ role) }}"
    "{%- endif -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if role == 'assistant' and loop.index0 < ns.last_user"
    " and content.lstrip().startswith('<think>') and '</think>' in content -%}"
    "{%- set content = content.split('</think>', 1)[1].lstrip() -%}"
    "{%- endif -%}"
    "{{ role }}<|im_middle|>{{ content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def corpus_texts(files: Sequence[Path]) -> Iterator[str]:
    """Text fields of each row, in file order, then row order, then message order."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
                for m in row.get("messages") or []:
                    if isinstance(m, dict) and isinstance(m.get("content"), str):
                        yield m["content"]
                if isinstance(row.get("prompt"), str):
                    yield row["prompt"]


def build_tokenizer(
    files: Sequence[Path], vocab_size: int, model_max_length: int, extra: Sequence[str] = ()
) -> PreTrainedTokenizerFast:
    """A byte-level BPE over the corpus with SPECIAL_TOKENS as ids 0..7; `extra` special tokens get the last ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Registered before training so `<think>` in the corpus is split out, not learned as merges;
    # the trainer puts the same tokens first in the model vocab, so ids are 0..7 in both.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(files), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    tok.add_special_tokens(list(extra))  # after training: the BPE's ids stay those of a build without them
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK, END_THINK, *extra],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes `tokenizer_class: TokenizersBackend` and `extra_special_tokens`;
    # the 4.x names below load the same tokenizer in both 4.x (e.g. next to SGLang) and 5.x.
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    extra = cfg.pop("extra_special_tokens", None)
    if extra is not None:
        cfg["additional_special_tokens"] = extra
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
