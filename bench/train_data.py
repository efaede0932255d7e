"""The train bench's data: records of the tiny target's greedy continuations of the sample conversations, their
hidden states captured in-process and their token counts, cached in runs/bench-train/ by target and settings."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from bench import harness
from bench.train_params import DATASET, Params
from models.capture.job import run as run_capture
from models.common.job_files import CaptureJobFile
from models.ranks.harness import Dist
from models.target.tiny import SAMPLES_DIR
from settings.layout import RunLayout
from settings.target import Target
from tasks.records.build import count_tokens


def data_dir_for(p: Params, target: Path) -> Path:
    key = json.dumps(
        {
            "target": target.name,
            "prompt": p.max_prompt_tokens,
            "new": p.max_new_tokens,
            "samples": sorted(f.name for f in SAMPLES_DIR.glob("*.jsonl")),
        },
        sort_keys=True,
    )
    return harness.REPO / "runs" / "bench-train" / f"data-{hashlib.sha256(key.encode()).hexdigest()[:12]}"


# ---------------------------------------------------------------------------------------------
# Data: records of the target's greedy continuations, captured hidden states, token counts
# ---------------------------------------------------------------------------------------------


def conversations() -> list[list[dict[str, str]]]:
    """Every sample conversation (a bare prompt as one user turn; a trailing assistant turn dropped)."""
    out = []
    for f in sorted(SAMPLES_DIR.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            messages = row.get("messages") or [{"role": "user", "content": row["prompt"]}]
            if len(messages) > 1 and messages[-1]["role"] == "assistant":
                messages = messages[:-1]
            out.append(messages)
    return out


def prepare_data(p: Params, target: Path) -> dict[str, Any]:
    """Records, token_counts.parquet and the captured hidden states, built once into runs/bench-train/."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    root = data_dir_for(p, target)
    done = root / "DONE.json"
    if done.is_file():
        return {**json.loads(done.read_text()), "root": str(root), "reused": True}
    shutil.rmtree(root, ignore_errors=True)
    layout = RunLayout(root)  # laid out as a run directory: records/, hidden/
    records = layout.records(DATASET)
    records.mkdir(parents=True)
    hf_logging.set_verbosity_error()
    saved = torch.get_num_threads()
    # One thread: this tiny model's single-token decode steps are too small to share; with two threads on a
    # busy 2-core machine every step waits for a descheduled thread (10-20x slower here).
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(target)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    t0 = time.perf_counter()
    rows = []
    for i, messages in enumerate(conversations()):
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = tok(text)["input_ids"][: p.max_prompt_tokens]
        with torch.no_grad():
            out = model.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=p.max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )[0].tolist()
        rows.append(harness.record_row(f"c{i:04d}", out, len(prompt)))
    generate_s = time.perf_counter() - t0
    del model
    harness.write_records(rows, records, len(rows))
    count_tokens([records], layout.token_counts, len(tok))  # the records stage's counts
    t0 = time.perf_counter()
    run_capture(
        CaptureJobFile(
            target=Target(path=str(target)),
            datasets=[{"name": DATASET, "records_dir": str(records)}],
            out_dir=str(layout.hidden_dir),
            device="cpu",
            dtype="float32",
            shard_tokens=16384,
            launch_tokens=None,
        ),
        Dist(),
    )
    torch.set_num_threads(saved)
    lengths = [r["num_tokens"] for r in rows]
    info = {
        "records": len(rows),
        "tokens": sum(lengths),
        "loss_tokens": sum(r["num_loss_tokens"] for r in rows),
        **harness.length_summary(lengths),
        "generate_s": generate_s,
        "capture_s": time.perf_counter() - t0,
    }
    done.write_text(json.dumps(info, indent=2))
    return {**info, "root": str(root), "reused": False}
