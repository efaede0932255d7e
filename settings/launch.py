"""How a DeepSpeed job of the pipeline is launched and retried: the keys the `capture:` and `train:` sections share.

Where the ranks then run (cpu or cuda) depends on the machine: tasks/runtime/launch_ranks.py `rank_device` decides it.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from settings.base import Section


class LaunchConfig(Section):
    """How a DeepSpeed job of the pipeline is launched and retried (capture, train)."""

    num_gpus: int = Field(default=8, ge=1)
    """Ranks of the job: one per GPU (on a CPU-only machine, CPU processes)."""
    launcher: Literal["auto", "torchrun", "deepspeed"] = "auto"
    """auto: the deepspeed launcher on a CUDA machine, torchrun (gloo, DS_ACCELERATOR=cpu) otherwise."""
    retries: int = Field(default=2, ge=0)
    """Prefect retries of a job whose rank crashed or was killed; a retry resumes (complete shards are skipped, training
    goes on from the last checkpoint). A full disk, a damaged file, a checkpoint of other data or settings, or a
    refused job is not retried."""
    retry_delay_s: float = Field(default=60.0, ge=0)
    """Seconds to wait before each retry of the job."""
