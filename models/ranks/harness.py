"""The rank harness of the capture, train and eval entry points: arguments, process group, launcher watch, teardown.

    torchrun --nproc_per_node N -m models.ENTRY --job JOB.json     (CPU: gloo, DS_ACCELERATOR=cpu)
    deepspeed --num_gpus N --module models.ENTRY --job JOB.json    (GPU: NCCL)
    python -m models.ENTRY --job JOB.json                          (WORLD_SIZE unset: one process)
    torchrun --nnodes K --node_rank R --master_addr A ... (each node), or deepspeed --hostfile H ... (node 0)

Ranks are global: RANK and WORLD_SIZE span every node, LOCAL_RANK picks the GPU on this one. What
one process writes for all (an index, checkpoint markers, metrics) is written by global rank 0; a
multi-node job first checks that its output directory is shared by every rank (`check_shared_dir`).

An entry point's `main` is `serve(...)` with its own `run(job_path, dist)`. A failure exits with
status 1 after one `MARK {json}` error report on stderr (models/common/rank_protocol.py), which the pipeline
turns back into the exception; an exception whose message says it all (a failed write, a damaged
file) is told in that one line, anything else also gets its traceback. When one rank exits, the
launcher (torchrun polls every 0.1 s, deepspeed every 1 s) terminates the others, so no rank keeps
computing what could not be kept; a rank whose launcher is killed exits on its own (`watch_launcher`).
"""

from __future__ import annotations

import argparse
import io
import os
import secrets
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.common.file_errors import DamagedFile, WriteFailed
from models.common.rank_protocol import RANK_MEMORY, Protocol, error_report

# Exceptions whose message says all there is to say: no traceback after them.
TOLD = (WriteFailed, DamagedFile)


@dataclass
class Dist:
    """This process's place in the launch (WORLD_SIZE unset: a single process, no process group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    group: bool = False  # a torch.distributed process group is up

    @classmethod
    def from_env(cls) -> Dist:
        if "WORLD_SIZE" not in os.environ:
            return cls()
        return cls(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", 0)))

    def device(self, kind: str) -> torch.device:
        """This rank's device for a job on `kind` ("cuda": the local rank's GPU, made current; "cpu")."""
        if kind != "cuda":
            return torch.device("cpu")
        device = torch.device(f"cuda:{self.local_rank}")
        torch.cuda.set_device(device)
        return device

    def barrier(self) -> None:
        if self.group:
            torch.distributed.barrier()

    def max(self, value: int, device: torch.device) -> int:
        if not self.group:
            return value
        t = torch.tensor([value], dtype=torch.int64, device=device)
        torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
        return int(t.item())


def init_process_group(dist: Dist, device: str, *, deepspeed: bool) -> None:
    """Join the launch's process group (NCCL on GPUs, gloo on CPUs); with `deepspeed`, through DeepSpeed.

    DeepSpeed needs a group even for a lone process: it gets a 1-rank one on a free port. CPU ranks
    use DeepSpeed's CPU accelerator. Without DeepSpeed a lone process needs no group at all.
    """
    backend = "nccl" if device == "cuda" else "gloo"
    if deepspeed:
        if device == "cpu":
            os.environ.setdefault("DS_ACCELERATOR", "cpu")
        if "WORLD_SIZE" not in os.environ:
            os.environ.update(
                RANK="0",
                LOCAL_RANK="0",
                WORLD_SIZE="1",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=os.environ.get("MASTER_PORT") or str(free_port()),
            )
        import deepspeed as ds

        ds.init_distributed(dist_backend=backend)
        dist.group = True
    elif dist.world_size > 1:
        torch.distributed.init_process_group(backend=backend)
        dist.group = True


def check_shared_dir(dist: Dist, directory: Path) -> None:
    """Refuse a job whose `directory` is not the same directory for every rank (ValueError naming the hosts).

    Ranks on several nodes write one run directory: shards, checkpoints, the index. On a disk local
    to each node every node would see only its own files (a resume would capture or train twice).
    Rank 0 creates a file of a fresh name there; every rank must see it.
    """
    if not dist.group or dist.world_size == 1:
        return
    made: list[Any] = [None]
    if dist.rank == 0:
        probe = directory / f".shared-check-{secrets.token_hex(8)}"
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe.touch()
            made = [probe.name]
        except OSError:
            pass  # a full or read-only disk: the job's own first write says so, in its words (WriteFailed)
    torch.distributed.broadcast_object_list(made, src=0)
    if made[0] is None:
        return
    probe = directory / made[0]
    seen: list[Any] = [None] * dist.world_size
    torch.distributed.all_gather_object(seen, (dist.rank, socket.gethostname(), probe.exists()))
    if dist.rank == 0:
        try:
            probe.unlink(missing_ok=True)
        except OSError:
            pass
    blind = [(rank, host) for rank, host, ok in seen if not ok]
    if blind:
        hosts = sorted({host for _, host in blind})
        raise ValueError(
            f"{directory} is not one shared directory: rank(s) {', '.join(str(r) for r, _ in blind)} on "
            f"{', '.join(hosts)} do not see the file rank 0 created there. Every node must mount RUN_DIR "
            "(and capture.out_dir, train.out_dir) at the same path on one shared filesystem"
        )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg: str) -> None:
    """A line for the job's log (stderr; the protocol lines go to stdout)."""
    print(msg, file=sys.stderr, flush=True)


