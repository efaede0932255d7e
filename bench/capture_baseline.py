"""The capture bench's baselines: bare forward loops (and our per-batch code without the launcher) over the same
batches, each in a fresh spawned process like a rank (bench/capture.py's docstring, part 1)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from bench import harness  # first: the offline environment the spawned baselines inherit
from bench.capture_params import DATASET, Params
from models.capture.job import capture_batch, forward_kwargs, padded_batch, write_sample
from models.capture.records import deal, load_records, make_batches
from models.common.job_files import DatasetRecords


@dataclass
class Bare:
    label: str
    kind: str  # "bare" (the 1-rank baseline), "in-process", "bare-all-cores", "bare-parallel"
    processes: int
    threads: int
    batches: int
    tokens: int
    padded_tokens: int
    wall_s: float  # the loop(s) only: first process's start -> last process's end
    cpu_s: float  # the loops' CPU seconds, all processes
    tokens_per_s: float
    startup_s: float | None = None  # spawn -> every process ready (interpreter, imports, model load)
    model_load_s: float | None = None  # from_pretrained alone, slowest process
    per_process: list[dict[str, Any]] = field(default_factory=list)
    pass_no: int = 0


def bare_loop(
    model, batches, parts, pad_id: int, aux_layers: list[int], keep: set[tuple[str, str]]
) -> tuple[int, dict]:
    """Forward every batch; the hidden states are dropped (cloned only for the `keep` samples). Returns tokens.

    The batches and call kwargs are models.capture's (`padded_batch`, `forward_kwargs`: logits_to_keep=1).
    """
    kwargs = forward_kwargs(model)
    kept: dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]] = {}
    tokens = 0
    with torch.no_grad():
        for batch in batches:
            input_ids, attention_mask = padded_batch(batch, parts, pad_id)
            out = model(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
            tokens += sum(s.length for s in batch)
            for i, s in enumerate(batch):
                if (s.dataset, s.id) in keep:
                    h = out.hidden_states
                    kept[(s.dataset, s.id)] = (
                        torch.cat([h[k + 1][i, : s.length] for k in aux_layers], -1).clone(),
                        h[-1][i, : s.length].clone(),
                    )
            del out
    return tokens, kept


def inproc_loop(
    model, batches, parts, pad_id: int, aux_layers: list[int], num_layers: int, shard_tokens: int, out_dir: Path
) -> int:
    """The rank's loop body without the launcher: models.capture.job.capture_batch + ShardWriter. Returns tokens."""
    from models.capture.shards import ShardWriter

    kwargs = forward_kwargs(model)
    tokens = 0
    with ShardWriter(out_dir, 0, shard_tokens, aux_layers=aux_layers) as writer, torch.no_grad():
        for batch in batches:
            for s, aux, last in capture_batch(
                model, batch, parts, aux_layers, num_layers, pad_id, torch.device("cpu"), kwargs
            ):
                write_sample(writer, parts, s, aux, last)
                tokens += s.length
    return tokens


def baseline_process(cfg: dict[str, Any], rank: int, barrier: Any) -> dict[str, Any]:
    """One baseline process (spawned): load the model, wait for its peers, run its share, report."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.set_num_threads(cfg["threads"])
    t0 = time.monotonic()
    model = AutoModelForCausalLM.from_pretrained(cfg["target"], dtype=getattr(torch, cfg["dtype"]))
    model = model.eval().requires_grad_(False)
    load_s = time.monotonic() - t0
    samples, parts, _ = load_records(
        [DatasetRecords(name=DATASET, records_dir=cfg["records_dir"])], model.config.vocab_size
    )
    batches = make_batches(deal(samples, cfg["processes"])[rank], cfg["max_batch_tokens"])
    ready = time.monotonic()
    barrier.wait()
    start, cpu0 = time.monotonic(), time.process_time()
    kept: dict = {}
    if cfg["kind"] == "in-process":
        tokens = inproc_loop(
            model,
            batches,
            parts,
            cfg["pad_id"],
            cfg["aux_layers"],
            model.config.num_hidden_layers,
            cfg["shard_tokens"],
            Path(cfg["out_dir"]),
        )
    else:
        tokens, kept = bare_loop(model, batches, parts, cfg["pad_id"], cfg["aux_layers"], set(map(tuple, cfg["keep"])))
    end, cpu = time.monotonic(), time.process_time() - cpu0
    return {
        "rank": rank,
        "ready": ready,
        "start": start,
        "end": end,
        "cpu_s": cpu,
        "tokens": tokens,
        "batches": len(batches),
        "padded_tokens": sum(len(b) * max(s.length for s in b) for b in batches),
        "load_s": load_s,  # numpy, pickled by value (no shared-memory handles outliving this process)
        "kept": {k: (a.numpy(), b.numpy()) for k, (a, b) in kept.items()},
    }


def baseline(
    p: Params,
    label: str,
    kind: str,
    processes: int,
    threads: int,
    target: Path,
    records_dir: Path,
    pad_id: int,
    aux_layers: list[int],
    keep: set | None = None,
    out_dir: Path | None = None,
) -> tuple[Bare, dict]:
    """Run a baseline in `processes` fresh processes at once (spawned with OMP_NUM_THREADS=threads, as a rank)."""
    cfg = {
        "kind": kind,
        "processes": processes,
        "threads": threads,
        "target": str(target),
        "dtype": p.dtype,
        "records_dir": str(records_dir),
        "max_batch_tokens": p.max_batch_tokens,
        "shard_tokens": p.shard_tokens,
        "pad_id": pad_id,
        "aux_layers": aux_layers,
        "keep": sorted(keep or ()),
        "out_dir": str(out_dir),
    }
    results, spawned = harness.spawn(
        baseline_process,
        [(cfg, r) for r in range(processes)],
        threads=threads,
        timeout_s=p.timeout_s,
        what=f"baseline {label!r}",
    )
    wall = max(x["end"] for x in results) - min(x["start"] for x in results)
    tokens = sum(x["tokens"] for x in results)
    kept = {k: (torch.from_numpy(a), torch.from_numpy(b)) for x in results for k, (a, b) in x.pop("kept").items()}
    b = Bare(
        label,
        kind,
        processes,
        threads,
        sum(x["batches"] for x in results),
        tokens,
        sum(x["padded_tokens"] for x in results),
        wall,
        sum(x["cpu_s"] for x in results),
        tokens / wall,
        startup_s=max(x["ready"] for x in results) - spawned,
        model_load_s=max(x["load_s"] for x in results),
        per_process=[
            {
                "rank": x["rank"],
                "tokens": x["tokens"],
                "wall_s": x["end"] - x["start"],
                "cpu_s": x["cpu_s"],
                "tokens_per_s": x["tokens"] / (x["end"] - x["start"]),
            }
            for x in results
        ],
    )
    return b, kept
