"""Capture and training over 2 nodes on loopback: two torchrun launchers with nnodes 2 on 127.0.0.1.

Node 0 is launched as the stage tasks launch it (`rank_command` with `distributed`), node 1 as an
operator starts it (`eagle3 node CONFIG --node-rank 1`, reading RUN_DIR/jobs/<stage>.json). Both
runs are compared with one launcher of 2 ranks (nproc_per_node 2), the same world size: the shards
are tensor-equal under the same names, the training losses and weights equal. A capture whose node 1
is SIGKILLed mid-run fails on node 0 too; the rerun on 2 nodes resumes and ends with every sample
once, equal to the single-node capture. Nodes that do not share the output directory are stopped.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from safetensors import safe_open

from models.capture.shards import iter_shard_index, list_shards, read_sample, shard_metadata
from models.common.job_files import CaptureJobFile, TrainJobFile
from settings.distributed import Nodes
from settings.target import Target
from tasks.runtime.launch_ranks import rank_command, write_job
from tasks.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
TIMEOUT_S = 240
pytestmark = pytest.mark.multiprocess


# --- data and jobs --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    """24 records of random token ids (lengths 8..64, loss on the tail) and their loss-token counts."""
    rng = random.Random(7)
    root = tmp_path_factory.mktemp("multinode")
    records = root / "records" / "D1"
    records.mkdir(parents=True)
    rows, counts = [], np.zeros(512, dtype=np.int64)
    for i in range(24):
        n = rng.randint(8, 64)
        ids = [rng.randrange(512) for _ in range(n)]
        prompt = rng.randint(2, n - 3)
        rows.append({"id": f"r{i:02d}", "input_ids": ids, "loss_mask": [0] * prompt + [1] * (n - prompt)})
        np.add.at(counts, ids[prompt:], 1)
    pq.write_table(pa.Table.from_pylist(rows), records / "part-000000.parquet")
    token_counts = root / "records" / "token_counts.parquet"
    pq.write_table(pa.table({"token_id": np.flatnonzero(counts), "count": counts[counts > 0]}), token_counts)
    return {"root": root, "records": records, "token_counts": token_counts}


def _config(tiny_target_dir: Path, data: dict, run_dir: Path, port: int) -> Path:
    """The run config the nodes share: 2 nodes x 1 rank, torchrun, rendezvous on 127.0.0.1:port."""
    one_rank = {"num_gpus": 1, "launcher": "torchrun", "retries": 0}
    config = {
        "run_dir": str(run_dir),
        "target": {"path": str(tiny_target_dir)},
        "capture": one_rank,
        "train": one_rank,
        "distributed": {"nnodes": 2, "master_addr": "127.0.0.1", "master_port": port, "join_timeout_s": 120},
        "datasets": [{"name": "D1", "kind": "passthrough", "path": str(data["records"])}],
    }
    path = run_dir.parent / f"{run_dir.name}-{port}.yaml"
    run_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config))
    return path


def _capture_job(tiny_target_dir: Path, data: dict, run_dir: Path, shard_tokens: int = 150) -> Path:
    job = CaptureJobFile(
        target=Target(path=str(tiny_target_dir)),
        datasets=[{"name": "D1", "records_dir": str(data["records"])}],
        out_dir=str(run_dir / "hidden"),
        device="cpu",
        max_batch_tokens=128,
        shard_tokens=shard_tokens,
        launch_tokens=None,
    )
    path = run_dir / "jobs" / "capture.json"
    write_job(job, path, kept=lambda: "nothing", resume="rerun")
    return path


def _train_job(tiny_target_dir: Path, data: dict, run_dir: Path, hidden: Path) -> Path:
    paths = dict(
        target=Target(path=str(tiny_target_dir)), token_counts=str(data["token_counts"]), hidden_dir=str(hidden)
    )
    steps = dict(max_steps=4, checkpoint_every=100, eval_every=100, log_every=1)  # no checkpoint or eval on the way
    model = dict(draft_vocab_size=256, max_batch_tokens=128, eval_fraction=0.1, lr=2e-3, ttt_steps=2)
    job = TrainJobFile(out_dir=str(run_dir / "draft"), device="cpu", **paths, **steps, **model)
    path = run_dir / "jobs" / "train.json"
    write_job(job, path, kept=lambda: "nothing", resume="rerun")
    return path


# --- launching ------------------------------------------------------------------------------------


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(extra or {})}


def _start(command: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            command, env=_env(env), cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )


def _finish(process: subprocess.Popen, log: Path, *, ok: bool = True) -> str:
    try:
        code = process.wait(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        raise AssertionError(f"timed out:\n{log.read_text()[-4000:]}") from None
    text = log.read_text()
    assert (code == 0) == ok, f"exit {code}:\n{text[-6000:]}"
    return text


def _one_node(module: str, job: Path) -> str:
    """2 ranks under one torchrun launcher, as the stage task launches a one-node job."""
    command, env = rank_command(module, ["--job", str(job)], num_ranks=2, launcher="torchrun")
    log = job.with_suffix(".log")
    return _finish(_start(command, env, log), log)


def _two_nodes(
    module: str,
    stage: str,
    job: Path,
    config: Path,
    nodes: Nodes,
    *,
    node1: tuple[list[str], dict[str, str]] | None = None,
):
    """Node 0 as the stage task launches it, node 1 by `eagle3 node`; both started, neither waited for."""
    command, env = rank_command(module, ["--job", str(job)], num_ranks=1, launcher="torchrun", nodes=nodes, node_rank=0)
    assert command[command.index("--nnodes") + 1] == "2" and command[command.index("--node_rank") + 1] == "0"
    node0 = _start(command, env, job.with_suffix(".node0.log"))
    other, other_env = node1 or (
        [sys.executable, "-m", "cli.app", "node", str(config), "--node-rank", "1", "--stages", stage],
        {},
    )
    return node0, _start(other, other_env, job.with_suffix(".node1.log"))


def _nodes(config: Path) -> Nodes:
    return Nodes(**yaml.safe_load(config.read_text())["distributed"])


@pytest.fixture(scope="module")
def captures(tiny_target_dir, data) -> dict:
    """The same capture by one node (2 ranks) and by two nodes (1 rank each)."""
    root = data["root"]
    single = root / "single"
    _one_node("models.capture", _capture_job(tiny_target_dir, data, single))
    two = root / "two"
    config = _config(tiny_target_dir, data, two, free_port())
    job = _capture_job(tiny_target_dir, data, two)
    node0, node1 = _two_nodes("models.capture", "capture", job, config, _nodes(config))
    logs = (_finish(node0, job.with_suffix(".node0.log")), _finish(node1, job.with_suffix(".node1.log")))
    return {"single": single, "two": two, "logs": logs}


def _shard_tensors(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


# --- the tests --------------------------------------------------------------------------------------


def test_two_node_capture_writes_the_single_node_shards(captures):
    single, two = captures["single"] / "hidden", captures["two"] / "hidden"
    names = [p.name for p in list_shards(single)]
    assert [p.name for p in list_shards(two)] == names
    assert {n.split("-")[1] for n in names} == {"000", "001"}  # global ranks 0 and 1, one on each node
    for name in names:
        assert shard_metadata(two / name) == shard_metadata(single / name), name
        want, got = _shard_tensors(single / name), _shard_tensors(two / name)
        assert want.keys() == got.keys()
        for key in want:
            assert torch.equal(got[key], want[key]), (name, key)
    assert pq.read_table(two / "index.parquet").equals(pq.read_table(single / "index.parquet"))
    assert len(list(iter_shard_index(two))) == 24
    node0, node1 = captures["logs"]
    assert "pending over 2 rank(s)" in node0  # rank 0 (node 0) planned for the whole world
    assert "CAPTURE_PROGRESS rank=1" in node1 and "node 1: capture done" in node1
    assert "CAPTURE_PROGRESS rank=1" not in node0


def test_two_node_training_equals_one_node_with_the_same_world_size(tiny_target_dir, data, captures):
    single = captures["single"]
    _one_node("models.train", _train_job(tiny_target_dir, data, single, single / "hidden"))
    two = captures["two"]
    config = _config(tiny_target_dir, data, two, free_port())
    job = _train_job(tiny_target_dir, data, two, two / "hidden")
    node0, node1 = _two_nodes("models.train", "train", job, config, _nodes(config))
    log0 = _finish(node0, job.with_suffix(".node0.log"))
    _finish(node1, job.with_suffix(".node1.log"))
    assert "over 2 rank(s)" in log0 and "TRAIN_DONE" in log0

    def lines(run: Path) -> list[dict]:
        return [json.loads(x) for x in (run / "draft" / "metrics.jsonl").read_text().splitlines()]

    want, got = lines(single), lines(two)
    assert [(x["kind"], x["step"], x["tokens"]) for x in got] == [(x["kind"], x["step"], x["tokens"]) for x in want]
    assert [x["step"] for x in got if x["kind"] == "train"] == [1, 2, 3, 4]
    for a, b in zip(got, want):
        assert a["loss"] == pytest.approx(b["loss"], rel=0, abs=1e-6), (a, b)
        assert a["per_step_loss"] == pytest.approx(b["per_step_loss"], rel=0, abs=1e-6)
    from models.export.eagle3 import load_exported_draft

    a = load_exported_draft(two / "draft" / "final", dtype=torch.float32).state_dict()
    b = load_exported_draft(single / "draft" / "final", dtype=torch.float32).state_dict()
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


def test_a_capture_whose_node_dies_resumes_on_the_rerun(tiny_target_dir, data, captures, tmp_path, procs):
    run_dir = tmp_path / "killed"
    config = _config(tiny_target_dir, data, run_dir, free_port())
    job = _capture_job(tiny_target_dir, data, run_dir, shard_tokens=60)
    nodes = _nodes(config)
    # Node 1 runs ranks that hold after their first shard (tests/models/capture/capture_held.py): killed mid-run,
    # certainly.
    held, env = rank_command(
        "tests.models.capture.capture_held",
        ["--job", str(job)],
        num_ranks=1,
        launcher="torchrun",
        nodes=nodes,
        node_rank=1,
    )
    node0, node1 = _two_nodes("models.capture", "capture", job, config, nodes, node1=(held, env))
    hidden = run_dir / "hidden"
    deadline = time.monotonic() + TIMEOUT_S
    while (
        not [p for p in list_shards(hidden) if p.name.startswith("shard-001-")]
        and node1.poll() is None
        and time.monotonic() < deadline
    ):
        time.sleep(0.1)  # polling for node 1's first shard, bounded by the deadline
    victims = [node1.pid, *procs.descendants(node1.pid)]
    for pid in victims:  # the whole node: its launcher and its rank
        try:
            os.killpg(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    node1.wait(timeout=30)
    log0 = _finish(node0, job.with_suffix(".node0.log"), ok=False)  # node 0 learns its peer is gone and fails
    assert "CAPTURE_PROGRESS rank=0" in log0
    partial = {(r["dataset"], r["id"]) for r in iter_shard_index(hidden)}
    assert 0 < len(partial) < 24

    config = _config(tiny_target_dir, data, run_dir, free_port())  # the rerun: a fresh rendezvous
    node0, node1 = _two_nodes("models.capture", "capture", job, config, _nodes(config))
    log0 = _finish(node0, job.with_suffix(".node0.log"))
    _finish(node1, job.with_suffix(".node1.log"))
    assert f"{len(partial)} already captured, {24 - len(partial)} pending over 2 rank(s)" in log0
    rows = list(iter_shard_index(hidden))
    assert len(rows) == 24 and {(r["dataset"], r["id"]) for r in rows} == {("D1", f"r{i:02d}") for i in range(24)}
    reference = {(r["dataset"], r["id"]): r for r in iter_shard_index(captures["single"] / "hidden")}
    for r in rows:
        ref = reference[(r["dataset"], r["id"])]
        got = read_sample(hidden / r["shard"], r["offset"], r["length"])
        want = read_sample(captures["single"] / "hidden" / ref["shard"], ref["offset"], ref["length"])
        assert torch.equal(got["input_ids"], want["input_ids"]) and torch.equal(got["loss_mask"], want["loss_mask"])
        for name in ("aux_hidden", "last_hidden"):  # other batch neighbours than the reference's: float noise only
            torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-5, msg=f"{r['id']} {name}")
    assert pq.read_table(hidden / "index.parquet").num_rows == 24


def test_an_output_dir_that_is_not_shared_stops_every_node(tiny_target_dir, data, tmp_path):
    # Node 1 names another directory, as a node with RUN_DIR on its local disk would see its own.
    nodes = Nodes(nnodes=2, master_addr="127.0.0.1", master_port=free_port(), join_timeout_s=120)
    runs = []
    for node_rank, run_dir in enumerate((tmp_path / "node0", tmp_path / "node1")):
        job = _capture_job(tiny_target_dir, data, run_dir)
        command, env = rank_command(
            "models.capture", ["--job", str(job)], num_ranks=1, launcher="torchrun", nodes=nodes, node_rank=node_rank
        )
        runs.append((run_dir, _start(command, env, job.with_suffix(".log")), job.with_suffix(".log")))
    for run_dir, process, log in runs:  # each rank names the directory it was given; both fail, rank 1 named blind
        text = _finish(process, log, ok=False)
        assert f"{run_dir / 'hidden'} is not one shared directory: rank(s) 1 on " in text, text[-3000:]
    assert not list_shards(tmp_path / "node0" / "hidden") and not list_shards(tmp_path / "node1" / "hidden")
