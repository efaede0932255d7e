"""Doctor: the run directory as another run left it: who holds its lock, damaged parts, a checkpoint of
other settings, hidden-state shards captured with other settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.capture.shards import captured_with, list_shards, shard_metadata
from models.common.file_errors import DamagedShard
from models.common.findings import Finding
from models.train.checkpoint import FINGERPRINT, checkpoint_settings, complete_checkpoints, settings_differences
from tasks.records.build import record_stats
from tasks.run_lock import describe_holder, lock_holder
from tasks.stats import collect_stats


def run_dir_findings(run_dir: Path, *, checkpoint_dir: Path, settings: dict[str, Any]) -> list[Finding]:
    """Lock, damaged parts, and the newest checkpoint in `checkpoint_dir` against `settings`
    (models/train/checkpoint.py's `optimisation_settings` and `variant_settings` of this config: what can be known
    before the data is read)."""
    if not run_dir.is_dir():
        return [Finding("run directory", "PASS", f"{run_dir} is new (created by the first stage)")]
    return [_lock_finding(run_dir), _damaged_finding(run_dir), _checkpoint_finding(checkpoint_dir, settings)]


def _lock_finding(run_dir: Path) -> Finding:
    holder = lock_holder(run_dir)
    if holder is None:
        return Finding("run directory: lock", "PASS", "free (or held by this process)")
    return Finding(
        "run directory: lock",
        "FAIL",
        f"held by {describe_holder(holder)}",
        "wait for that run to finish or stop it (it resumes later); `eagle3 stats` works meanwhile",
    )


def _damaged_finding(run_dir: Path) -> Finding:
    damaged = [s.damaged for s in collect_stats(run_dir) if s.damaged]
    record_stats(run_dir, on_damaged=lambda name, exc: damaged.append(str(exc)))
    if damaged:
        return Finding(
            "run directory: parts",
            "FAIL",
            "; ".join(damaged)[:600],
            "each message says what to do (usually: move the damaged part aside and run the stage again)",
        )
    return Finding("run directory: parts", "PASS", "no damaged part")


def _checkpoint_finding(checkpoint_dir: Path, settings: dict[str, Any]) -> Finding:
    done = complete_checkpoints(checkpoint_dir)
    if not done:
        return Finding("train checkpoint", "PASS", f"none in {checkpoint_dir} (training starts fresh)")
    _, tag = done[-1]
    path = checkpoint_dir / tag / FINGERPRINT
    try:
        old = json.loads(path.read_text())
    except FileNotFoundError:
        return Finding(
            "train checkpoint",
            "WARN",
            f"{tag} has no {FINGERPRINT} (written before fingerprints)",
            "it resumes unchecked: make sure its settings are this config's",
        )
    except (OSError, ValueError) as exc:
        return Finding(
            "train checkpoint", "FAIL", f"{path}: cannot read: {exc}", f"move {checkpoint_dir} aside to start fresh"
        )
    known = {k: v for k, v in checkpoint_settings(old).items() if k in settings}
    differences = settings_differences(known, settings)
    if differences:
        return Finding(
            "train checkpoint",
            "FAIL",
            f"{tag} was trained with other settings: {', '.join(differences)}"[:500],
            f"the train stage would refuse to resume it: restore those settings, or move {checkpoint_dir} "
            "aside (or set train.out_dir) to start fresh",
        )
    return Finding(
        "train checkpoint",
        "PASS",
        f"{tag}: its settings are this config's (data and vocabulary are checked when training starts)",
    )


def shards_finding(out_dir: Path, want: dict[str, Any]) -> Finding:
    """The shards already in the capture's `out_dir` against `want`, the settings this config captures with
    (models/capture/shards.py CAPTURE_SETTINGS): the capture refuses to resume into shards of others."""
    try:
        shards = list_shards(out_dir) if out_dir.is_dir() else []
    except OSError as exc:  # e.g. not readable by this user: the capture could not read it either
        return Finding("capture shards", "FAIL", f"cannot list {out_dir}: {exc}"[:300], "fix its permissions")
    if not shards:
        return Finding("capture shards", "PASS", f"none in {out_dir} (the capture starts fresh)")
    try:
        have = captured_with(shard_metadata(shards[0]))
    except DamagedShard as exc:
        return Finding("capture shards", "FAIL", str(exc)[:300], f"move {shards[0]} aside: the capture redoes it")
    if have != want:
        differ = ", ".join(f"{k} {have[k]} -> {want[k]}" for k in want if have[k] != want[k])
        return Finding(
            "capture shards",
            "FAIL",
            f"{out_dir} holds {len(shards)} shard(s) captured with other settings: {differ}"[:500],
            "the capture stage would refuse to resume into them: restore those settings, or set capture.out_dir to "
            "another directory (or move the shards aside) to capture afresh",
        )
    return Finding("capture shards", "PASS", f"{len(shards)} shard(s) in {out_dir} with these settings: it resumes")
