"""Launching rank jobs (torchrun on CPU, the deepspeed launcher on GPU machines) and following them to the end.

A stage task writes the JSON job its ranks read (`write_job`), builds the launch (`rank_command`) and
calls `follow_job`: it runs the ranks (`run_job`), puts their output in the log, hands their protocol
lines (models/common/rank_protocol.py) to the task, and when the job fails raises what the failing rank
reported, its own exception (a failed write, a damaged file, ...), rather than the launcher's exit
code, which stays as `RankFailure` only when no rank said why.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from models.common.atomic import write_atomic
from models.common.file_errors import WriteFailed, is_write_error
from models.common.rank_protocol import Message, Protocol, most_telling, reported_error
from settings.base import StrictModel
from settings.distributed import Nodes
from tasks.runtime import stopping, torch_extensions
from tasks.runtime.ports import free_port


class RankFailure(RuntimeError):
    """A rank of a launched job exited with an error; the message ends with the job's output tail."""


class JobTimedOut(RankFailure):
    """A launched job ran past its time limit and was killed (`run_job(timeout_s=...)`)."""


class RankRefused(ValueError):
    """A rank refused its job (bad job, records, settings or files): a retry would fail the same way."""


def cuda_available() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except Exception:  # a broken CUDA install is a CPU machine for our purposes
        return False


def resolve_launcher(launcher: str) -> str:
    """`auto` made concrete: the deepspeed launcher on a CUDA machine, torchrun otherwise."""
    if launcher == "auto":
        return "deepspeed" if cuda_available() else "torchrun"
    return launcher


def rank_device(launcher: str) -> Literal["cpu", "cuda"]:
    """Where a job's ranks run: cuda under the deepspeed launcher (`auto` on a CUDA machine), cpu (gloo) otherwise."""
    return "cuda" if resolve_launcher(launcher) == "deepspeed" else "cpu"


def read_hostfile(path: Path) -> dict[str, int]:
    """DeepSpeed's hostfile as {host: slots}, in file order; ValueError naming the file and the line.

    Read as DeepSpeed reads it (`<host> slots=<N>` a line, `#` comments and blank lines skipped, a
    host once), so a file it would refuse is refused here, before any node is started.
    """
    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the hostfile {path}: {e.strerror or e}") from None
    hosts: dict[str, int] = {}
    for number, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        match = HOSTFILE_LINE.match(text)
        if match is None:
            raise ValueError(f"{path}, line {number}: {text!r} is not `<host> slots=<GPUs>`")
        if match["host"] in hosts:
            raise ValueError(f"{path}, line {number}: host {match['host']!r} is listed twice")
        hosts[match["host"]] = int(match["slots"])
    if not hosts:
        raise ValueError(f"{path}: no `<host> slots=<GPUs>` line")
    return hosts


HOSTFILE_LINE = re.compile(r"^(?P<host>\S+)\s+slots=(?P<slots>\d+)")


def node_problems(nodes: Nodes, launcher: str, num_gpus: int) -> list[str]:
    """Why `nodes` cannot run a job of `num_gpus` ranks per node under `launcher` (torchrun or deepspeed);
    [] if it can."""
    if not nodes.multinode:
        return []
    if launcher == "torchrun":
        if nodes.master_addr is None:
            return [
                f"nnodes {nodes.nnodes} with torchrun needs master_addr: the address of node 0 that every node "
                "reaches (its rendezvous runs there, on master_port)"
            ]
        return []
    if nodes.hostfile is None:
        return [
            f"nnodes {nodes.nnodes} with the deepspeed launcher needs hostfile: one `<host> slots=<GPUs>` line per "
            "node (deploy/hostfile.example); node 0 starts every node's ranks from it over ssh"
        ]
    try:
        hosts = read_hostfile(nodes.hostfile)
    except ValueError as e:
        return [str(e)]
    if len(hosts) < nodes.nnodes:
        return [f"nnodes {nodes.nnodes}, but the hostfile {nodes.hostfile} lists {len(hosts)} host(s)"]
    short = {h: n for h, n in list(hosts.items())[: nodes.nnodes] if n < num_gpus}
    if short:
        return [
            f"num_gpus {num_gpus} per node, but the hostfile {nodes.hostfile} gives "
            + ", ".join(f"{h} slots={n}" for h, n in short.items())
            + ": every node runs num_gpus ranks (the world size is nnodes x num_gpus)"
        ]
    return []


