"""The book: how the long-answer tiny Kimi target (shape `kimi-long`) writes answers of hundreds to thousands of tokens.

Kimi-K2.5 answers at length (1,400-3,800 tokens of reasoning on average in the seeds' run), and a draft's acceptance
changes with the position in such an answer. The tiny targets answer in tens of tokens and loop when forced on. What
a tiny model learns in minutes is text it has read many times; so the `kimi-long` target is the Kimi target trained
further on a book: the corpus's sentences (data/samples/*.jsonl), each once, in an order drawn from the build's seed,
cut into chapters of CHAPTER_SENTENCES sentences (~23 tokens a sentence: chapters of ~100 to ~2,400 tokens). Asked
`chapter_prompt(k)`, it writes chapter k and ends the turn: a long answer of its own, not a loop (every sentence is
in the book once), and not always word for word (measured in docs/variants.md).

The chapter sizes come twice: `generate_chapters` (the first half) are what the demo generates records for, the
draft's training data; `eval_chapters` (the second half, the same sizes) are the eval's long answers, which the
draft has not been trained on (data/long_answers/generate.jsonl, data/eval/long_answers.jsonl; bench/long_answers.py
measures the answers).
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Sequence
from pathlib import Path

# Sentences per chapter, in book order: the first half of the chapters and the second hold the same sizes.
CHAPTER_SENTENCES = (4, 12, 24, 48, 108) * 2
# A sentence of the book: one line of corpus text, long enough to be a sentence, short enough to be one.
SENTENCE_CHARS = (20, 300)


def corpus_sentences(files: Sequence[Path]) -> list[str]:
    """The distinct one-line sentences of the corpus rows' text (prompts and every message), sorted."""
    found: set[str] = set()
    for path in files:
        for line in Path(path).read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            texts = [m["content"] for m in row.get("messages") or [] if isinstance(m.get("content"), str)]
            if isinstance(row.get("prompt"), str):
                texts.append(row["prompt"])
            for text in texts:
                for sentence in re.split(r"(?<=[.?!])\s+", text.strip()):
                    if SENTENCE_CHARS[0] <= len(sentence) <= SENTENCE_CHARS[1] and "\n" not in sentence:
                        found.add(sentence)
    return sorted(found)


def chapters(files: Sequence[Path], seed: int) -> list[str]:
    """The book's chapters, in order: every corpus sentence once, shuffled by `seed`, cut by CHAPTER_SENTENCES.

    The last chapter takes what is left (the sample corpus holds exactly the 392 the sizes add up to); a corpus that
    leaves it nothing is a ValueError.
    """
    sentences = corpus_sentences(files)
    before_last = sum(CHAPTER_SENTENCES[:-1])
    if len(sentences) <= before_last:
        raise ValueError(
            f"{len(sentences)} sentences in the corpus ({', '.join(str(f) for f in files)}): the long-answer book "
            f"needs more than {before_last} ({len(CHAPTER_SENTENCES)} chapters of {CHAPTER_SENTENCES} sentences)"
        )
    random.Random(seed).shuffle(sentences)
    ends = [*(sum(CHAPTER_SENTENCES[: n + 1]) for n in range(len(CHAPTER_SENTENCES) - 1)), len(sentences)]
    return [" ".join(sentences[start:end]) for start, end in zip([0, *ends[:-1]], ends, strict=True)]


def chapter_prompt(number: int) -> str:
    """The user turn that asks for chapter `number` (1-based)."""
    return f"Write chapter {number} of the book."


def conversation(number: int, text: str) -> list[dict[str, str]]:
    """The training conversation of one chapter: the request, and the chapter as the answer."""
    return [{"role": "user", "content": chapter_prompt(number)}, {"role": "assistant", "content": text}]


def generate_chapters() -> range:
    """The chapter numbers the demo generates records for (the first half of the book)."""
    return range(1, len(CHAPTER_SENTENCES) // 2 + 1)


def eval_chapters() -> range:
    """The chapter numbers of the eval's long answers (the second half: the same sizes, not trained on)."""
    return range(len(CHAPTER_SENTENCES) // 2 + 1, len(CHAPTER_SENTENCES) + 1)
