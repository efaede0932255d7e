"""The reference run's data at a fraction of its size, for bench/rehearsal.py: the seeds' ten datasets, their prompt
counts and answer lengths, written in each public set's own row format, and the run config that reads them.

What the seeds say (../shared/seeds, shared/REFERENCE.md): 88,088 prompts, A1-A2 4,800 pre-tokenized records, B1-B8
83,288 prompts, a 10M completion-token budget per generate set, responses averaging 1,402-1,577 tokens (B1_glaive)
and 3,793 (B2_opencodeinstruct), max_new_tokens 16,384. What they do not say is in `DATASETS` as assumptions, each
stated in docs/bench-rehearsal.md. The datasets' entries (format, on_bad_row, turns) are configs/kimi-k25.yaml's own.
"""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import yaml

from bench import harness

REFERENCE_CONFIG = harness.REPO / "configs" / "kimi-k25.yaml"
SAMPLE_ROWS = harness.REPO / "data" / "formats" / "kimi"  # one file per set, in its public row format
CORPUS = harness.REPO / "data" / "samples"
REFERENCE_BUDGET = 10_000_000  # completion tokens per generate set (kimi-k25.yaml token_budget)
MAX_NEW_TOKENS = 16_384  # kimi-k25.yaml sampling.max_new_tokens
DATA_VERSION = 1  # bump when the synthesis changes: the cached data is rebuilt


@dataclass(frozen=True)
class DataSet:
    """One of the seeds' datasets: how many rows, and how long its prompts and answers are (means in tokens)."""

    name: str
    rows: int  # prompts (generate) or records (passthrough) at the reference size
    answer_mean: float  # generate: the simulated target's mean answer; passthrough: the record's mean length
    answer_sigma: float  # lognormal shape
    prompt_words: float  # mean words of the prompt text we write (the tiny tokenizer: ~1.5 tokens per word)


# Seed figures where the seeds give them (rows; B1's and B2's means), else assumptions (docs/bench-rehearsal.md).
DATASETS = (
    DataSet("A1_deepswekimi", 2_400, 4_000, 0.8, 0),
    DataSet("A2_kimik25", 2_400, 1_500, 0.8, 0),
    DataSet("B1_glaive", 10_000, 1_577, 0.9, 260),
    DataSet("B2_opencodeinstruct", 10_000, 3_793, 1.0, 100),
    DataSet("B3_magicoder", 10_000, 1_000, 0.9, 170),
    DataSet("B4_mixturethoughts", 10_000, 3_000, 1.0, 70),
    DataSet("B5_ultrachat", 10_000, 700, 0.8, 70),
    DataSet("B6_sharegpt", 13_288, 800, 0.9, 100),
    DataSet("B7_openmathinstruct", 10_000, 500, 0.7, 55),
    DataSet("B8_toolcalls", 10_000, 250, 0.8, 330),
)
RECORD_CAP = 32_768  # the longest passthrough record written


def scaled_rows(d: DataSet, size: float) -> int:
    return max(8, round(d.rows * size))


