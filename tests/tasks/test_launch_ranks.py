"""Following a rank job: its output logged, its protocol lines handed over, its failure raised as the rank's own."""

from __future__ import annotations

import errno
import sys
from pathlib import Path

import pytest

from models.common.file_errors import DamagedShard, WriteFailed
from models.common.job_files import CaptureJobFile
from models.common.rank_protocol import CAPTURE, TRAIN, TRAIN_CHECKPOINT, TRAIN_PROGRESS, error_report
from settings.distributed import Nodes
from settings.target import Target
from tasks.runtime import launch_ranks
from tasks.runtime.launch_ranks import RankFailure, RankRefused, follow_job, rank_error, write_job
from tasks.runtime.torch_extensions import COMM_OP
from tests.capture_jobs import small_capture_job
from tests.rank_failures import shard_write_failed


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


@pytest.mark.multiprocess
def test_lines_go_to_the_log_progress_and_events_to_the_task():
    # A real process (run_job): protocol lines on stdout, a log line on stderr, as the ranks print them.
    code = (
        "import sys; print('TRAIN_PROGRESS step=0 total=2 tokens=0', flush=True); "
        "print('train: resuming', file=sys.stderr, flush=True); "
        "print('[default0]:TRAIN_PROGRESS step=2 total=2 tokens=80 loss=0.5000 lr=0.001', flush=True); "
        "print('TRAIN_CHECKPOINT step=2', flush=True)"
    )
    logged, messages = [], []
    follow_job(_python(code), protocol=TRAIN, log=logged.append, on_message=messages.append)
    assert logged == ["train: resuming", "TRAIN_CHECKPOINT step=2"]
    assert [(m.kind, m.values) for m in messages] == [
        (TRAIN_PROGRESS, {"step": 0, "total": 2, "tokens": 0}),
        (TRAIN_PROGRESS, {"step": 2, "total": 2, "tokens": 80, "loss": 0.5, "lr": 0.001}),
        (TRAIN_CHECKPOINT, {"step": 2}),
    ]


@pytest.mark.multiprocess
def test_a_failed_rank_raises_its_own_exception_in_its_words(tmp_path):
    written = shard_write_failed(tmp_path)
    lines = [
        CAPTURE.error.format(error_report(RuntimeError("Connection closed by peer"), 0)),
        CAPTURE.error.format(error_report(written, 1)),
        f"capture rank 1 failed: {written}",
    ]
    code = (
        f"import sys; print({lines!r}[0], file=sys.stderr); print(*{lines!r}[1:], sep='\\n', file=sys.stderr); "
        "sys.exit(1)"
    )
    logged = []
    with pytest.raises(WriteFailed) as failed:
        follow_job(_python(code), protocol=CAPTURE, log=logged.append)
    assert str(failed.value) == str(written) and "\n" not in str(failed.value)
    assert logged == [f"capture rank 1 failed: {written}"]  # the reports themselves are not logged


@pytest.mark.multiprocess
def test_no_report_leaves_the_launchers_failure_with_the_output_tail():
    with pytest.raises(RankFailure, match=r"(?s)exited with code 3.*--- last output ---\nkilled, in words"):
        follow_job(
            _python("import sys; print('killed, in words'); sys.exit(3)"), protocol=CAPTURE, log=lambda line: None
        )


def test_a_stage_decides_what_refused_and_unexplained_failures_are(tmp_path):
    refused = rank_error([error_report(ValueError("shards captured with other settings"), 0)], CAPTURE)
    assert isinstance(refused, RankRefused) and str(refused) == "capture rank 0: shards captured with other settings"
    damaged = DamagedShard(tmp_path / "s.safetensors", "7 bytes")
    assert type(rank_error([error_report(damaged, 1)], CAPTURE)) is DamagedShard
    assert rank_error([error_report(RuntimeError("NCCL timeout"), 0)], CAPTURE) is None

    def scripted(command, *, env=None, on_line):
        on_line(CAPTURE.error.format(error_report(RuntimeError("NCCL timeout"), 0)))
        raise RankFailure("job exited with code 1")

    with pytest.raises(LookupError, match="^rank 0 crashed$"):
        follow_job(
            ["ranks"],
            protocol=CAPTURE,
            log=print,
            run=scripted,
            failure=lambda reports, error: LookupError(f"rank {reports[0]['rank']} crashed"),
        )