def rank_command(
    module: str,
    args: list[str],
    *,
    num_ranks: int,
    launcher: str = "auto",
    nodes: Nodes | None = None,
    node_rank: int = 0,
) -> tuple[list[str], dict[str, str]]:
    """The command and extra environment that run `python -m module args` on `num_ranks` ranks per node.

    One node: every rank here, on a free port (the deepspeed launcher on the GPUs `local_devices` picks;
    on a CPU machine it runs gloo ranks as torchrun does: tests/tasks/test_launch_ranks.py). Several
    (`nodes.nnodes` > 1): torchrun starts this node's ranks as node `node_rank` of a static rendezvous
    at master_addr:master_port (each node runs it); the deepspeed launcher, run on node 0 only, starts
    every node's ranks from the hostfile (pdsh). A setting that cannot work raises ValueError, naming it.
    """
    nodes = nodes or Nodes()
    launcher = resolve_launcher(launcher)
    problems = node_problems(nodes, launcher, num_ranks)
    if problems:
        raise ValueError("distributed: " + "; ".join(problems))
    if not 0 <= node_rank < nodes.nnodes:
        raise ValueError(f"node rank {node_rank} is outside 0..{nodes.nnodes - 1} (distributed.nnodes {nodes.nnodes})")
    port = str(nodes.master_port if nodes.multinode else free_port())
    if launcher == "deepspeed":
        if node_rank != 0:
            raise ValueError(
                "the deepspeed launcher starts every node's ranks from node 0 (over ssh, distributed.hostfile): "
                "start nothing on the other nodes"
            )
        if nodes.multinode:
            where = ["--hostfile", str(nodes.hostfile), "--num_nodes", str(nodes.nnodes)]
            where += ["--master_addr", nodes.master_addr] if nodes.master_addr else []
            where += ["--num_gpus", str(num_ranks)]
        else:
            where = local_devices(num_ranks)
        command = [
            sys.executable,
            "-m",
            "deepspeed.launcher.runner",
            *where,
            "--master_port",
            port,
            "--module",
            module,
            *args,
        ]
        # No CUDA: DeepSpeed's CPU accelerator, said rather than left to its detection (which also tries XPU, NPU, ...)
        return command, (torch_extensions.prepare(cpu=False) if cuda_available() else cpu_rank_env())
    where = (
        [
            "--nnodes",
            str(nodes.nnodes),
            "--node_rank",
            str(node_rank),
            "--master_addr",
            str(nodes.master_addr),
            "--rdzv_conf",
            f"timeout={nodes.join_timeout_s}",
        ]
        if nodes.multinode
        else []
    )
    command = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *where,
        "--nproc_per_node",
        str(num_ranks),
        "--master_port",
        port,
        "-m",
        module,
        *args,
    ]
    return command, cpu_rank_env()


def cpu_rank_env() -> dict[str, str]:
    """CPU ranks: DeepSpeed's CPU accelerator with gloo; one thread per rank, so ranks don't fight for cores.

    And the pipeline's own torch extensions directory, its CPU comm op built (tasks/runtime/torch_extensions.py).
    """
    return {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        **torch_extensions.prepare(cpu=True),
    }


