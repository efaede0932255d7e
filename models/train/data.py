"""Training data for the draft: samples, the held-out split, token-budget batches, and the rank deal.

A sample is one record, known by (dataset, id) and its length in tokens. It comes either from the
captured hidden states (offline: `HiddenSource`, rows of a safetensors shard) or from the records
themselves with the target run inside the training job (online: `OnlineSource`, see models/train/job.py).

The order is a pure function of (seed, epoch) and the sample list, so every rank computes the same
batches without talking to the others, and a resumed run that knows (epoch, step) continues with
exactly the batches it would have seen.
"""

from __future__ import annotations

import hashlib
import json
import random
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.capture.records import make_batches
from models.capture.shards import METADATA_NAME, iter_shard_index, read_sample, storage_of

# of hidden/metadata.json (`storage` only in an fp8 capture's: absent, a native one's fingerprint is as before)
CAPTURE_IDENTITY = ("target", "hidden_size", "num_layers", "aux_layers", "dtype", "storage")
SORT_WINDOW = 64  # samples sorted by length inside windows this big before packing: less padding, still shuffled


@dataclass(frozen=True, slots=True)
class TrainSample:
    """One record: where its tokens (and, offline, its hidden states) are; `length` after any cut."""

    dataset: str
    id: str
    length: int
    ref: tuple  # offline: (shard path, offset); online: (part index, start)


@dataclass
class Batch:
    """Right-padded tensors of one micro batch (B samples, T = longest length)."""

    input_ids: torch.Tensor  # [B, T] int64
    loss_mask: torch.Tensor  # [B, T] bool
    attention_mask: torch.Tensor  # [B, T] bool
    aux_hidden: torch.Tensor  # [B, T, 3Ht]
    last_hidden: torch.Tensor  # [B, T, Ht]

    @property
    def tokens(self) -> int:
        return int(self.attention_mask.sum())


