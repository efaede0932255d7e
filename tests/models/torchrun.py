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
    """The launch's environment: DeepSpeed on CPU, one OpenMP thread a rank, the repository importable, hub offline,
    and the torch extensions directory the pipeline's own ranks get (`prepare`: DeepSpeed's CPU comm op built there
    once, dead builds' locks cleared), so these ranks load the op CI built before the tests, not build it again in
    ~/.cache."""
    from tasks.runtime.torch_extensions import prepare

    return {
        **os.environ,
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": str(REPO),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        **prepare(cpu=True, say=lambda line: print(line, flush=True)),
    }