def local_devices(num_ranks: int) -> list[str]:
    """The deepspeed launcher's flags for `num_ranks` ranks on this machine, on the GPUs CUDA_VISIBLE_DEVICES picks.

    Given `--num_gpus N`, DeepSpeed's runner ignores CUDA_VISIBLE_DEVICES, drops it and gives the ranks
    devices 0..N-1 (deepspeed/launcher/runner.py: "Detected VISIBLE_DEVICES=... but ignoring it because
    ... --num_gpus ... were used"); given none it keeps them (`--include localhost:<them>`, its own
    path), then checks them against the devices it counts (torch's count, taken once it has dropped
    the variable: every GPU of the machine). So integer ids are passed on as `--include
    localhost:<first N>`; without them (unset, GPU-/MIG- UUIDs it cannot parse, a CPU machine, whose
    accelerator counts NUMA nodes) it is `--num_gpus N`. Too few ids raise ValueError. Read from
    DeepSpeed 0.19.8's runner; the `--include` path has not run on a GPU machine yet.
    """
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    ids = [x.strip() for x in visible.split(",")] if visible else []
    if not ids or not all(x.isdigit() for x in ids) or not cuda_available():
        return ["--num_gpus", str(num_ranks)]
    if len(ids) < num_ranks:
        raise ValueError(f"{num_ranks} ranks, but CUDA_VISIBLE_DEVICES={visible} makes {len(ids)} GPU(s) visible")
    return ["--include", "localhost:" + ",".join(ids[:num_ranks])]


def run_job(
    command: list[str],
    *,
    env: dict[str, str] | None = None,
    on_line: Callable[[str], None],
    tail_lines: int = 40,
    timeout_s: float | None = None,
) -> None:
    """Run `command`, passing each output line (stdout and stderr merged) to `on_line` as it comes.

    A nonzero exit raises RankFailure with the last lines of output (where the failing rank's
    traceback is). On KeyboardInterrupt (SIGTERM too, in the CLI: tasks/runtime/stopping.py) or cancellation
    the job is killed: the launcher's process group and every rank, each in a session of its own;
    and so it is once `timeout_s` have passed (then JobTimedOut, a RankFailure, says so). While it
    runs, the command's stop watchdog knows it.
    """
    tail: deque[str] = deque(maxlen=tail_lines)
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        start_new_session=True,
    )
    stopping.track(process, f"the rank job {' '.join(command[:4])} ... (pid {process.pid})")
    timed_out = threading.Event()

    def time_up() -> None:
        timed_out.set()
        _signal_group(process, signal.SIGKILL)  # the read loop below then sees the pipe close

    timer = threading.Timer(timeout_s, time_up) if timeout_s is not None else None
    try:
        if timer is not None:
            timer.daemon = True
            timer.start()
        assert process.stdout is not None
        for raw in iter(process.stdout.readline, b""):
            line = raw.decode("utf-8", "replace").rstrip("\n")
            tail.append(line)
            on_line(line)
        code = process.wait()
    except BaseException:
        _kill_group(process)
        raise
    finally:
        if timer is not None:
            timer.cancel()
        stopping.untrack(process)
    if timed_out.is_set():
        raise JobTimedOut(
            f"job killed after its time limit of {timeout_s:g} s: {' '.join(command[:6])} ...\n"
            "--- last output ---\n" + "\n".join(tail)
        )
    if code != 0:
        raise RankFailure(
            f"job exited with code {code}: {' '.join(command[:6])} ...\n--- last output ---\n" + "\n".join(tail)
        )


