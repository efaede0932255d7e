"""The draft's optimisation under DeepSpeed: the config (ZeRO-2, AdamW or Muon, clipping), the schedule, the
wrapped draft.

`ds_train_config` derives a rank's DeepSpeed config from the train settings; `lr_lambda` is the warmup + cosine
schedule; `wrap_in_deepspeed` wraps the draft that models/train/job.py steps, the training-time test as its forward.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from models.draft.eagle3 import Eagle3Draft
from settings.train import TrainSettings


def ds_train_config(
    settings: TrainSettings, *, world_size: int, bf16: bool, hidden_size: int | None = None
) -> dict[str, Any]:
    """The DeepSpeed config of a draft training launch, derived from the train settings on the rank:
    ZeRO-2, AdamW (or Muon), clipping, bf16 on GPUs; train_batch_size is this launch's world size x grad_accum.
    `hidden_size` is the draft's, which train.optimizer muon needs for its learning rate (`muon_lr`)."""
    adamw = {
        "lr": settings.lr,
        "betas": list(settings.adam_betas),
        "eps": settings.adam_eps,
        "weight_decay": settings.weight_decay,
        "torch_adam": settings.torch_adam,
    }
    optimizer = {"type": "AdamW", "params": adamw}
    if settings.optimizer == "muon":
        if hidden_size is None:
            raise ValueError("train.optimizer muon: the DeepSpeed config needs the draft's hidden size")
        muon = {"muon_lr": muon_lr(settings.lr, hidden_size), "adam_lr": settings.lr, "momentum": MUON_MOMENTUM}
        optimizer = {"type": "Muon", "params": {**adamw, **muon}}
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": 1,  # one token-budget batch (models/train/data.py)
        "gradient_accumulation_steps": settings.grad_accum,
        "train_batch_size": world_size * settings.grad_accum,
        "gradient_clipping": settings.grad_clip,
        "zero_optimization": {"stage": settings.zero_stage, "overlap_comm": False, "contiguous_gradients": True},
        "optimizer": optimizer,
        "steps_per_print": 10**9,  # our own logging
        "wall_clock_breakdown": False,
    }
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


MUON_MOMENTUM = 0.95  # speculators 0.9.0's and DeepSpeed's Muon default
MUON_UPDATE_RMS = 0.2  # AdamW's typical update RMS per unit lr, which speculators' `match_rms_adamw` gives Muon


def muon_lr(lr: float, hidden_size: int) -> float:
    """Muon's learning rate for the draft's matrices, so that their updates have AdamW's RMS (speculators 0.9.0 runs
    Muon at lr with `match_rms_adamw`: an orthogonalized update scaled to RMS 0.2 * lr). DeepSpeed 0.19's Muon
    (runtime/zero/muon/original_muon.py `muon_update`) scales by sqrt(max(1, rows / cols)) instead, an update of RMS
    1 / sqrt(min(rows, cols)) per unit lr; the draft's matrices (fc, o_proj, mlp, and q_proj) have min(rows, cols) =
    hidden_size, so lr * 0.2 * sqrt(hidden_size) matches them (k_proj/v_proj, narrower under GQA, move faster)."""
    return lr * MUON_UPDATE_RMS * hidden_size**0.5


def lr_lambda(total_steps: int, warmup_steps: int, min_ratio: float):
    """Linear warmup to 1 over `warmup_steps`, then cosine down to `min_ratio` at `total_steps`."""

    def f(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class _TTT(torch.nn.Module):
    """The draft with `forward` = `forward_ttt`, the method DeepSpeed's engine calls."""

    def __init__(self, draft: Eagle3Draft):
        super().__init__()
        self.draft = draft

    def forward(self, *args, **kwargs):
        return self.draft.forward_ttt(*args, **kwargs)


def wrap_in_deepspeed(
    ds_config: dict[str, Any], draft: Eagle3Draft, min_lr_ratio: float, total_steps: int, warmup: int
):
    import deepspeed

    wrapped = _TTT(draft)
    params = [p for p in wrapped.parameters() if p.requires_grad]
    schedule = lr_lambda(total_steps, warmup, min_lr_ratio)
    ds_model, *_ = deepspeed.initialize(
        model=wrapped,
        model_parameters=params,
        config=ds_config,
        lr_scheduler=lambda optimizer: torch.optim.lr_scheduler.LambdaLR(optimizer, schedule),
    )
    return _DeepSpeedModel(ds_model)


class _DeepSpeedModel:
    """The DeepSpeed engine, with `module` meaning the draft itself (for export) and the TTT call as `__call__`."""

    def __init__(self, ds_model):
        self.ds_model = ds_model

    def __getattr__(self, name):
        return getattr(self.ds_model, name)

    @property
    def module(self) -> Eagle3Draft:
        return self.ds_model.module.draft

    def __call__(self, *args, **kwargs):
        return self.ds_model(*args, **kwargs)