def held_out(dataset: str, sample_id: str, fraction: float) -> bool:
    """Whether a sample belongs to the held-out split: a stable hash of (dataset, id) below `fraction`.

    The split depends on nothing but the key, so training, its eval and `eagle3 eval` agree on it
    across runs, resumes and world sizes.
    """
    if fraction <= 0:
        return False
    digest = hashlib.sha256(f"{dataset}\0{sample_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 < fraction


def split_samples(samples: list[TrainSample], fraction: float) -> tuple[list[TrainSample], list[TrainSample]]:
    """(train, held out). With a positive fraction and >= 2 samples, at least one is held out."""
    held = [s for s in samples if held_out(s.dataset, s.id, fraction)]
    if fraction > 0 and not held and len(samples) >= 2:
        key = lambda s: hashlib.sha256(f"{s.dataset}\0{s.id}".encode()).digest()  # noqa: E731
        held = [min(samples, key=key)]
    keys = {(s.dataset, s.id) for s in held}
    return [s for s in samples if (s.dataset, s.id) not in keys], held


def epoch_batches(samples: list[TrainSample], max_batch_tokens: int, seed: int, epoch: int) -> list[list[TrainSample]]:
    """This epoch's micro batches (padded size B x longest <= max_batch_tokens), in training order.

    Shuffle, sort by length inside windows of SORT_WINDOW samples (batches of similar lengths
    waste little padding), pack greedily, shuffle the batches. Deterministic in (seed, epoch).
    """
    rng = random.Random(f"{seed}:{epoch}")
    order = sorted(samples, key=lambda s: (s.dataset, s.id))
    rng.shuffle(order)
    batches: list[list[TrainSample]] = []
    for w in range(0, len(order), SORT_WINDOW):
        batches += make_batches(sorted(order[w : w + SORT_WINDOW], key=lambda s: -s.length), max_batch_tokens)
    rng.shuffle(batches)
    return batches


def data_fingerprint(rows: Iterable[tuple[str, str, int]], source: dict[str, Any]) -> dict[str, Any]:
    """What a checkpoint remembers of its training data: a digest of the sorted (dataset, id, length) rows.

    `source` names where the samples come from (mode, the capture's target and layers, ...); it is
    hashed too, and kept readable so that a mismatch can say what changed. Lengths are the full
    (uncut) ones: the cut follows from max_batch_tokens, a setting of its own.
    """
    keys = sorted((str(d), str(i), int(n)) for d, i, n in rows)
    h = hashlib.sha256(json.dumps(source, sort_keys=True).encode())
    for d, i, n in keys:
        h.update(f"{d}\0{i}\0{n}\n".encode())
    return {"digest": h.hexdigest(), "samples": len(keys), "tokens": sum(n for _, _, n in keys), **source}


def steps_per_epoch(num_batches: int, world_size: int, grad_accum: int) -> int:
    """Optimizer steps in one epoch: every rank runs grad_accum micro batches per step.

    The last incomplete round is dropped (a few batches an epoch); fewer batches than one round
    still make one step, with batches repeated.
    """
    return max(1, num_batches // (world_size * grad_accum)) if num_batches else 0


def rank_micro_batches(
    batches: list[list[TrainSample]], step: int, rank: int, world_size: int, grad_accum: int
) -> list[list[TrainSample]]:
    """The micro batches rank `rank` runs in optimizer step `step` of the epoch (round-robin deal)."""
    first = step * world_size * grad_accum
    return [batches[(first + m * world_size + rank) % len(batches)] for m in range(grad_accum)]


def eval_share(batches: list[list[TrainSample]], rank: int, world_size: int) -> list[list[TrainSample]]:
    """The held-out batches this rank evaluates (each batch on exactly one rank)."""
    return batches[rank::world_size]


class HiddenSource:
    """Samples and batches from captured hidden states (RUN_DIR/hidden shards)."""

    def __init__(self, hidden_dir: str | Path, max_len: int):
        self.hidden_dir = Path(hidden_dir)
        self.max_len = int(max_len)
        rows = list(iter_shard_index(self.hidden_dir))
        if not rows:
            raise FileNotFoundError(f"{self.hidden_dir}: no hidden-state shards; run the capture stage first")
        storage_of(self.hidden_dir)  # raises MixedShards: training reads one storage and dtype per directory
        self.cut = sum(1 for r in rows if r["length"] > self.max_len)
        self.samples = [
            TrainSample(
                r["dataset"],
                r["id"],
                min(int(r["length"]), self.max_len),
                (str(self.hidden_dir / r["shard"]), int(r["offset"])),
            )
            for r in rows
        ]
        # Not the shard layout (a capture resumed differently holds the same samples), but the
        # capture's target and layers: the same ids and lengths from another target are other data.
        meta_path = self.hidden_dir / METADATA_NAME
        meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
        source = {"mode": "offline", **{k: meta[k] for k in CAPTURE_IDENTITY if k in meta}}
        self.fingerprint = data_fingerprint(((r["dataset"], r["id"], r["length"]) for r in rows), source)

    def batch(self, samples: list[TrainSample], device: torch.device) -> Batch:
        width = max(s.length for s in samples)
        parts = [read_sample(s.ref[0], s.ref[1], s.length) for s in samples]
        return pad_batch(
            [(p["input_ids"], p["loss_mask"], p["aux_hidden"], p["last_hidden"]) for p in parts], width, device
        )


def pad_batch(
    rows: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]], width: int, device: torch.device
) -> Batch:
    """Right-pad (ids [n], mask [n], aux [n, 3H], last [n, H]) rows to `width` and stack them."""
    b = len(rows)
    aux_w, last_w, dtype = rows[0][2].shape[-1], rows[0][3].shape[-1], rows[0][2].dtype
    input_ids = torch.zeros(b, width, dtype=torch.long)
    loss_mask = torch.zeros(b, width, dtype=torch.bool)
    attention = torch.zeros(b, width, dtype=torch.bool)
    aux = torch.zeros(b, width, aux_w, dtype=dtype)
    last = torch.zeros(b, width, last_w, dtype=dtype)
    for i, (ids, mask, a, h) in enumerate(rows):
        n = ids.shape[0]
        input_ids[i, :n] = ids.to(torch.long)
        loss_mask[i, :n] = mask.bool()
        attention[i, :n] = True
        aux[i, :n] = a
        last[i, :n] = h
    return Batch(input_ids.to(device), loss_mask.to(device), attention.to(device), aux.to(device), last.to(device))


def held_out_prompts(
    datasets: list, fraction: float, limit: int, vocab_size: int | None = None
) -> list[tuple[str, str, list[int]]]:
    """(dataset, id, prompt ids) of up to `limit` held-out records: the tokens before the first loss token.

    `datasets` are `models.common.job_files.DatasetRecords`. The order is the held-out hash order, so the
    same prompts come back on every call.
    """
    out = []
    for dataset, sid, ids, mask in held_out_records(datasets, fraction, vocab_size):
        first = mask.index(True)
        if first == 0:
            continue  # nothing to condition on
        out.append((dataset, sid, ids[:first]))
        if len(out) == limit:
            break
    return out


def held_out_records(
    datasets: list, fraction: float, vocab_size: int | None = None
) -> Iterator[tuple[str, str, list[int], list[bool]]]:
    """(dataset, id, token ids, loss mask) of each held-out record (each has a loss token), in the held-out hash order
    (`held_out_prompts`' order), read one at a time."""
    import numpy as np

    from models.capture.records import held, load_records

    samples, parts, _ = load_records(datasets, vocab_size, keep_tokens=False)
    chosen = [s for s in samples if held_out(s.dataset, s.id, fraction)]
    chosen.sort(key=lambda s: hashlib.sha256(f"{s.dataset}\0{s.id}".encode()).digest())
    chosen, parts = held(chosen, parts)  # the held-out records' tokens only
    for s in chosen:
        mask = parts[s.part].loss_mask[s.start : s.start + s.length]
        ids = parts[s.part].input_ids[s.start : s.start + s.length].astype(np.int64).tolist()
        yield s.dataset, s.id, ids, mask.astype(bool).tolist()
