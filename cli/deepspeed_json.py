"""`make deepspeed-json`: write deploy/deepspeed/*.json, the DeepSpeed configs the stages derive from the
declared defaults.

Nothing reads these files: each train rank derives its config from the train settings in its job
(models/train/optimizer.py `ds_train_config`), each ZeRO-3 capture rank from its capture job
(models/capture/job.py `ds_inference_config`). They are for reading, and tests/deploy/test_deepspeed_json.py
fails when they and the code part ways: then run this command instead of editing them.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TEMPLATES = Path(__file__).resolve().parents[1] / "deploy" / "deepspeed"
TRAIN_WORLD_SIZE = 8  # the reference box: one rank per GPU


def templates() -> dict[str, dict]:
    """File name -> the DeepSpeed config: training with the train section's defaults on 8 GPUs in bf16, and
    a bf16 ZeRO-3 capture with its parameters offloaded to CPU."""
    import torch

    from models.capture.job import ds_inference_config
    from models.train.optimizer import ds_train_config
    from settings.train import TrainConfig

    return {
        "train-zero2-bf16.json": ds_train_config(TrainConfig(), world_size=TRAIN_WORLD_SIZE, bf16=True),
        "capture-zero3-offload.json": ds_inference_config(torch.bfloat16, "cpu", None, "cuda"),
    }


def main() -> int:
    for name, config in templates().items():
        path = TEMPLATES / name
        path.write_text(json.dumps(config, indent=2) + "\n")
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
