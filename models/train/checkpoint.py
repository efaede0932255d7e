"""The train job's checkpoints: saved whole or not at all, resumed only by a launch of the same run (fingerprint).

A checkpoint is RUN_DIR/draft/checkpoints/step-NNNNNNNN/ (DeepSpeed's files, the position in its client state,
rng-rank-R.pt per rank, fingerprint.json) and counts once its COMPLETE marker is renamed into place. The
fingerprint holds digests of the training data and the draft vocabulary and the settings that shape the
optimisation; a launch whose fingerprint differs stops before it trains or removes anything. A failed write is
WriteFailed naming the kept checkpoint (`writing`).
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from models.common.atomic import fsync_tree, write_atomic
from models.common.file_errors import WriteFailed, existing_parent, is_write_error
from models.common.job_files import TrainJobFile
from models.draft.config import DRAFT_VARIANTS, Eagle3Config
from models.ranks.harness import Dist, log
from settings.train import STEP_DECAY

COMPLETE = "COMPLETE"


LATEST = "latest"


FINGERPRINT = "fingerprint.json"
# Eagle3Config fields added after fingerprint version 1 (train.draft_variant, train.norm_before_fc/_residual,
# train.draft_arch and the MLA widths and rope scaling it takes from the target), each with the old draft's value
LATER_DRAFT_FIELDS: dict[str, Any] = {
    **dict.fromkeys(("fc_norm", "norm_output", "norm_before_fc", "norm_before_residual"), False),
    "draft_arch": "llama",
    **dict.fromkeys(("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim"), None),
    "rope_scaling": None,
}


RESUME = (
    "make room there (or set train.out_dir to a disk with room), then run the train stage again: "
    "it resumes from the kept checkpoint"
)


class CheckpointMismatch(ValueError):
    """The checkpoint to resume was trained on other data or with other settings than this launch."""


@dataclass
class Position:
    """Where training stands: saved in every checkpoint's client state."""

    step: int = 0  # optimizer steps done in total
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in `epoch`
    tokens: int = 0  # real (unpadded) tokens trained on, all ranks


