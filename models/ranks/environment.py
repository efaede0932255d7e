"""The environment a run needs, checked in seconds before anything long starts (imports no Prefect, no httpx).

`environment_checks` imports what the ranks and the check process import, reads the versions, and
looks at the device: each finding is PASS, WARN (works, but not as tested) or FAIL (the run would
fail later, after minutes or hours of GPU time), with one line of what to do. tools/gpu_check.py
runs it first and stops before its first phase on a FAIL: a GPU slot is too short to find a
missing package in its third minute.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from importlib import metadata

from models.common.findings import Finding, failed

# The major.minor versions the project's tests passed with (another is a WARN, not a FAIL): this machine's .venv
# first, as deploy/constraints.txt pins it (`make venv` installs within that lock; tests/deploy/test_constraints.py),
# then the GPU machine's (Python 3.12, torch 2.11, transformers 5.17, numpy 2.5: the fast, multiprocess and GPU-check
# smoke tests, run once in a venv of those versions; docs/gpu-check.md).
TESTED = {
    "python": ("3.11", "3.12"),
    "torch": ("2.13", "2.11"),
    "transformers": ("5.24", "5.17"),
    "deepspeed": "0.19",
    "safetensors": "0.8",
    "pyarrow": "26",
    "numpy": ("2.4", "2.5"),
    "pydantic": "2.14",
    "prefect": "3.9",
    "httpx": "0.28",
}
# What a rank process and the GPU check import, and the distribution that provides each.
NEEDED = {
    "torch": "torch",
    "deepspeed": "deepspeed",
    "transformers": "transformers",
    "safetensors": "safetensors",
    "pyarrow": "pyarrow",
    "numpy": "numpy",
    "pydantic": "pydantic",
}  # pydantic: the job files and the settings they carry (models/common/job_files.py, settings/)
# What the pipeline process imports besides (the GPU check's machine has no Prefect).
PIPELINE = {"prefect": "prefect", "httpx": "httpx"}
# DeepSpeed ops a setting needs built or buildable, by op builder: ZeRO-3 offload to NVMe needs async I/O.
OP_BUILDERS = {"async_io": "AsyncIOBuilder"}
ALLREDUCE_TIMEOUT_S = 60.0  # a hung NCCL (a VM without P2P, a wrong interface) is the failure looked for


def environment_checks(
    device: str,
    *,
    pipeline: bool = False,
    ops: tuple[str, ...] = (),
    allreduce: bool = False,
    install_hint: str = "pip install it (or bash tools/gpu_check.sh, which installs the carried wheels)",
) -> list[Finding]:
    """The findings for running on `device` ("cuda" or "cpu").

    Python, each needed module and its version (with `pipeline`: also what the pipeline process
    imports), the device; `ops`: the DeepSpeed ops the config needs (OP_BUILDERS); `allreduce`: on a
    machine with several GPUs, a one-second NCCL all-reduce over them in a child process, killed
    after ALLREDUCE_TIMEOUT_S.
    """
    out: list[Finding] = [_python_finding()]
    for module, dist in {**NEEDED, **(PIPELINE if pipeline else {})}.items():
        try:
            importlib.import_module(module)
        except Exception as e:  # noqa: BLE001 - any failure to import is the finding (ImportError, a broken build)
            out.append(Finding(module, "FAIL", f"import {module} failed: {type(e).__name__}: {e}"[:300], install_hint))
            continue
        out.append(_version_finding(module, dist))
    if not any(f.name == "torch" and f.status == "FAIL" for f in out):
        out += _device_findings(device)
    if ops and not any(f.name == "deepspeed" and f.status == "FAIL" for f in out):
        out += [_op_finding(op) for op in ops]
    if allreduce and device == "cuda" and not failed(out):
        out.append(_allreduce_finding())
    return out


def _python_finding() -> Finding:
    have = ".".join(map(str, sys.version_info[:3]))
    tested = tested_versions("python")
    if _matches(have, tested):
        return Finding("python", "PASS", have)
    return Finding(
        "python",
        "WARN",
        f"{have}; tested with {' or '.join(v + '.x' for v in tested)}",
        "it may work; the tests ran on those",
    )


def _op_finding(op: str) -> Finding:
    """Whether DeepSpeed can build (or has built) op `op` on this machine."""
    try:
        from deepspeed.ops import op_builder

        builder = getattr(op_builder, OP_BUILDERS[op])()
        ok = bool(builder.is_compatible(False))
    except Exception as e:  # noqa: BLE001 - an op builder that cannot even be asked is the finding
        return Finding(f"deepspeed op {op}", "FAIL", f"{type(e).__name__}: {e}"[:200], "reinstall deepspeed")
    if ok:
        return Finding(f"deepspeed op {op}", "PASS", "compatible (built on first use)")
    return Finding(
        f"deepspeed op {op}",
        "FAIL",
        "DeepSpeed cannot build it on this machine",
        "async_io needs libaio-dev (apt install libaio-dev, then reinstall deepspeed); or set "
        "capture.offload to cpu or none"
        if op == "async_io"
        else "see `ds_report`",
    )


def _allreduce_finding() -> Finding:
    """A one-second NCCL all-reduce over every local GPU, in a child process (a hang is killed, not waited on)."""
    import torch

    gpus = torch.cuda.device_count()
    if gpus < 2:
        return Finding("nccl all-reduce", "PASS", f"skipped: {gpus} GPU (nothing to reduce over)")
    try:
        done = subprocess.run(
            [sys.executable, "-m", "models.ranks.environment", "--allreduce", str(gpus)],
            capture_output=True,
            text=True,
            timeout=ALLREDUCE_TIMEOUT_S,
            env={**os.environ, "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},
        )
    except subprocess.TimeoutExpired:
        return Finding(
            "nccl all-reduce",
            "FAIL",
            f"no answer in {ALLREDUCE_TIMEOUT_S:.0f} s over {gpus} GPUs (NCCL hangs)",
            "inside a VM try NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1, NCCL_SOCKET_IFNAME=lo; "
            "NCCL_DEBUG=INFO says where it stops",
        )
    last = (done.stdout.strip().splitlines() or [""])[-1]
    if done.returncode == 0 and last.startswith("allreduce ok"):
        return Finding("nccl all-reduce", "PASS", f"{gpus} GPUs: {last.removeprefix('allreduce ok').strip()}")
    tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
    return Finding(
        "nccl all-reduce",
        "FAIL",
        f"{gpus} GPUs: exit {done.returncode}: {tail}"[:300],
        "NCCL_DEBUG=INFO says why; inside a VM try NCCL_P2P_DISABLE=1 and NCCL_IB_DISABLE=1",
    )


def _allreduce_rank(rank: int, world: int, port: int) -> None:
    import time

    import torch
    import torch.distributed as torch_dist

    torch.cuda.set_device(rank)
    torch_dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    x = torch.ones(1 << 20, device="cuda")
    torch_dist.all_reduce(x)  # warm up: NCCL connects here
    torch.cuda.synchronize()
    t0, n = time.monotonic(), 0
    while time.monotonic() - t0 < 1.0:
        torch_dist.all_reduce(x)
        n += 1
    torch.cuda.synchronize()
    ok = bool(torch.all(x > 0)) and torch_dist.get_world_size() == world
    if rank == 0:
        print(f"allreduce ok {n} all-reduces of 4 MiB in 1 s" if ok else "allreduce wrong values", flush=True)
    torch_dist.destroy_process_group()


def _version_finding(module: str, dist: str) -> Finding:
    try:
        have = metadata.version(dist)
    except metadata.PackageNotFoundError:
        have = getattr(importlib.import_module(module), "__version__", "unknown")
    tested = tested_versions(module)
    if not tested or _matches(have, tested):
        return Finding(module, "PASS", have)
    return Finding(
        module,
        "WARN",
        f"{have}; tested with {' or '.join(v + '.x' for v in tested)}",
        "it may work; if a later step fails, install a tested version",
    )


def tested_versions(name: str) -> tuple[str, ...]:
    """The major.minor versions of `name` the tests passed with (TESTED holds one string or a tuple)."""
    value = TESTED.get(name, ())
    return (value,) if isinstance(value, str) else tuple(value)


def _matches(version: str, tested: tuple[str, ...]) -> bool:
    """Whether `version` (e.g. 2.13.0+cpu) is one of `tested` (e.g. 2.13, or 26 for any 26.x)."""
    parts = version.split("+")[0].split(".")
    return any(parts[: len(t.split("."))] == t.split(".") for t in tested)


def _device_findings(device: str) -> list[Finding]:
    import torch

    if device != "cuda":
        return [Finding("device", "PASS", f"cpu ({torch.get_num_threads()} threads); gloo for the ranks")]
    if not torch.cuda.is_available():
        return [
            Finding(
                "device",
                "FAIL",
                f"torch {torch.__version__} sees no CUDA device (CUDA build: {torch.version.cuda})",
                "use a CUDA build of torch on a machine with a GPU, or the CPU path (--cpu-smoke)",
            )
        ]
    props = torch.cuda.get_device_properties(0)
    out = [
        Finding(
            "device",
            "PASS",
            f"{torch.cuda.device_count()} x {props.name}, "
            f"{props.total_memory / 2**30:.0f} GiB, capability {props.major}.{props.minor}",
        )
    ]
    out.append(
        Finding(
            "bf16",
            "PASS" if torch.cuda.is_bf16_supported() else "WARN",
            "supported" if torch.cuda.is_bf16_supported() else "not supported by this GPU",
            "" if torch.cuda.is_bf16_supported() else "capture and train in fp16 or fp32 instead",
        )
    )
    try:
        nccl = torch.cuda.nccl.version()
        out.append(Finding("nccl", "PASS", ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)))
    except Exception as e:  # noqa: BLE001 - a torch built without NCCL
        out.append(Finding("nccl", "FAIL", f"{type(e).__name__}: {e}"[:200], "use a torch build with NCCL"))
    return out


if __name__ == "__main__":  # the child of _allreduce_finding: python -m models.ranks.environment --allreduce N
    import socket

    import torch.multiprocessing as mp

    if sys.argv[1:2] != ["--allreduce"] or len(sys.argv) != 3:
        sys.exit("usage: python -m models.ranks.environment --allreduce GPUS")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    mp.spawn(_allreduce_rank, args=(int(sys.argv[2]), free), nprocs=int(sys.argv[2]), join=True)
