"""A job's entry point launched under `torch.distributed.run` with 2 CPU (gloo) ranks, for the tests of models/."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tasks.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]


def launch_cmd(job: Path, entry: list[str]) -> list[str]:
    """`python -m torch.distributed.run --nproc_per_node 2 --master_port FREE ENTRY... --job JOB`."""
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        *entry,
        "--job",
        str(job),
    ]


def cpu_env() -> dict[str, str]:
    """The launch's environment: DeepSpeed on CPU, one OpenMP thread a rank, the repository importable, hub offline."""
    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