def complete_checkpoints(ckpt_dir: Path) -> list[tuple[int, str]]:
    """(step, tag) of every checkpoint with its COMPLETE marker, oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        if p.is_dir() and p.name.startswith("step-") and (p / COMPLETE).is_file():
            found.append((int(p.name.removeprefix("step-")), p.name))
    return sorted(found)


def save_checkpoint(
    ds_model, ckpt_dir: Path, position: Position, keep: int, dist: Dist, fingerprint: dict[str, Any]
) -> None:
    """Save a checkpoint; it counts only once COMPLETE is renamed into place (rank 0, after every rank).

    A failed write raises WriteFailed before COMPLETE exists: the partial tag is ignored (and removed
    by the next launch), the older complete ones are untouched (pruning runs only after success).
    """
    tag = f"step-{position.step:08d}"
    with writing(ckpt_dir / tag, ckpt_dir):
        ds_model.save_checkpoint(str(ckpt_dir), tag=tag, client_state={"position": asdict(position)}, save_latest=False)
        rng = {
            "python": random.getstate(),
            "numpy": np.random.get_state(),
            "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state()
            if torch.cuda.is_available() and ds_model.device.type == "cuda"
            else None,
        }
        torch.save(rng, ckpt_dir / tag / f"rng-rank-{dist.rank}.pt")
    dist.barrier()  # every rank's files are on disk
    if dist.rank == 0:
        with writing(ckpt_dir / tag, ckpt_dir):
            (ckpt_dir / tag / FINGERPRINT).write_text(json.dumps(fingerprint, indent=1))
            fsync_tree(ckpt_dir / tag)
            # Renamed, not written in place: a marker cut short by a full disk must not exist at all.
            write_atomic(ckpt_dir / tag / COMPLETE, json.dumps(asdict(position)))
        with writing(ckpt_dir / LATEST, ckpt_dir):
            write_atomic(ckpt_dir / LATEST, tag)
        for _, old in complete_checkpoints(ckpt_dir)[:-keep]:
            shutil.rmtree(ckpt_dir / old, ignore_errors=True)
    dist.barrier()


def kept_checkpoint(ckpt_dir: Path) -> str:
    """What a stopped run keeps, in words: its newest complete checkpoint, or that it has none."""
    done = complete_checkpoints(ckpt_dir)
    if not done:
        return f"no complete checkpoint in {ckpt_dir} yet (the next launch starts from step 0)"
    step, tag = done[-1]
    return f"checkpoint {tag} (complete, step {step:,}) in {ckpt_dir}"


@contextmanager
def writing(path: Path, ckpt_dir: Path, also: str = "") -> Iterator[None]:
    """Turn a failed write under `path` into WriteFailed, naming the kept checkpoint and how to resume.

    torch.save and safetensors report a full disk as RuntimeError/SafetensorError text without an
    errno: for those, a small probe write where the failed one went tells whether the storage refused.
    """
    try:
        yield
    except WriteFailed:
        raise
    except Exception as e:  # noqa: BLE001 - only storage errors are translated, the rest re-raised
        cause = e if is_write_error(e) else None if isinstance(e, OSError) else _probe_write(path)
        if cause is None:
            raise
        # The file inside a checkpoint that failed tells more than its directory; a temp name beside `path` less.
        named = Path(e.filename) if isinstance(e, OSError) and e.filename else None
        where = named if named is not None and named.is_relative_to(path) else path
        kept = kept_checkpoint(ckpt_dir) + (f"; {also}" if also else "")
        raise WriteFailed(where, cause, kept=kept, resume=RESUME) from None


def _probe_write(path: Path, size: int = 1 << 20) -> OSError | None:
    """The OSError that writing (and syncing) `size` bytes beside `path` raises now, or None if it works."""
    probe = existing_parent(path.parent if not path.is_dir() else path) / f".write-probe-{os.getpid()}"
    try:
        with open(probe, "wb") as f:
            f.write(bytes(size))
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        return e if is_write_error(e) else None
    finally:
        try:
            probe.unlink()
        except OSError:
            pass
    return None


def run_fingerprint(
    job: TrainJobFile, data: dict[str, Any], d2t: torch.Tensor, config: Eagle3Config, world_size: int, total_steps: int
) -> dict[str, Any]:
    """What makes a checkpoint this run's: data, draft vocabulary and the settings that shape the optimisation.

    Not in it, on purpose: log_every, checkpoint_every, keep_checkpoints, eval_every (how the run is
    watched and saved) and where files live. `total_steps` stands for epochs/max_steps: the cosine
    schedule is laid out over it, so extending a run would change the learning rate of every step left.
    """
    draft = asdict(config)
    for field, old in LATER_DRAFT_FIELDS.items():  # absent from the fingerprints written before them
        if draft[field] == old:
            del draft[field]
    settings = {
        **optimisation_settings(job, world_size),
        "total_steps": total_steps,
        **{f"draft.{k}": v for k, v in draft.items()},
    }
    ids = d2t.to(torch.int64).cpu().numpy().tobytes()
    vocab = {"digest": hashlib.sha256(ids).hexdigest(), "size": int(d2t.shape[0]), "token_counts": job.token_counts}
    return {"version": 1, "data": data, "vocab": vocab, "settings": settings}


def variant_settings(job: TrainJobFile) -> dict[str, bool]:
    """The fingerprint's draft flags that train.draft_variant and train.norm_before_* set, the ones off too: what
    `eagle3 doctor` compares with a checkpoint's (`checkpoint_settings`) besides `optimisation_settings`."""
    flags: dict[str, Any] = {
        **DRAFT_VARIANTS[job.draft_variant],
        "norm_before_fc": job.norm_before_fc,
        "norm_before_residual": job.norm_before_residual,
        "draft_arch": job.draft_arch,
    }
    return {f"draft.{flag}": on for flag, on in flags.items()}


def checkpoint_settings(fingerprint: dict[str, Any]) -> dict[str, Any]:
    """A fingerprint's settings with its later draft fields filled in: absent means the old draft's value."""
    return {f"draft.{field}": old for field, old in LATER_DRAFT_FIELDS.items()} | fingerprint.get("settings", {})


def optimisation_settings(job: TrainJobFile, world_size: int) -> dict[str, Any]:
    """The fingerprint's settings that the job alone decides (no data, target or schedule length): what
    `eagle3 doctor` compares with a checkpoint before anything is launched."""
    return {
        "mode": job.mode,
        "ttt_steps": job.ttt_steps,
        "max_batch_tokens": job.max_batch_tokens,
        "lr": job.lr,
        "warmup_ratio": job.warmup_ratio,
        "min_lr_ratio": job.min_lr_ratio,
        "weight_decay": job.weight_decay,
        "betas": list(job.adam_betas),
        "grad_clip": job.grad_clip,
        "grad_accum": job.grad_accum,
        "world_size": world_size,
        "bf16": job.bf16,
        "seed": job.seed,
        "eval_fraction": job.eval_fraction,
        # added later: absent from older fingerprints, so written only when not the old behaviour
        **({"lm_head_init": job.lm_head_init} if job.lm_head_init != "random" else {}),
        **({"optimizer": job.optimizer} if job.optimizer != "adamw" else {}),
        **({"ttt_step_weight": job.ttt_step_weight} if job.ttt_step_weight != STEP_DECAY else {}),
    }


