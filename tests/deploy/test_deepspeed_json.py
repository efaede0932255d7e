"""deploy/deepspeed/*.json are what the stages generate from the run config's defaults (deploy/README.md): regenerated
here from the declared settings and compared, so an edit to either side that the other lacks fails."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from models.capture.job import ds_inference_config
from models.train.optimizer import ds_train_config
from settings.train import TrainConfig

DEPLOY = Path(__file__).resolve().parents[2] / "deploy" / "deepspeed"


def test_the_training_json_is_the_train_sections_defaults_on_8_gpus():
    t = TrainConfig()  # the declared defaults, optimizer settings included
    generated = ds_train_config(t, world_size=8, bf16=True)
    written = json.loads((DEPLOY / "train-zero2-bf16.json").read_text())
    assert written == generated
    # and what it says, read independently of the generator: the recipe's numbers
    params = written["optimizer"]["params"]
    assert (params["lr"], params["betas"], params["eps"], written["gradient_clipping"]) == (
        1e-4,
        [0.9, 0.95],
        1e-8,
        0.5,
    )


def test_the_capture_json_is_zero3_with_cpu_offload_in_bf16():
    written = json.loads((DEPLOY / "capture-zero3-offload.json").read_text())
    assert written == ds_inference_config(torch.bfloat16, "cpu", None, "cuda")
    assert written["zero_optimization"]["stage"] == 3
