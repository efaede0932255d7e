"""The long-answer target's book (models/target/book.py), its sets, and the `kimi-long` build's book training."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from models.target import book, tiny
from models.target.tiny import build_kimi_target, build_target

REPO = Path(__file__).resolve().parents[3]


def _corpus(tmp_path: Path, count: int) -> Path:
    """A corpus of `count` numbered one-sentence prompts, plus rows the book must not take sentences from."""
    path = tmp_path / "corpus.jsonl"
    rows = [{"id": f"r{i}", "prompt": f"Sentence number {i} is here."} for i in range(count)]
    rows += [
        {"id": "short", "prompt": "Too short."},  # under 20 characters
        {"id": "lines", "messages": [{"role": "user", "content": "A first line of text\nand a second line here."}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _numbers(chapter: str) -> list[int]:
    return [int(word) for word in chapter.replace(".", " ").split() if word.isdigit()]


def test_every_sentence_is_in_the_book_once_in_chapters_of_the_set_sizes(tmp_path):
    count = sum(book.CHAPTER_SENTENCES) + 3  # the last chapter takes what is left
    chapters = book.chapters([_corpus(tmp_path, count)], seed=0)
    numbers = [_numbers(c) for c in chapters]
    assert sorted(n for chapter in numbers for n in chapter) == list(range(count))
    assert [len(n) for n in numbers] == [*book.CHAPTER_SENTENCES[:-1], book.CHAPTER_SENTENCES[-1] + 3]
    assert all("Too short" not in c and "second line" not in c for c in chapters)


def test_the_seed_orders_the_book(tmp_path):
    corpus = [_corpus(tmp_path, sum(book.CHAPTER_SENTENCES))]
    assert book.chapters(corpus, seed=0) == book.chapters(corpus, seed=0)
    assert book.chapters(corpus, seed=0) != book.chapters(corpus, seed=1)
    assert _numbers(book.chapters(corpus, seed=0)[0]) != list(range(book.CHAPTER_SENTENCES[0]))  # shuffled


def test_a_corpus_too_small_for_the_book_is_refused_with_its_count(tmp_path):
    too_few = sum(book.CHAPTER_SENTENCES[:-1])
    with pytest.raises(ValueError, match=f"^{too_few} sentences in the corpus .*needs more than {too_few}"):
        book.chapters([_corpus(tmp_path, too_few)], seed=0)


def test_the_sample_corpus_fills_the_book_exactly():
    # the sizes add up to the samples' sentences: a sample file changed shows here first (docs/variants.md's lengths)
    assert len(book.corpus_sentences(sorted(tiny.SAMPLES_DIR.glob("*.jsonl")))) == sum(book.CHAPTER_SENTENCES)


def test_the_demo_generates_the_first_half_and_evaluates_the_second():
    def prompts(path: Path) -> list[str]:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return [row["messages"][-1]["content"] for row in rows]

    generate = prompts(REPO / "data" / "long_answers" / "generate.jsonl")
    assert generate == [f"Write chapter {n} of the book." for n in range(1, 6) for _ in range(4)]
    assert prompts(REPO / "data" / "eval" / "long_answers.jsonl") == [
        f"Write chapter {n} of the book." for n in range(6, 11)
    ]
    # the halves hold the same chapter sizes
    half = len(book.CHAPTER_SENTENCES) // 2
    assert book.CHAPTER_SENTENCES[:half] == book.CHAPTER_SENTENCES[half:]


def test_the_long_answer_build_trains_on_the_book(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny, "BOOK_RECIPE", {**tiny.BOOK_RECIPE, "book_steps": 2})
    plain = build_kimi_target(tmp_path / "plain", train_steps=0)
    long = build_target(tmp_path / "long", "kimi-long", train_steps=0)
    info = json.loads((long / "tiny_target.json").read_text())
    assert info["book_steps"] == 2 and info["book_lr"] == tiny.BOOK_RECIPE["book_lr"]
    assert "book_steps" not in json.loads((plain / "tiny_target.json").read_text())  # the kimi build is unchanged
    a, b = load_file(plain / "model.safetensors"), load_file(long / "model.safetensors")
    assert a.keys() == b.keys()
    assert not all(torch.equal(a[k], b[k]) for k in a)  # the book's two steps moved the weights
    for name in ("tiktoken.model", "tokenizer_config.json"):  # the same tokenizer, as Kimi publishes it
        assert (long / name).read_bytes() == (plain / name).read_bytes()