def fingerprint_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """What differs between a checkpoint's fingerprint and this launch's, as `name old -> new` phrases."""
    out = []
    old_data, new_data = old.get("data", {}), new["data"]
    if old_data.get("digest") != new_data["digest"]:
        changed = [
            f"{k} {_show(old_data.get(k))} -> {_show(new_data.get(k))}"
            for k in sorted(set(old_data) | set(new_data))
            if k != "digest" and old_data.get(k) != new_data.get(k)
        ]
        out.append(
            "data: " + (", ".join(changed) if changed else "same number of samples and tokens, other ids or lengths")
        )
    if old.get("vocab", {}).get("digest") != new["vocab"]["digest"]:
        out.append(f"draft vocabulary: other tokens (from {new['vocab']['token_counts']})")
    changed = settings_differences(old.get("settings", {}), new["settings"])
    if changed:
        out.append("settings: " + ", ".join(changed))
    return out


def settings_differences(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """`name old -> new` for each setting that differs between two fingerprints' settings."""
    return [
        f"{_SETTING_NAMES.get(k, k)} {_show(old.get(k))} -> {_show(new.get(k))}"
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
    ]


_SETTING_NAMES = {
    "total_steps": "total steps (epochs/max_steps; the cosine schedule spans them)",
    "world_size": "world size (train.num_gpus)",
}


def _show(value: Any) -> str:
    if value is None:
        return "(none)"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return json.dumps(value) if isinstance(value, (list, dict, str)) else str(value)


def check_fingerprint(ckpt_dir: Path, fingerprint: dict[str, Any], *, warn: bool) -> None:
    """Refuse (CheckpointMismatch) to resume a checkpoint of other data or settings; reads only.

    A checkpoint written before fingerprints existed is resumed, with a warning.
    """
    done = complete_checkpoints(ckpt_dir)
    if not done:
        return
    _, tag = done[-1]
    path = ckpt_dir / tag / FINGERPRINT
    if not path.is_file():
        if warn:
            log(
                f"train: warning: checkpoint {tag} has no {FINGERPRINT} (written before fingerprints): resuming "
                "without checking that its data and settings are this launch's"
            )
        return
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointMismatch(
            f"{path}: cannot read the checkpoint's fingerprint ({e}); move {ckpt_dir} aside to start fresh"
        ) from None
    differences = fingerprint_differences(old, fingerprint)
    if differences:
        raise CheckpointMismatch(
            f"cannot resume {ckpt_dir / tag}: it was trained on other data or settings than this launch's "
            f"({'; '.join(differences)}). Nothing was trained or removed. To start fresh, set train.out_dir to a "
            f"new directory or move {ckpt_dir} aside; to continue that checkpoint, restore its data and settings"
        )


def resume_checkpoint(ds_model, ckpt_dir: Path, dist: Dist) -> Position:
    """Load the newest complete checkpoint, if any; drop incomplete ones (a kill during a save)."""
    done = complete_checkpoints(ckpt_dir)
    dist.barrier()  # everyone listed before rank 0 cleans up
    if dist.rank == 0 and ckpt_dir.is_dir():
        keep = {tag for _, tag in done}
        for p in ckpt_dir.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name not in keep:
                log(f"train: removing incomplete checkpoint {p.name}")
                shutil.rmtree(p, ignore_errors=True)
    dist.barrier()
    if not done:
        return Position()
    step, tag = done[-1]
    _, client = ds_model.load_checkpoint(
        str(ckpt_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    position = Position(**client["position"])
    rng_path = ckpt_dir / tag / f"rng-rank-{dist.rank}.pt"
    if rng_path.is_file():  # a different world size than the saved run: fresh RNG for the new ranks
        rng = torch.load(rng_path, weights_only=False)
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        if rng.get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])
    if dist.rank == 0:
        log(
            f"train: resuming from checkpoint {tag} (step {position.step}, epoch {position.epoch}, "
            f"{position.tokens:,} tokens trained)"
        )
    return position