def test_a_job_file_that_cannot_be_written_is_a_write_failure(tmp_path, monkeypatch):
    path = tmp_path / "jobs" / "capture.json"
    job = CaptureJobFile(target=Target(path="t"), out_dir=str(tmp_path), mode="zero3", launch_tokens=None)
    write_job(job, path, kept=lambda: "nothing", resume="rerun")
    assert CaptureJobFile.load(path) == job

    def full(path, data):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(launch_ranks, "write_atomic", full)
    with pytest.raises(WriteFailed, match=rf"^cannot write {path}: disk full: .*kept: every shard\. to resume: rerun$"):
        write_job(job, path, kept=lambda: "every shard", resume="rerun")


# --- launch commands: one node, several ------------------------------------------------------------


@pytest.fixture
def extensions(tmp_path, monkeypatch) -> Path:
    """A TORCH_EXTENSIONS_DIR of the test's own, the CPU comm op in it (a stand-in library): nothing gets built."""
    directory = tmp_path / "torch_extensions"
    (directory / COMM_OP).mkdir(parents=True)
    (directory / COMM_OP / f"{COMM_OP}.so").touch()  # newer than DeepSpeed's sources of it: built
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(directory))
    return directory


def test_one_node_commands_pick_a_free_port(monkeypatch, extensions):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    command, env = launch_ranks.rank_command("models.train", ["--job", "J"], num_ranks=2, launcher="torchrun")
    port = command[6]
    assert (
        command[1:]
        == f"-m torch.distributed.run --nproc_per_node 2 --master_port {port} -m models.train --job J".split()
    )
    assert env == {"DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "TORCH_EXTENSIONS_DIR": str(extensions)}
    command, env = launch_ranks.rank_command("models.train", ["--job", "J"], num_ranks=8, launcher="deepspeed")
    port = command[6]
    assert (
        command[1:]
        == f"-m deepspeed.launcher.runner --num_gpus 8 --master_port {port} --module models.train --job J".split()
    )
    assert env == {
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
        "TORCH_EXTENSIONS_DIR": str(extensions),
    }  # no CUDA here: the CPU accelerator, a thread a rank
    monkeypatch.setattr(launch_ranks, "cuda_available", lambda: True)
    env = launch_ranks.rank_command("models.train", [], num_ranks=8, launcher="deepspeed")[1]
    assert env == {"TORCH_EXTENSIONS_DIR": str(extensions)}


def test_the_deepspeed_launcher_keeps_the_gpus_cuda_visible_devices_picks(monkeypatch, extensions):
    # Given --num_gpus the runner drops CUDA_VISIBLE_DEVICES and hands out GPUs 0..N-1; --include keeps the chosen ones.
    monkeypatch.setattr(launch_ranks, "cuda_available", lambda: True)
    for visible, ranks, flags in (
        ("", 2, ["--num_gpus", "2"]),
        ("0", 1, ["--include", "localhost:0"]),
        ("2, 3,5", 2, ["--include", "localhost:2,3"]),
        ("GPU-8f1c2b4e-0d6a", 1, ["--num_gpus", "1"]),  # a UUID: the runner cannot parse it
        ("MIG-5e7a9c1d-77b2", 1, ["--num_gpus", "1"]),
    ):
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
        command, _ = launch_ranks.rank_command("models.capture", ["--job", "J"], num_ranks=ranks, launcher="deepspeed")
        assert command[3:5] == flags and "--num_gpus" not in command[5:], visible
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3")
    with pytest.raises(ValueError, match=r"^2 ranks, but CUDA_VISIBLE_DEVICES=3 makes 1 GPU\(s\) visible$"):
        launch_ranks.rank_command("models.capture", [], num_ranks=2, launcher="deepspeed")
    monkeypatch.setattr(
        launch_ranks, "cuda_available", lambda: False
    )  # CPU: the accelerator counts NUMA nodes, not these
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert launch_ranks.rank_command("models.capture", [], num_ranks=2, launcher="deepspeed")[0][3:5] == [
        "--num_gpus",
        "2",
    ]


def test_torchrun_over_nodes_is_a_static_rendezvous_at_node_0(extensions):
    nodes = Nodes(nnodes=2, master_addr="10.0.0.5", master_port=29400, join_timeout_s=300)
    command, _ = launch_ranks.rank_command(
        "models.capture", ["--job", "J"], num_ranks=8, launcher="torchrun", nodes=nodes, node_rank=1
    )
    assert command[1:] == [
        "-m",
        "torch.distributed.run",
        "--nnodes",
        "2",
        "--node_rank",
        "1",
        "--master_addr",
        "10.0.0.5",
        "--rdzv_conf",
        "timeout=300",
        "--nproc_per_node",
        "8",
        "--master_port",
        "29400",
        "-m",
        "models.capture",
        "--job",
        "J",
    ]
    with pytest.raises(ValueError, match=r"node rank 2 is outside 0..1"):
        launch_ranks.rank_command("models.capture", [], num_ranks=8, launcher="torchrun", nodes=nodes, node_rank=2)
    with pytest.raises(ValueError, match=r"distributed: nnodes 2 with torchrun needs master_addr"):
        launch_ranks.rank_command("models.capture", [], num_ranks=8, launcher="torchrun", nodes=Nodes(nnodes=2))


def test_deepspeed_over_nodes_starts_every_node_from_the_hostfile(tmp_path, monkeypatch, extensions):
    monkeypatch.setattr(
        launch_ranks, "cuda_available", lambda: True
    )  # GPU nodes: DeepSpeed's CUDA accelerator, detected
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("gpu-0 slots=8\ngpu-1 slots=8\ngpu-2 slots=8\n")
    nodes = Nodes(nnodes=2, hostfile=hostfile, master_port=29400)
    command, env = launch_ranks.rank_command(
        "models.train", ["--job", "J"], num_ranks=8, launcher="deepspeed", nodes=nodes
    )
    assert command[1:] == [
        "-m",
        "deepspeed.launcher.runner",
        "--hostfile",
        str(hostfile),
        "--num_nodes",
        "2",
        "--num_gpus",
        "8",
        "--master_port",
        "29400",
        "--module",
        "models.train",
        "--job",
        "J",
    ]
    assert env == {"TORCH_EXTENSIONS_DIR": str(extensions)}
    with_addr = nodes.model_copy(update={"master_addr": "10.0.0.5"})
    command, _ = launch_ranks.rank_command("models.train", [], num_ranks=8, launcher="deepspeed", nodes=with_addr)
    assert command[command.index("--master_addr") + 1] == "10.0.0.5"
    with pytest.raises(ValueError, match="starts every node's ranks from node 0"):
        launch_ranks.rank_command("models.train", [], num_ranks=8, launcher="deepspeed", nodes=nodes, node_rank=1)
    with pytest.raises(ValueError, match="node 0 is the node the pipeline runs on"):
        launch_ranks.run_node(
            "models.train",
            tmp_path / "j.json",
            protocol=TRAIN,
            num_ranks=8,
            launcher="deepspeed",
            nodes=nodes,
            node_rank=0,
            attempts=1,
            log=print,
        )


def test_hostfile_is_read_as_deepspeed_reads_it(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("# comment\n\nworker-0 slots=8\nworker-1  slots=4  # trailing\n")
    assert launch_ranks.read_hostfile(hostfile) == {"worker-0": 8, "worker-1": 4}
    hostfile.write_text("worker-0 gpus=8\n")
    with pytest.raises(ValueError, match=r"line 1: 'worker-0 gpus=8' is not `<host> slots=<GPUs>`"):
        launch_ranks.read_hostfile(hostfile)
    hostfile.write_text("# nothing\n")
    with pytest.raises(ValueError, match="no `<host> slots=<GPUs>` line"):
        launch_ranks.read_hostfile(hostfile)


@pytest.mark.multiprocess
def test_a_job_past_its_time_limit_is_killed_and_says_so():
    import time

    started = time.monotonic()
    with pytest.raises(
        launch_ranks.JobTimedOut, match=r"(?s)killed after its time limit of 1 s.*--- last output ---\nstarted"
    ):
        launch_ranks.run_job(
            _python("import time; print('started', flush=True); time.sleep(60)"), on_line=lambda line: None, timeout_s=1
        )
    assert time.monotonic() - started < 30


def test_launching_ranks_needs_neither_prefect_nor_httpx():
    # The GPU check (tools/gpu_check.py) launches ranks through this module on a machine without them.
    import ast
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    seen, todo, found = set(), ["tasks.runtime.launch_ranks"], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        path = repo / (module.replace(".", "/") + ".py")
        if not path.is_file():
            path = repo / module.replace(".", "/") / "__init__.py"
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [node.module]
                if isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                else [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else []
            )
            for name in names:
                if name.split(".")[0] in ("prefect", "httpx"):
                    found.append(f"{module}: {name}")
                elif name.split(".")[0] in ("tasks", "models"):
                    todo.append(name)
    assert found == []


# --- the deepspeed launcher, for real, on this CPU machine ------------------------------------------


@pytest.mark.multiprocess
def test_the_deepspeed_launcher_runs_two_cpu_ranks_of_a_capture(tmp_path, monkeypatch):
    """`rank_command(launcher="deepspeed")` + `follow_job`, as the GPU check launches its ranks.

    Two gloo ranks of a real capture.
    """
    import pyarrow.parquet as pq
    import torch
    from transformers import AutoModelForCausalLM

    from models.capture.shards import iter_shard_index, list_shards, read_sample
    from models.common.rank_protocol import CAPTURE_PROGRESS, RANK_MEMORY
    from models.draft.config import default_aux_layers

    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    target, job_path = small_capture_job(tmp_path)  # random weights: seconds to build
    rows = pq.read_table(tmp_path / "records" / "part-000000.parquet").to_pylist()
    out = tmp_path / "hidden"

    command, env = launch_ranks.rank_command(
        "models.capture", ["--job", str(job_path)], num_ranks=2, launcher="deepspeed"
    )
    assert command[1:3] == ["-m", "deepspeed.launcher.runner"]
    logged, messages = [], []
    follow_job(
        command,
        protocol=CAPTURE,
        log=logged.append,
        on_message=messages.append,
        env=env,
        run=lambda c, **kw: launch_ranks.run_job(c, timeout_s=180, **kw),
    )

    # the runner's own lines: one node, two CPU "devices", ranks told their local rank
    text = "\n".join(logged)
    assert "WORLD INFO DICT: {'localhost': [0, 1]}" in text and "dist_world_size=2" in text
    assert "--local_rank=0" in text and "--local_rank=1" in text
    finals = {m.values["rank"]: m.values for m in messages if m.kind is CAPTURE_PROGRESS}
    assert set(finals) == {0, 1} and all(v["done"] == v["total"] for v in finals.values())
    assert sum(v["done"] for v in finals.values()) == 8 and sum(v["tokens"] for v in finals.values()) == sum(
        r["num_tokens"] for r in rows
    )  # every record ends with a loss token: nothing trimmed
    assert sorted(RANK_MEMORY.parse(x)["rank"] for x in logged if RANK_MEMORY.parse(x)) == [0, 1]
    assert {p.name.split("-")[1] for p in list_shards(out)} == {"000", "001"}  # each rank wrote its own shards

    # what they stored is the target's own hidden states, every record once
    model = AutoModelForCausalLM.from_pretrained(target).eval()
    aux = default_aux_layers(8)
    index = list(iter_shard_index(out))
    assert sorted(r["id"] for r in index) == [f"r{i}" for i in range(8)]
    by_id = {r["id"]: r for r in rows}
    for r in index:
        got = read_sample(out / r["shard"], r["offset"], r["length"])
        ids = torch.tensor(by_id[r["id"]]["input_ids"])
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        assert torch.equal(got["input_ids"], ids.to(torch.int32))
        assert torch.allclose(got["aux_hidden"], torch.cat([hs[k + 1] for k in aux], -1)[0], atol=1e-5, rtol=0)
        assert torch.allclose(got["last_hidden"], hs[-1][0], atol=1e-5, rtol=0)
