"""GPU check: the capture, train, export and eval path on one GPU (deepspeed launcher, NCCL, bf16), measured.

One script that a machine with one GPU, PyTorch and transformers but no internet runs in under 8
minutes (tools/gpu_check.sh installs the wheels it lacks first: docs/gpu-check.md). It runs the
pipeline's own code, the way the stage tasks run it, without Prefect:

1. target   models.target.tiny.build_tiny_target, widened (default hidden 1024, 16 layers);
2. records  the target's own greedy continuations of random prompts (in this process, on the GPU),
            written as the records stage writes them (tasks/records/build.py: parts + token counts);
3. capture  `models.capture` (replicate, bf16) launched by tasks.runtime.launch_ranks.rank_command with the
            deepspeed launcher on 1 GPU and followed with tasks.runtime.launch_ranks.follow_job;
4. train    `models.train` (DeepSpeed ZeRO-2, bf16, NCCL) likewise, a few hundred steps, a checkpoint
            and the export at the end;
5. export   the export in draft/final/ validated (SGLang and vLLM) and loaded back (models.export.eagle3);
6. eval     `models.eval`: chain speculative decoding, trained and untrained draft.

Each phase runs under its own time limit, cut to what is left of the whole run's `--budget-s`; a
launched job past its limit is killed (tasks.runtime.launch_ranks.run_job), an in-process phase interrupted. A
phase that fails is reported with its error and the phases that need it are skipped; the figures
of every phase that ran are kept. The JSON (`--json`, default $OUT/gpu_check.json where $OUT is
set, else runs/gpu-check/gpu_check.json) is rewritten after every phase, and the eval's after
every prompt (`Check.progress`), so a run killed from outside, or an eval killed at its limit
(`timed_out`), still leaves what it measured; every launched process's output goes, time-stamped,
to gpu_check.log beside it. Exit status 0 only when every phase passed.

Figures: capture tokens/s (forward phase: first to last progress line; and launch to exit), train
steps/s and tokens/s (between metrics.jsonl train lines, the first `--skip-steps` left out), the
first and final training loss, the held-out TTT acceptance estimate, export size, the eval's
acceptance length (trained, untrained), wall time per phase, and each launched process's peak
memory from its `RANK_MEMORY` line (models/ranks/harness.py: host RSS; CUDA allocator peak allocated and
reserved), the GPU's name and memory, torch / CUDA / NCCL / DeepSpeed / transformers versions.

`--cpu-smoke` runs the same sequence on this machine: a small target, torchrun + gloo, fp32, a few
steps, in well under a minute (tests/tools/test_gpu_check.py runs it). Its figures only show the
path works.

This file is the command (its flags, the preflight, the phases in order); the rest is in files of their own:
tools/gpu_check_params.py (`Params`: every knob, the `--cpu-smoke` preset), tools/gpu_check_run.py (`Check`: a phase
under its limit, the JSON and the log, the launches), tools/gpu_check_phases.py (the six phases and their figures) and
tools/gpu_check_report.py (the printed tables). Usage::

    bash tools/gpu_check.sh [--FLAG VALUE ...]              # the GPU machine (docs/gpu-check.md)
    .venv/bin/python tools/gpu_check.py --cpu-smoke [--rank-launcher deepspeed] [--json out.json]
        [--keep DIR] [--verbose]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, models, tasks
from bench import harness  # noqa: E402  (first: the offline environment the ranks inherit)
from tools.gpu_check_params import Params  # noqa: E402
from tools.gpu_check_phases import build_target, capture, check_export, evaluate, make_records, train  # noqa: E402
from tools.gpu_check_report import report  # noqa: E402
from tools.gpu_check_run import Check  # noqa: E402


def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, Params]:
    ap = harness.arguments(
        __doc__,
        Params(),
        keep="the target, records, hidden states and draft",
        verbose=True,
        quick="same as --cpu-smoke",
    )
    ap.add_argument(
        "--cpu-smoke",
        dest="quick",
        action="store_true",
        help="the small CPU preset: torchrun, gloo, fp32, a few steps (this machine, < 1 min)",
    )
    args = ap.parse_args(argv)
    return args, harness.params_from(args, Params)


def default_json() -> Path:
    out = os.environ.get("OUT")
    return Path(out) / "gpu_check.json" if out else harness.REPO / "runs" / "gpu-check" / "gpu_check.json"


# NCCL on one VM: no InfiniBand, the loopback interface, no cuMem (it fails inside some VMs and containers).
SINGLE_VM_NCCL = {"NCCL_IB_DISABLE": "1", "NCCL_SOCKET_IFNAME": "lo", "NCCL_CUMEM_ENABLE": "0"}


def preflight(p: Params, json_path: Path) -> list[Any] | None:
    """The environment checks (models/ranks/environment.py), printed; None after writing the JSON when one FAILs.

    Seconds, before the first phase: a missing package or an unseen GPU stops the check here, not minutes in.
    """
    from models.common.findings import failed
    from models.ranks.environment import environment_checks

    findings = environment_checks(p.device)
    for f in findings:
        print(
            f"   {f.status:4}  {f.name}: {f.detail}" + (f"  -> {f.advice}" if f.advice and f.status != "PASS" else ""),
            flush=True,
        )
    bad = failed(findings)
    if not bad:
        return findings
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(
        json.dumps(
            {"params": asdict(p), "preflight": [f.to_dict() for f in findings], "phases": {}, "ok": False}, indent=2
        )
        + "\n"
    )
    print(
        f"GPU check stopped before its first phase: {', '.join(f.name for f in bad)} failed (figures -> {json_path})",
        flush=True,
    )
    return None


def terminate_with_exit(signum, frame):  # noqa: ARG001 - signal handler signature
    """SIGTERM (the device runner's timeout, a user's kill) as SystemExit: the rank launch then kills its process group.

    The ranks run in a session of their own (tasks/runtime/launch_ranks.py `run_job`), so Python's default SIGTERM,
    which ends this process at once, left them running and holding the GPU; raised as an exception it passes through
    run_job's cleanup (killpg) and the figures are still written.
    """
    raise SystemExit(f"terminated (signal {signum})")


def main(argv: list[str] | None = None) -> int:
    args, p = parse_args(argv)
    signal.signal(signal.SIGTERM, terminate_with_exit)
    if p.device == "cpu":
        # This process's own math (the target's training, the records' generation) on one thread, like a
        # CPU rank: on a small busy machine, threads that spin-wait for each other make it 10-20x slower.
        import torch

        torch.set_num_threads(1)
        # DeepSpeed JIT-builds its CPU comm op into TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions, shared
        # by every checkout: another checkout's build of the same op forces a rebuild, minutes on 2 busy cores).
        # The pipeline's own directory, this virtualenv's: built once (CI builds it before the tests), then reused
        # by the pipeline, the benches and this check alike. The GPU path builds nothing.
        from tasks.runtime.torch_extensions import extensions_dir

        os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(extensions_dir()))
    json_path = args.json or default_json()
    if p.device == "cuda":
        for name, value in SINGLE_VM_NCCL.items():  # overridable: a value already in the environment wins
            os.environ.setdefault(name, value)
    findings = preflight(p, json_path)
    if findings is None:
        return 2
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="gpu-check-", dir=args.keep))
    print(
        f"GPU check ({p.launcher}, {'NCCL' if p.device == 'cuda' else 'gloo'}, {'bf16' if p.bf16 else 'fp32'}"
        f"{', --cpu-smoke' if p.quick else ''}), "
        f"budget {p.budget_s:.0f} s; figures -> {json_path}",
        flush=True,
    )
    check = Check(p, json_path, json_path.with_name("gpu_check.log"), work, bool(args.verbose))
    check.out["preflight"] = [f.to_dict() for f in findings]
    check.out["machine"]["nccl_env"] = {name: os.environ.get(name) for name in SINGLE_VM_NCCL}
    try:
        if p.device == "cuda" and not check.out["machine"]["cuda_available"]:
            check.out["phases"]["gpu"] = {
                "ok": False,
                "error": "torch sees no CUDA device (use --cpu-smoke on a CPU machine)",
            }
        else:
            target = work / "target"
            check.phase("target", p.target_s, lambda limit: build_target(p, work), in_process=True)
            check.phase(
                "records", p.records_s, lambda limit: make_records(p, work, target), needs=("target",), in_process=True
            )
            check.phase("capture", p.capture_s, lambda limit: capture(check, limit, target), needs=("records",))
            check.phase("train", p.train_s, lambda limit: train(check, limit, target), needs=("capture",))
            check.phase("export", p.export_s, lambda limit: check_export(p, work), needs=("train",), in_process=True)
            check.phase("eval", p.eval_s, lambda limit: evaluate(check, limit, target), needs=("export",))
    finally:
        check.out["ok"] = bool(check.out["phases"]) and all(r.get("ok") for r in check.out["phases"].values())
        check.out["machine"]["loadavg_end"] = harness.loadavg()
        check.save()
        check.log.close()
        if args.keep is None:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"target, records, hidden states and draft kept in {work}")
    report(check.out)
    print(f"figures written to {json_path}; the launched processes' output: {check.log_path}")
    return 0 if check.out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