def words() -> list[str]:
    """The words of the corpus the tiny tokenizer was trained on (so characters per token are realistic)."""
    seen: dict[str, None] = {}
    for path in sorted(CORPUS.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            for w in line.replace("\\n", " ").split():
                if w.isalpha() and len(w) < 14:
                    seen.setdefault(w.lower(), None)
    return list(seen)


class Text:
    """Prompt text of a given mean length in words, numbered so that every prompt is distinct."""

    def __init__(self, seed: int):
        self.vocab = np.array(words())
        self.rng = np.random.default_rng(seed)

    def __call__(self, index: int, mean_words: float, sigma: float = 0.6) -> str:
        n = max(3, int(self.rng.lognormal(np.log(mean_words) - sigma**2 / 2, sigma)))
        return f"[{index}] " + " ".join(self.vocab[self.rng.integers(0, len(self.vocab), n)].tolist())


def _templates(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (SAMPLE_ROWS / f"{name}.jsonl").read_text().splitlines() if line.strip()]


def _user_turns(row: dict[str, Any], key: str, role_key: str, user: str) -> list[dict[str, Any]]:
    return [m for m in row.get(key, []) if m.get(role_key) == user]


def prompt_row(entry: dict[str, Any], template: dict[str, Any], index: int, text: Text, mean_words: float) -> dict:
    """`template` (a sample row of the set) with synthetic prompt text of ~`mean_words` words and a unique id, in the
    set's own format (`entry`: its configs/kimi-k25.yaml entry)."""
    row = copy.deepcopy(template)
    fmt = entry.get("format", "messages")
    if fmt == "glaive":
        row["chat"] = row["chat"].replace("USER: ", f"USER: {text(index, mean_words)} ", 1)
    elif fmt == "columns":
        field = entry["prompt_field"]
        row[field] = f"{text(index, mean_words)} {row[field]}"
    elif fmt == "sharegpt":
        first = _user_turns(row, "conversations", "from", "human")[0]
        first["value"] = f"{text(index, mean_words)} {first['value']}"
    else:  # messages: every user turn gets text (turns: all answers each of them)
        turns = _user_turns(row, "messages", "role", "user")
        for k, turn in enumerate(turns):
            turn["content"] = f"{text(index * 10 + k, mean_words / len(turns))} {turn['content']}"
        if "prompt" in row:  # ultrachat's copy of the first user turn
            row["prompt"] = turns[0]["content"]
    id_field = entry.get("id_field", "id")
    if id_field in row:
        row[id_field] = f"{entry['name']}-{index}"
    return row


def passthrough_table(d: DataSet, rows: int, vocab: int, seed: int) -> Any:
    """Pre-tokenized records {id, input_ids, loss_mask} as A1-A2 are: ids in [10, vocab), the loss after a prompt."""
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    lengths = np.clip(
        rng.lognormal(np.log(d.answer_mean) - d.answer_sigma**2 / 2, d.answer_sigma, rows), 16, RECORD_CAP
    )
    lengths = lengths.astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    ids = rng.integers(10, vocab, int(offsets[-1]), dtype=np.int32)
    position = np.arange(int(offsets[-1])) - np.repeat(offsets[:-1], lengths)
    mask = (position >= np.repeat(lengths // 5, lengths)).astype(np.int8)
    list_of = pa.ListArray.from_arrays
    return pa.table(
        {
            "id": [f"{d.name}-{i}" for i in range(rows)],
            "input_ids": list_of(pa.array(offsets, pa.int32()), pa.array(ids, pa.int32())),
            "loss_mask": list_of(pa.array(offsets, pa.int32()), pa.array(mask, pa.int8())),
        }
    )


def reference_entries() -> dict[str, dict[str, Any]]:
    """configs/kimi-k25.yaml's dataset entries by name: the formats and options the rehearsal reads its data with."""
    config = yaml.safe_load(REFERENCE_CONFIG.read_text())
    return {entry["name"]: entry for entry in config["datasets"]}


def write_data(directory: Path, size: float, seed: int, vocab: int) -> dict[str, Any]:
    """The ten datasets at `size` in `directory` (reused when a finished build of the same inputs is there): the
    summary {name: {rows, path, bytes}}."""
    stamp = directory / "DONE.json"
    key = {"version": DATA_VERSION, "size": size, "seed": seed, "vocab": vocab}
    if stamp.is_file() and json.loads(stamp.read_text()).get("key") == key:
        return json.loads(stamp.read_text())["datasets"]
    import pyarrow.parquet as pq

    directory.mkdir(parents=True, exist_ok=True)
    entries = reference_entries()
    text = Text(seed)
    summary: dict[str, Any] = {}
    for k, d in enumerate(DATASETS):
        rows = scaled_rows(d, size)
        if d.name.startswith("A"):
            path = directory / f"{d.name}.parquet"
            pq.write_table(passthrough_table(d, rows, vocab, seed * 100 + k), path)
        else:
            path = directory / f"{d.name}.jsonl"
            templates = _templates(d.name)
            pick = random.Random(seed * 100 + k)
            every_turn = entries[d.name].get("turns") == "all"
            answers = 0
            with path.open("w") as f:
                for i in range(rows):
                    row = prompt_row(entries[d.name], pick.choice(templates), i, text, d.prompt_words)
                    answers += len(_user_turns(row, "messages", "role", "user")) if every_turn else 1
                    f.write(json.dumps(row) + "\n")
        summary[d.name] = {"rows": rows, "path": str(path), "bytes": path.stat().st_size}
        if not d.name.startswith("A"):
            summary[d.name]["answers"] = answers
    stamp.write_text(json.dumps({"key": key, "datasets": summary}, indent=1))
    return summary


def answers(summary: dict[str, Any]) -> dict[str, int]:
    """The answers each generate set asks for: a prompt each, or each user turn (turns: all)."""
    return {name: entry["answers"] for name, entry in summary.items() if "answers" in entry}


def length_rules(path: Path) -> Path:
    """The simulated engine's answer lengths per generate set (emulators/sim --length-rules)."""
    rules = {
        d.name: {"length_dist": "lognormal", "mean_len": d.answer_mean, "sigma": d.answer_sigma}
        for d in DATASETS
        if d.name.startswith("B")
    }
    path.write_text(json.dumps(rules, indent=1))
    return path


def write_config(
    path: Path, run_dir: Path, target: Path, data: dict[str, Any], size: float, sim_url: str, sections: dict
) -> Path:
    """The rehearsal's run config: configs/kimi-k25.yaml's datasets on the written files, budgets scaled by `size`,
    its sampling, the simulated engine as the server, and `sections` (capture, train) on top."""
    reference = yaml.safe_load(REFERENCE_CONFIG.read_text())
    datasets = []
    for name, entry in reference_entries().items():
        entry = {**entry, "path": data[name]["path"]}
        if entry["kind"] == "generate":
            entry["token_budget"] = round(REFERENCE_BUDGET * size)
        if entry["kind"] == "passthrough":
            entry.pop("format", None)  # the rehearsal's A sets are pre-tokenized records
        datasets.append(entry)
    sampling = {k: v for k, v in reference["sampling"].items() if k != "stop_token_ids"}  # the tiny target's own stop
    config = {
        "run_dir": str(run_dir),
        "target": {"path": str(target)},
        "server": {"url": sim_url, "launch": "none", "max_concurrency": 128, "request_timeout_s": 600},
        "sampling": {**sampling, "seed": 0},
        **sections,
        "datasets": datasets,
    }
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path
