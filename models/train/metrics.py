"""The train job's metrics: TTT sums over batches and ranks, and metrics.jsonl + TensorBoard (rank 0)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from models.common.atomic import write_atomic
from models.draft.eagle3 import acceptance_length
from models.ranks.harness import Dist, log
from models.train.checkpoint import writing
from settings.layout import CHECKPOINTS, METRICS, TENSORBOARD


class Metrics:
    """Sums of TTT counts over batches (and ranks), turned into losses, accuracies and acceptance."""

    def __init__(self, steps: int, device: torch.device):
        self.v = torch.zeros(
            6, steps, dtype=torch.float64, device=device
        )  # loss*valid, tokens, valid, correct, reached, accepted

    def add(self, out) -> None:
        self.v += (
            torch.stack(
                [
                    out.per_step_loss.double() * out.valid,
                    out.tokens,
                    out.valid,
                    out.correct,
                    out.chain_reached,
                    out.chain_accepted,
                ]
            )
            .double()
            .to(self.v.device)
        )

    def all_reduce(self, dist: Dist) -> None:
        if dist.group:
            torch.distributed.all_reduce(self.v)

    def summary(self, decay: float) -> dict[str, Any]:
        loss_sum, tokens, valid, correct, reached, accepted = self.v.cpu()
        per_step_loss = (loss_sum / valid.clamp(min=1)).tolist()
        weights = decay ** torch.arange(len(per_step_loss), dtype=torch.float64)
        return {
            "loss": float((weights * torch.tensor(per_step_loss)).sum()),
            "per_step_loss": [round(x, 6) for x in per_step_loss],
            "per_step_acc": [round(x, 6) for x in (correct / tokens.clamp(min=1)).tolist()],
            "per_step_cond_acc": [round(x, 6) for x in (accepted / reached.clamp(min=1)).tolist()],
            "acceptance_length": round(float(acceptance_length(accepted, reached)), 6),
            "tokens": int(tokens[0]),
        }


def read_evals(metrics_path: Path) -> list[dict[str, Any]]:
    """The eval lines of metrics.jsonl, whole, in file order (a line cut by a kill is skipped); [] without the file."""
    evals = []
    if metrics_path.is_file():
        for line in metrics_path.read_text().splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict) and row.get("kind") == "eval":
                evals.append(row)
    return evals


def read_last_eval(metrics_path: Path) -> dict[str, Any] | None:
    """The last eval line of metrics.jsonl (without kind/step/epoch/time), or None."""
    evals = read_evals(metrics_path)
    return {k: v for k, v in evals[-1].items() if k not in ("kind", "step", "epoch", "time")} if evals else None


class MetricsWriter:
    """metrics.jsonl and TensorBoard scalars (rank 0); lines past the resumed step are dropped first."""

    def __init__(self, out_dir: Path, resumed_step: int, enabled: bool):
        self.enabled = enabled
        self.path = out_dir / METRICS
        self.ckpt_dir = out_dir / CHECKPOINTS
        self.tb = None
        if not enabled:
            return
        with writing(self.path, self.ckpt_dir):
            out_dir.mkdir(parents=True, exist_ok=True)
            if self.path.is_file():
                kept = []
                for line in self.path.read_text().splitlines():
                    try:
                        if json.loads(line)["step"] <= resumed_step:
                            kept.append(line)
                    except (ValueError, KeyError, TypeError):
                        continue  # a line cut by a kill (or a full disk)
                write_atomic(self.path, "".join(k + "\n" for k in kept))
            self.file = open(self.path, "a")
        with writing(out_dir / TENSORBOARD, self.ckpt_dir):
            try:
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(
                    str(out_dir / TENSORBOARD), purge_step=resumed_step + 1 if resumed_step else None
                )
            except ImportError:
                log("train: tensorboard is not installed; metrics go to metrics.jsonl only")

    def write(self, line: dict[str, Any]) -> None:
        """Append one line (and its scalars); a line cut by a failed write is dropped on resume."""
        if not self.enabled:
            return
        with writing(self.path, self.ckpt_dir):
            self.file.write(json.dumps(line) + "\n")
            self.file.flush()
        if self.tb is not None:
            with writing(self.path.parent / TENSORBOARD, self.ckpt_dir):
                kind, step = line["kind"], line["step"]
                for key in ("loss", "acceptance_length", "lr", "grad_norm", "tokens_per_s"):
                    if isinstance(line.get(key), (int, float)):
                        self.tb.add_scalar(f"{kind}/{key}", line[key], step)
                for k, acc in enumerate(line.get("per_step_acc", [])):
                    self.tb.add_scalar(f"{kind}/acc_{k}", acc, step)
                self.tb.flush()

    def close(self) -> None:
        if self.enabled:
            self.file.close()
            if self.tb is not None:
                self.tb.close()
