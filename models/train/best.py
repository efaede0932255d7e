"""The train job's best draft: each held-out eval that beats the best so far is exported to RUN_DIR/draft/best/.

Kept as an export, not a checkpoint: a best draft is for serving and for the eval stage, which read an export
(config.json + model.safetensors, one copy of the draft), while a DeepSpeed checkpoint would add the optimizer
states (about three times the draft) and a file per rank, for a state nobody resumes. An eval whose acceptance
length is strictly greater than the best so far (the first of equals stays the best) is exported by rank 0 with
the same `export_draft` as final/ (assembled beside, validated, renamed into place: a kill leaves the previous
best/ or the new one, whole), then best/best.json records its step, epoch, acceptance length and loss. Every
rank holds the whole draft under ZeRO-2, so nothing is gathered; the other ranks wait at a barrier meanwhile.

Resume. A relaunch goes back to its newest complete checkpoint (step R) and trains the steps after it again;
metrics.jsonl keeps its lines up to R (models/train/metrics.py), and every eval up to R was recorded, and its
best exported, before checkpoint R was saved. The best so far is the best eval line up to R, and best/ is kept
only when its best.json names that eval's step. Any other best/ is removed: its eval is past R (an export from
steps the relaunch rolls back; they are trained and evaluated again) or it has no best.json (a kill between
the export and the marker). In the rolled-back case the best eval up to R lost its export (the later one
replaced it): it stays the one to beat, and unless a later eval beats it the summary says its draft is gone
(`dir` null) — with a deterministic resume the same later eval beats it again.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from models.common.atomic import write_atomic
from models.ranks.harness import Dist, log
from models.train.checkpoint import writing
from models.train.metrics import read_evals
from settings.layout import BEST, BEST_MARKER, CHECKPOINTS, METRICS


@dataclass(frozen=True)
class Best:
    """One held-out eval: where it was (step, epoch) and what it measured."""

    step: int
    epoch: int
    acceptance_length: float
    loss: float

    @classmethod
    def of(cls, row: dict[str, Any]) -> Best:
        """The eval of a metrics.jsonl eval line (or of best.json)."""
        return cls(int(row["step"]), int(row["epoch"]), float(row["acceptance_length"]), float(row["loss"]))


def beats(acceptance_length: float, best: Best | None) -> bool:
    """Whether an eval with this acceptance length is the new best: strictly greater (a NaN never is)."""
    return math.isfinite(acceptance_length) and (best is None or acceptance_length > best.acceptance_length)


def best_eval(evals: Iterable[dict[str, Any]]) -> Best | None:
    """The best of these eval lines, in order (as training keeps it: the first of equals); None without any."""
    best = None
    for row in evals:
        if beats(float(row["acceptance_length"]), best):
            best = Best.of(row)
    return best


def read_marker(best_dir: Path) -> Best | None:
    """The eval best/best.json records, or None (no marker, or one that does not parse)."""
    try:
        return Best.of(json.loads((best_dir / BEST_MARKER).read_text()))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def resume_best(out_dir: Path, resumed_step: int) -> tuple[Best | None, bool]:
    """The best so far of a launch resumed at `resumed_step` (0: a fresh start) and whether best/ holds its draft;
    removes a best/ that does not (see the module docstring). Rank 0, before it trains."""
    best_dir = out_dir / BEST
    best = best_eval(e for e in read_evals(out_dir / METRICS) if e["step"] <= resumed_step)
    marker = read_marker(best_dir)
    if best is not None and marker is not None and marker.step == best.step:
        return best, True
    if best_dir.exists():
        if marker is None:
            why = f"it has no {BEST_MARKER} (a kill between its export and its record)"
        elif marker.step > resumed_step:
            why = (
                f"its eval at step {marker.step} is past the resumed step {resumed_step}: those steps are trained "
                "and evaluated again"
            )
        else:
            why = f"its eval at step {marker.step} is not the best one up to step {resumed_step}"
        log(f"train: removing {best_dir}: {why}")
        with writing(best_dir, out_dir / CHECKPOINTS):
            shutil.rmtree(best_dir)
    if best is not None:
        log(
            f"train: the best held-out eval so far (step {best.step}, acceptance length {best.acceptance_length:.3f}) "
            f"has no export left; the next eval that beats it is exported to {best_dir}"
        )
    return best, False


def describe(best: dict[str, Any] | None) -> str:
    """train_summary.json's "best" in words, for the logs and the training report."""
    if best is None:
        return "no held-out eval (train.eval_fraction 0): no best/, the draft is final/"
    measured = f"step {best['step']:,}, acceptance length {best['acceptance_length']:.3f}"
    if best["dir"] is None:
        return f"the best held-out eval ({measured}) has no export: a relaunch rolled it back, no later eval beat it"
    if best["last"]:
        return f"the best held-out eval is the last step's ({measured}): {best['dir']} holds the same draft as final/"
    return f"the best held-out eval is at {measured}: its draft is in {best['dir']}"


class BestDraft:
    """The best held-out eval so far and best/, kept by rank 0; on the other ranks it only waits for rank 0's exports.

    `export(dir)` writes the draft as it is now to `dir` (the same export as final/'s).
    """

    def __init__(self, out_dir: Path, resumed_step: int, dist: Dist, export: Callable[[Path], Any]):
        self.dir = out_dir / BEST
        self.ckpt_dir = out_dir / CHECKPOINTS
        self.dist, self.export = dist, export
        self.best: Best | None = None
        self.exported = False  # best/ holds the draft of self.best
        if dist.rank == 0:
            self.best, self.exported = resume_best(out_dir, resumed_step)

    def offer(self, step: int, epoch: int, result: dict[str, Any]) -> Best | None:
        """After an eval at `step`: export the draft to best/ if its result beats the best so far; the new best
        (rank 0), else None. Every rank calls it: the others wait here while rank 0 exports."""
        new = None
        if self.dist.rank == 0 and beats(float(result["acceptance_length"]), self.best):
            new = Best(step, epoch, float(result["acceptance_length"]), float(result["loss"]))
            also = f"{self.dir} holds the previous best until the new export is complete"
            with writing(self.dir, self.ckpt_dir, also=also):
                self.export(self.dir)  # replaces best/ (and its best.json) whole, once the new export is complete
                write_atomic(self.dir / BEST_MARKER, json.dumps(asdict(new)))
            self.best, self.exported = new, True
        self.dist.barrier()
        return new

    def described(self, last_step: int) -> str:
        """`describe` of `summary(last_step)`."""
        return describe(self.summary(last_step))

    def summary(self, last_step: int) -> dict[str, Any] | None:
        """train_summary.json's "best": the best eval, its draft's directory (null: lost to a rollback, see the
        module docstring) and whether it is the last step's (final/ then holds the same draft); None without evals."""
        if self.best is None:
            return None
        return {
            **asdict(self.best),
            "dir": str(self.dir) if self.exported else None,
            "last": self.best.step == last_step,
        }
