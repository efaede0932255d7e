"""The GPU check's run: its phases in order, each timed and limited, the JSON rewritten after each, the log.

`Check` runs a phase under its time limit (a launched job killed at it, an in-process one interrupted:
`time_limit`), keeps its figures or its error, and launches the pipeline's jobs as the stage tasks do;
`machine` is the facts the JSON starts with.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import platform
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import asdict
from importlib import metadata
from pathlib import Path
from typing import Any

from bench import harness
from tools.gpu_check_params import Params

REPORT_RESERVE_S = 10.0  # kept from the budget for the report


class PhaseTimeout(Exception):
    """An in-process phase ran past its limit."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    """Raise PhaseTimeout in this (main) thread once `seconds` have passed (checked between Python bytecodes)."""

    def expired(signum, frame):  # noqa: ARG001 - signal handler signature
        raise PhaseTimeout(f"ran past its time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expired)
    signal.setitimer(signal.ITIMER_REAL, max(0.01, seconds))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


class Check:
    """One check: the phases in order, each timed and limited, the figures written after each."""

    def __init__(self, p: Params, json_path: Path, log_path: Path, work: Path, verbose: bool):
        self.p, self.json_path, self.log_path, self.work, self.verbose = p, json_path, log_path, work, verbose
        self.started = time.monotonic()
        self.deadline = self.started + p.budget_s
        self.out: dict[str, Any] = {"params": asdict(p), "machine": machine(p), "phases": {}, "ok": None}
        self.running: tuple[str, float] | None = None  # the phase under way and when it started
        self.partial: dict[str, Any] = {}  # its figures so far (`progress`): kept if it fails or runs out of time
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = open(log_path, "w", buffering=1)
        self.save()

    def save(self) -> None:
        self.out["total_s"] = round(time.monotonic() - self.started, 2)
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.json_path.with_name(self.json_path.name + ".tmp")
        tmp.write_text(json.dumps(self.out, indent=2, default=str) + "\n")
        tmp.replace(self.json_path)

    def phase(
        self,
        name: str,
        cap_s: float,
        fn: Callable[[float], dict[str, Any]],
        *,
        needs: tuple[str, ...] = (),
        in_process: bool = False,
    ) -> dict[str, Any] | None:
        """Run `fn(limit_s)` as phase `name`; its figures (or its error) go into the JSON. Returns the figures or None.

        A phase that fails, runs out of time (`timed_out`) or is stopped keeps the figures it gave
        `progress` so far beside its error.
        """
        phases = self.out["phases"]
        missing = [n for n in needs if not phases.get(n, {}).get("ok")]
        left = self.deadline - REPORT_RESERVE_S - time.monotonic()
        limit = min(cap_s, left)
        if missing or limit < 5:
            why = (
                f"needs {', '.join(missing)}, which did not pass"
                if missing
                else f"no time left ({left:.0f} s of the budget)"
            )
            phases[name] = {"ok": False, "skipped": why}
            print(f"== {name}: skipped ({why})", flush=True)
            self.save()
            return None
        print(f"== {name} (limit {limit:.0f} s) ...", flush=True)
        self.note(f"=== phase {name} (limit {limit:.0f} s)")
        t0 = time.monotonic()
        self.running, self.partial = (name, t0), {}
        try:
            with time_limit(limit) if in_process else contextlib.nullcontext():
                figures = fn(limit)
            result = {"ok": True, "wall_s": round(time.monotonic() - t0, 2), **figures}
        except SystemExit as e:  # SIGTERM (terminate_with_exit): this phase's figure says so, and the check ends here
            phases[name] = {
                "ok": False,
                "wall_s": round(time.monotonic() - t0, 2),
                **self.partial,
                "error": f"{e}: the check was stopped",
            }
            self.running = None
            print(f"   STOPPED after {phases[name]['wall_s']:.1f} s: {e}", flush=True)
            self.save()
            raise
        except Exception as e:  # noqa: BLE001 - every failure is a figure of the check; the next phases still report
            from tasks.runtime.launch_ranks import JobTimedOut

            result = {
                "ok": False,
                "wall_s": round(time.monotonic() - t0, 2),
                **self.partial,
                "timed_out": isinstance(e, (PhaseTimeout, JobTimedOut)),
                "error": f"{type(e).__name__}: {e}"[-4000:],
            }
            self.note(traceback.format_exc())
            print(
                f"   {'TIMED OUT' if result['timed_out'] else 'FAILED'} after {result['wall_s']:.1f} s: "
                f"{result['error'][-1500:]}",
                flush=True,
            )
        self.running = None
        phases[name] = result
        if result["ok"]:
            print(f"   ok in {result['wall_s']:.1f} s", flush=True)
        self.save()
        return result if result["ok"] else None

    def progress(self, **figures: Any) -> None:
        """Figures of the running phase so far, into the JSON now: what a phase killed at its limit leaves."""
        assert self.running is not None, "progress outside a phase"
        name, t0 = self.running
        self.partial.update(figures)
        self.out["phases"][name] = {
            "ok": False,
            "running": True,
            "wall_s": round(time.monotonic() - t0, 2),
            **self.partial,
        }
        self.save()

    def note(self, line: str) -> None:
        """A line into gpu_check.log, stamped with the seconds since the check started."""
        self.log.write(f"{time.monotonic() - self.started:9.3f} {line}\n")
        if self.verbose:
            print(f"      | {line}", flush=True)

    def launch(
        self,
        module: str,
        job_path: Path,
        protocol: Any,
        limit_s: float,
        *,
        single_process: bool = False,
        on_progress: Callable[[Any], None] | None = None,
    ) -> dict[str, Any]:
        """Launch `python -m module --job JOB` as the stage tasks do; its protocol lines, their times, its memory.

        One rank (`single_process` False; one GPU): tasks.runtime.launch_ranks.rank_command with this check's launcher;
        the eval job runs as one process, as tasks/eval/tasks.py starts it. The output is followed with
        tasks.runtime.launch_ranks.follow_job, so a failing rank raises its own exception; the launch is killed
        at `limit_s` (JobTimedOut). `on_progress` gets each progress message as it comes.
        """
        from models.common.rank_protocol import RANK_MEMORY
        from tasks.runtime.launch_ranks import follow_job, rank_command, run_job

        if single_process:
            command, env = [sys.executable, "-m", module, "--job", str(job_path)], {"OMP_NUM_THREADS": "1"}
        else:
            command, env = rank_command(module, ["--job", str(job_path)], num_ranks=1, launcher=self.p.launcher)
        # The ranks import models/ from this checkout (no editable install on the GPU machine) and the
        # carried wheels from PYTHONPATH (tools/gpu_check.sh puts them there).
        env = {
            **env,
            "PYTHONPATH": os.pathsep.join(x for x in (str(harness.REPO), os.environ.get("PYTHONPATH")) if x),
            "TOKENIZERS_PARALLELISM": "false",
        }
        self.note("launch: " + " ".join(command))
        messages: list[tuple[float, Any]] = []  # (time.time(), Message)
        memory: list[dict[str, int]] = []
        started = time.time()

        def on_line(line: str) -> None:
            self.note(line)
            found = RANK_MEMORY.parse(line)
            if found is not None:
                memory.append(found)

        def on_message(message: Any) -> None:
            messages.append((time.time(), message))
            if message.kind is protocol.progress:  # follow_job logs the events itself
                self.note(message.line)
                if on_progress is not None:
                    on_progress(message)

        follow_job(
            command,
            protocol=protocol,
            log=on_line,
            on_message=on_message,
            env=env,
            run=functools.partial(run_job, timeout_s=limit_s),
        )
        ended = time.time()
        return {"started": started, "ended": ended, "messages": messages, "memory": memory}


def version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine(p: Params) -> dict[str, Any]:
    """The machine's facts: CPU, Python, the packages' versions, the GPU (name, memory, driver) where there is one."""
    import torch

    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "processor": harness.cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        **{
            name: version(name)
            for name in ("deepspeed", "transformers", "tokenizers", "safetensors", "pydantic", "pyarrow")
        },
        "cuda_available": torch.cuda.is_available(),
        "loadavg_start": harness.loadavg(),
        # the deepspeed launcher maps it to its ranks' GPUs (tasks/runtime/launch_ranks.py `local_devices`)
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        facts.update(
            gpus=torch.cuda.device_count(),
            gpu=props.name,
            gpu_memory_gib=round(props.total_memory / 2**30, 1),
            gpu_capability=f"{props.major}.{props.minor}",
        )
        with contextlib.suppress(Exception):  # a tuple in torch 2.x, an int before; a figure, never a failure
            nccl = torch.cuda.nccl.version()
            facts["nccl"] = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            facts["driver"] = (
                subprocess.run(
                    ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                    capture_output=True,
                    text=True,
                    timeout=20,
                ).stdout.strip()
                or None
            )
    return facts