def say(line: str) -> None:
    """Print a protocol line (models/common/rank_protocol.py): stdout, whole, so the pipeline follows it live."""
    whole_line(sys.stdout, line)


def whole_line(stream: TextIO, text: str) -> None:
    """`text` and its newline in one write(2).

    print() writes a line and its newline separately: another thread of this rank (a library's
    logger) can slip its own output in between and glue it onto a protocol line, which then no
    longer parses. The ranks share the launcher's pipes, and a single write under PIPE_BUF is never
    split, so one write keeps every protocol line whole.
    """
    stream.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):  # captured in-process (tests): no descriptor
        stream.write(text + "\n")
        stream.flush()
        return
    data = (text + "\n").encode("utf-8", "replace")
    while data:  # a signal may cut a write short: the rest follows
        data = data[os.write(fd, data) :]


def watch_launcher(name: str) -> None:
    """Exit when the launcher dies: torchrun starts each rank in its own session, so a SIGKILL of the
    launcher's process group would otherwise leave the ranks running (and writing)."""
    parent = os.getppid()
    if parent == 1:
        return

    def watch() -> None:
        while True:
            time.sleep(1.0)  # polling: a parent's death sends its children no signal
            if os.getppid() != parent:
                log(f"{name}: launcher (pid {parent}) is gone; exiting")
                os._exit(1)

    threading.Thread(target=watch, name="launcher-watch", daemon=True).start()


def serve(
    argv: list[str] | None,
    module: str,
    doc: str | None,
    protocol: Protocol,
    run: Callable[[str, Dist], Any],
    *,
    told: tuple[type[BaseException], ...] = (),
    once: tuple[type[BaseException], ...] = (),
) -> int:
    """Run one rank of the entry point `module` (`run(job_path, dist)`); return its exit status.

    `module`, `doc`: the entry point's module (`python -m <module>`) and its docstring (the first line describes it).
    `told`: more exceptions whose message says it all (besides a failed write and a damaged file).
    `once`: exceptions every rank raises alike (they read the same files): only rank 0 reports them.
    """
    parser = argparse.ArgumentParser(prog=f"python -m {module}", description=doc.splitlines()[0] if doc else None)
    parser.add_argument("--job", required=True, help=f"path of the {protocol.name} JOB.json")
    # The `deepspeed` launcher appends --local_rank=N; LOCAL_RANK in the environment says the same.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    dist = Dist.from_env()
    try:
        if "WORLD_SIZE" in os.environ:
            watch_launcher(protocol.name)
        run(args.job, dist)
    except BaseException as e:  # noqa: BLE001 - every failure must reach the launcher as a nonzero exit
        if isinstance(e, SystemExit) and not e.code:
            return 0
        said = isinstance(e, TOLD + told)
        if dist.rank == 0 or not isinstance(e, once):
            # The report first: it is what the pipeline shows, and this rank may be killed any moment now.
            whole_line(sys.stderr, protocol.error.format(error_report(e, dist.rank)))
            whole_line(
                sys.stderr,
                f"{protocol.name} rank {dist.rank} failed: {e}"
                if said
                else f"{protocol.name} rank {dist.rank} failed: {e!r}",
            )
        if not said:
            traceback.print_exc(file=sys.stderr)
        sys.stderr.flush()
        return 1
    finally:
        try:
            say(memory_line(dist.rank))
        except Exception:  # noqa: BLE001 - a figure for the log; never the reason a rank fails
            pass
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            try:
                torch.distributed.destroy_process_group()
            except Exception:  # noqa: BLE001 - exiting anyway
                pass
    return 0


def memory_line(rank: int) -> str:
    """`RANK_MEMORY ...` for this process: peak resident bytes, and the CUDA allocator's peaks on its busiest GPU."""
    import resource

    values = {"rank": rank, "host_peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux: KiB
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        devices = range(torch.cuda.device_count())
        values["gpu_peak_allocated"] = max(torch.cuda.max_memory_allocated(d) for d in devices)
        values["gpu_peak_reserved"] = max(torch.cuda.max_memory_reserved(d) for d in devices)
    return RANK_MEMORY.format(**values)