def write_job(job: StrictModel, path: Path, *, kept: Callable[[], str], resume: str) -> None:
    """Write a rank job's JSON file (atomically) from its spec;
    a storage failure is `WriteFailed` saying what is `kept()`."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, job.model_dump_json(indent=2))
    except OSError as e:
        if not is_write_error(e):
            raise
        raise WriteFailed(path, e, kept=kept(), resume=resume) from None


def rank_error(
    reports: list[dict[str, Any]],
    protocol: Protocol,
    *,
    refused: Callable[[str], Exception] = RankRefused,
    known: Iterable[type[Exception]] = (),
) -> Exception | None:
    """The exception a failed job stands for, from its ranks' error reports; None when no rank said why.

    The most telling report wins (a rank's failed write over its peers' lost connections): a failed
    write or a damaged file is raised as itself in the rank's words, a class of `known` by its name,
    bad input as `refused("<stage> rank R: message")`. An unexpected error, or no report (a rank
    killed or crashed in C), gives None: the launcher's RankFailure, with the output tail, stands.
    """
    report = most_telling(reports)
    if report is None:
        return None
    error = reported_error(report, known)
    if error is None and report.get("kind") == "invalid":
        error = refused(f"{protocol.name} rank {report.get('rank')}: {report.get('message', '')}")
    return error


def follow_job(
    command: list[str],
    *,
    protocol: Protocol,
    log: Callable[[str], None],
    on_message: Callable[[Message], None] | None = None,
    env: dict[str, str] | None = None,
    failure: Callable[[list[dict[str, Any]], RankFailure], BaseException] | None = None,
    run: Callable[..., None] | None = None,
) -> None:
    """Run a rank job to its end: its output to `log`, its protocol lines to `on_message`, its failure raised.

    Progress lines go to `on_message` only (the task shows a summary); events (a checkpoint, the end)
    go to both; error reports to neither (the rank's next line says it in words). A failed job
    raises `failure(reports, launcher_error)`, by default the rank's own exception (`rank_error`)
    or else the launcher's RankFailure. `run` stands in for `run_job` (the tests' scripted ranks).
    """
    reports: list[dict[str, Any]] = []

    def on_line(line: str) -> None:
        message = protocol.parse(line)
        if message is None or message.kind in protocol.events:
            log(line)
        if message is None:
            return
        if message.kind is protocol.error:
            reports.append(message.values)
        elif on_message is not None:
            on_message(message)

    try:
        (run or run_job)(command, env=env, on_line=on_line)
    except RankFailure as launcher_error:
        error = failure(reports, launcher_error) if failure is not None else rank_error(reports, protocol)
        if error is None or error is launcher_error:
            raise
        raise error from None  # one line: the rank's traceback, if it printed one, is in the log


def run_node(
    module: str,
    job_path: Path,
    *,
    protocol: Protocol,
    num_ranks: int,
    launcher: str,
    nodes: Nodes,
    node_rank: int,
    attempts: int,
    log: Callable[[str], None],
) -> None:
    """Run node `node_rank`'s ranks of a multi-node torchrun job that node 0's pipeline launches;
    return when it succeeds.

    Node 0 writes `job_path` before it starts its own launcher, and ranks read it only once every node
    has joined, so this may start before or after node 0 (within distributed.join_timeout_s). Node 0
    retries a failed job (the stage's `retries`), each retry a new rendezvous: this joins up to
    `attempts` launches and raises the last failure.
    """
    if node_rank == 0:
        raise ValueError(
            "node 0 is the node the pipeline runs on (`eagle3 run`): it launches its own ranks; "
            f"give this node's rank, 1..{nodes.nnodes - 1}"
        )
    command, env = rank_command(
        module, ["--job", str(job_path)], num_ranks=num_ranks, launcher=launcher, nodes=nodes, node_rank=node_rank
    )
    for attempt in range(1, attempts + 1):
        log(
            f"node {node_rank}: {protocol.name} ranks {node_rank * num_ranks}..{(node_rank + 1) * num_ranks - 1} of "
            f"{nodes.nnodes * num_ranks}, joining node 0 at {nodes.master_addr}:{nodes.master_port} "
            f"(launch {attempt} of at most {attempts}): {' '.join(command)}"
        )
        try:
            follow_job(command, protocol=protocol, env=env, log=log, on_message=lambda message: log(message.line))
            return
        except Exception as e:  # noqa: BLE001 - node 0 decides whether to retry; this node joins the retry if it comes
            if attempt == attempts:
                raise
            log(
                f"node {node_rank}: the {protocol.name} job failed ({(str(e).splitlines() or [type(e).__name__])[0]}); "
                f"waiting up to {nodes.join_timeout_s}s for node 0's next launch"
            )


def _kill_group(process: subprocess.Popen) -> None:
    _signal_group(process, signal.SIGKILL)
    process.wait()


def _signal_group(process: subprocess.Popen, sig: int) -> None:
    """`sig` to the job's process group; SIGKILL also to every rank (torchrun starts each in a session of its own, so
    the launcher's group does not hold them: killed with it alone, they would run on without a parent)."""
    if sig == signal.SIGKILL:
        stopping.kill_tree(process.pid)
        return
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass
