"""Launching multi-rank jobs (torchrun on CPU, the deepspeed launcher on GPU machines) with live output."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections import deque
from typing import Callable

from tasks.processes import free_port


class RankFailure(RuntimeError):
    """A rank of a launched job exited with an error; the message ends with the job's output tail."""


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install is a CPU machine for our purposes
        return False


def rank_command(module: str, args: list[str], *, num_ranks: int, launcher: str = "auto") -> tuple[list[str], dict[str, str]]:
    """The command and extra environment that run `python -m module args` on `num_ranks` ranks."""
    if launcher == "auto":
        launcher = "deepspeed" if cuda_available() else "torchrun"
    port = str(free_port())
    if launcher == "deepspeed":
        command = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", str(num_ranks), "--master_port", port, "--module", module, *args]
        return command, {}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(num_ranks), "--master_port", port, "-m", module, *args]
    # CPU ranks: DeepSpeed's CPU accelerator with gloo; one thread per rank so ranks don't fight for cores
    return command, {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def run_job(command: list[str], *, env: dict[str, str] | None = None, on_line: Callable[[str], None], tail_lines: int = 40) -> None:
    """Run `command`, passing each output line (stdout and stderr merged) to `on_line` as it comes.

    A nonzero exit raises RankFailure with the last lines of output (where the failing rank's
    traceback is). On KeyboardInterrupt or cancellation the whole process group is killed.
    """
    tail: deque[str] = deque(maxlen=tail_lines)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    try:
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tail.append(line)
            on_line(line)
        code = process.wait()
    except BaseException:
        _kill_group(process)
        raise
    if code != 0:
        raise RankFailure(f"job exited with code {code}: {' '.join(command[:6])} ...\n--- last output ---\n" + "\n".join(tail))


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
