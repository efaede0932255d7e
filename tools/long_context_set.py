"""Write data/eval/long_context.jsonl: long conversations for acceptance by context position (`eval.context_buckets`).

Each row is a conversation in the `chat` benchmark format ({"id", "messages"}, models/eval/benchmarks.py): earlier
turns taken whole from the passthrough sample conversations (data/samples/passthrough_chat.jsonl, their system
messages left out), then one question of the held-out eval prompts (data/eval/prompts.jsonl) as the last user turn.
The conversations are drawn (seeded, without repeats within a row) until the row's text reaches its size:
LENGTHS characters of message content, ROWS_PER_LENGTH rows each. On the tiny targets' tokenizer (~2.8 characters a
token with the chat template) the sizes land in the buckets 0-512, 512-1024, 1024-2048 and 2048-4096 tokens
(data/eval/README.md has the measured lengths).

Why this shape: the tiny targets answer in tens of tokens, so the long context is the conversation before the
answer. Its turns are text the draft was trained on (the passthrough dataset's) at positions it never was: what
changes with the bucket is the position, not the text. Kimi-K2.5's own long context is its answer (1,400-3,800
tokens of reasoning); the eval buckets each verify round by where it starts either way (models/eval/context.py).

    .venv/bin/python tools/long_context_set.py            # (re)write the file
    .venv/bin/python tools/long_context_set.py --check    # exit 1 if the committed file is not this script's output
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HISTORY = REPO / "data" / "samples" / "passthrough_chat.jsonl"
QUESTIONS = REPO / "data" / "eval" / "prompts.jsonl"
OUT = REPO / "data" / "eval" / "long_context.jsonl"
LENGTHS = (900, 2000, 4200, 8400)  # characters of message content per row, one size per bucket
ROWS_PER_LENGTH = 6
SEED = 0


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def _question(row: dict) -> dict[str, str]:
    """The eval prompt's last user turn (rows hold `messages` or `prompt`)."""
    if "messages" in row:
        return {"role": "user", "content": row["messages"][-1]["content"]}
    return {"role": "user", "content": row["prompt"]}


def build_rows() -> list[dict]:
    """The set's rows, the same on every run (seeded)."""
    history = [[m for m in row["messages"] if m["role"] != "system"] for row in _jsonl(HISTORY)]
    history = [h for h in history if h and h[-1]["role"] == "assistant"]  # whole exchanges only
    questions = _jsonl(QUESTIONS)
    rng = random.Random(SEED)
    rows = []
    for size in LENGTHS:
        for n in range(1, ROWS_PER_LENGTH + 1):
            order = rng.sample(range(len(history)), len(history))
            messages: list[dict[str, str]] = []
            for i in order:
                if sum(len(m["content"]) for m in messages) >= size:
                    break
                messages.extend(history[i])
            if sum(len(m["content"]) for m in messages) < size:
                raise ValueError(f"{HISTORY}: too little text for a {size}-character row")
            messages.append(_question(questions[rng.randrange(len(questions))]))
            rows.append({"id": f"long-{size}-{n}", "messages": messages})
    return rows


def render(rows: list[dict]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--check", action="store_true", help="exit 1 if the committed file differs from the output")
    args = ap.parse_args(argv)
    text = render(build_rows())
    if args.check:
        same = OUT.is_file() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT}: {'up to date' if same else 'differs from tools/long_context_set.py output: rerun it'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT} ({len(text.splitlines())} rows)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
