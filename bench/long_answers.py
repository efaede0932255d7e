"""How long the `kimi-long` target's own answers are: each chapter of its book (models/target/book.py), asked as the
demo asks it, decoded greedily in-process, against the chapter's text.

Per chapter: whether the demo generates it (the draft's training data) or evaluates on it
(data/eval/long_answers.jsonl), the chapter's tokens in the book, the answer's tokens, whether the answer ended its
turn (eos) before max_new_tokens, how many of its first tokens are the book's word for word, and its share of distinct
8-grams (1.00: no 8 tokens twice, no loop). A description of the target, not a ratio (bench/README.md).

    .venv/bin/python bench/long_answers.py [--target-dir DIR] [--max-new-tokens N] [--json FILE]

Without --target-dir the target is built (or reused) in runs/tiny-kimi-long, where `eagle3 demo --target kimi-long`
builds it (~17 min on 2 cores the first time).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench import harness  # noqa: E402

DEMO_TARGET = REPO / "runs" / "tiny-kimi-long"  # configs/demo-kimi-long.yaml's target.path


@dataclass
class Params:
    target_dir: str = ""  # a built kimi-long target; empty: build (or reuse) DEMO_TARGET
    max_new_tokens: int = 3072  # configs/demo-kimi-long.yaml's
    quick: bool = False

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, max_new_tokens=256)


KEPT = "nothing (the target stays where it was built)"  # what --keep DIR keeps
QUICK = "256 new tokens per chapter: a smoke run"  # what --quick runs


def distinct_share(ids: list[int], n: int = 8) -> float:
    """Distinct n-grams over all n-grams of `ids` (1.0 when shorter than n)."""
    grams = [tuple(ids[i : i + n]) for i in range(len(ids) - n + 1)]
    return len(set(grams)) / len(grams) if grams else 1.0


def same_prefix(a: list[int], b: list[int]) -> int:
    """How many first tokens `a` and `b` share."""
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def measure(p: Params, scratch: Path, out: dict[str, Any]) -> None:
    import json

    import torch
    from transformers import AutoTokenizer

    from models.target import book
    from models.target.loader import load_language_model
    from models.target.tiny import SAMPLES_DIR, build_target
    from models.target.tiny_tokenizer import CHAT_TEMPLATE, IM_END

    started = time.monotonic()
    target = Path(p.target_dir) if p.target_dir else build_target(DEMO_TARGET, "kimi-long")
    out["build_s"] = round(time.monotonic() - started, 1)
    info = json.loads((target / "tiny_target.json").read_text())
    if not info.get("book_steps"):
        raise SystemExit(f"{target}: not a kimi-long build (its tiny_target.json has no book_steps)")
    tokenizer = AutoTokenizer.from_pretrained(str(target), trust_remote_code=True)  # Kimi's remote code: ours
    model = load_language_model(str(target), dtype=torch.float32).eval()
    eos = tokenizer.convert_tokens_to_ids(IM_END)
    texts = book.chapters(sorted(SAMPLES_DIR.glob("*.jsonl")), info["seed"])
    split = {**{n: "generate" for n in book.generate_chapters()}, **{n: "eval" for n in book.eval_chapters()}}
    out["chapters"] = []
    for number, text in enumerate(texts, 1):
        messages = book.conversation(number, text)
        prompt = list(
            tokenizer.apply_chat_template(
                messages[:1], chat_template=CHAT_TEMPLATE, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        full = tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, return_dict=True)["input_ids"]
        reference = list(full)[len(prompt) :]  # the chapter and its end of turn
        with torch.no_grad():
            answer = model.generate(
                torch.tensor([prompt]), max_new_tokens=p.max_new_tokens, do_sample=False, eos_token_id=eos
            )[0, len(prompt) :].tolist()
        row = {
            "chapter": number,
            "split": split[number],
            "book_tokens": len(reference) - 1,
            "answer_tokens": len(answer) - (answer[-1:] == [eos]),
            "ended": answer[-1:] == [eos],
            "same_as_book": same_prefix(answer, reference),
            "distinct_8grams": round(distinct_share(answer), 3),
        }
        out["chapters"].append(row)
        print(json.dumps(row), flush=True)


def report(out: dict[str, Any]) -> None:
    head = [
        "chapter",
        "used by",
        "book tokens",
        "answer tokens",
        "ended",
        "same as the book (first tokens)",
        "distinct 8-grams",
    ]
    rows = [
        [
            r["chapter"],
            r["split"],
            f"{r['book_tokens']:,}",
            f"{r['answer_tokens']:,}",
            "yes" if r["ended"] else "no",
            f"{r['same_as_book']:,}",
            f"{r['distinct_8grams']:.2f}",
        ]
        for r in out["chapters"]
    ]
    harness.markdown_table(head, rows, align="rlrrlrr")


def main(argv: list[str] | None = None) -> int:
    return harness.bench_main("long-answers", __doc__, Params, measure, report, argv, kept=KEPT, quick=QUICK)


if __name__ == "__main__":
    sys.exit(main())
