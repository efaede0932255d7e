"""End to end through a real Prefect server: pools, `prefect deploy --all`, a process worker, the pipeline deployment.

Everything runs as the user would (tests/deploy/conftest.py): `prefect server start` on loopback with
a temporary PREFECT_HOME, `prefect work-pool create`, `prefect deploy --all` from the repository's
prefect.yaml, `prefect worker start`, `prefect deployment run 'pipeline/demo'` with a small config,
then the Prefect client (in a subprocess pointed at that server) reads the flow run's state, its
subflow runs and its artifacts.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from tasks.runtime.ports import free_port
from tests.run_configs import TEST_TTT_STEPS, write_run_config

REPO = Path(__file__).resolve().parents[2]

CLIENT_CHECK = r"""
import asyncio, json, sys
from prefect.client.orchestration import get_client

async def main(flow_run_id):
    async with get_client() as client:
        run = await client.read_flow_run(flow_run_id)
        deployment = await client.read_deployment(run.deployment_id)
        children = await client.read_flow_runs()
        keys = sorted({a.key for a in await client.read_artifacts() if a.key})
        names = sorted(r.name for r in children)
        print(json.dumps({"state": run.state.type.value, "name": run.name, "deployment": deployment.name,
                          "pool": deployment.work_pool_name, "keys": keys, "runs": names,
                          "states": sorted({r.state.type.value for r in children})}))

asyncio.run(main(sys.argv[1]))
"""


def _config(tmp_path: Path, tiny_target_dir: Path) -> Path:
    """A small run: two datasets, one CPU rank per job, a short training."""
    samples = REPO / "data" / "samples"
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": str(tiny_target_dir)},
        "server": {
            "url": f"http://127.0.0.1:{free_port()}",
            "launch": "dev",
            "max_concurrency": 8,
            "request_timeout_s": 120,
        },
        "sampling": {"max_new_tokens": 48, "temperature": 0.8},
        "capture": {"num_gpus": 1, "max_batch_tokens": 2048, "shard_tokens": 4096},
        "train": {
            "num_gpus": 1,
            "draft_vocab_size": 1024,
            "max_batch_tokens": 1024,
            "epochs": 2,
            "ttt_steps": TEST_TTT_STEPS,
            "lr": 0.002,
            "checkpoint_every": 10,
            "eval_every": 10,
            "eval_fraction": 0.2,
            "log_every": 1,
        },
        "eval": {
            "prompts": 3,
            "max_new_tokens": 16,
            "num_steps": 3,
            "backend": "engine",
        },  # the dev server with the draft
        "datasets": [
            {
                "name": "A1_chat",
                "kind": "passthrough",
                "path": str(samples / "passthrough_chat.jsonl"),
                "max_prompts": 16,
            },
            {
                "name": "B2_math",
                "kind": "generate",
                "path": str(samples / "gen_math.jsonl"),
                "token_budget": 300,
                "max_prompts": 20,
            },
        ],
    }
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory, launch_prefect):
    """`prefect server start` on loopback (SQLite), the two pools, and every deployment of prefect.yaml."""
    with launch_prefect(tmp_path_factory.mktemp("prefect")) as server:
        server.create_pools_and_deploy()
        yield server


@pytest.mark.e2e
def test_pipeline_deployment_runs_on_a_real_prefect_server(prefect_server, tmp_path, tiny_target_dir):
    server = prefect_server
    config = _config(tmp_path, tiny_target_dir)
    worker = server.worker("eagle3-cpu", tmp_path / "worker.log")
    try:
        flow_run_id = server.run_deployment(
            "pipeline/demo", f"config_path={config}", "stages=generate,records,capture,train,eval"
        )
        state = server.wait_final(flow_run_id)
        assert state == "COMPLETED", f"flow run {state}:\n{(tmp_path / 'worker.log').read_text()[-6000:]}"
        seen = json.loads(server.python(CLIENT_CHECK, flow_run_id).splitlines()[-1])
    finally:
        server.stop(worker)

    assert seen["state"] == "COMPLETED" and seen["deployment"] == "demo" and seen["pool"] == "eagle3-cpu"
    assert seen["name"] == "pipeline e2e [generate,records,capture,train,eval]"
    assert seen["states"] == ["COMPLETED"]
    for stage in ("generate", "records", "capture", "train", "eval"):
        assert any(name.startswith(f"{stage} ") for name in seen["runs"]), seen["runs"]
    for key in (
        "generate-summary-e2e",
        "generate-b2-math",
        "records-report-e2e",
        "capture-e2e",
        "capture-summary-e2e",
        "train-e2e",
        "train-eval-e2e",
        "train-report-e2e",
        "eval-engine-e2e",
        "eval-summary-e2e",
        "eval-engine-summary-e2e",
    ):
        assert key in seen["keys"], seen["keys"]
    report = json.loads((tmp_path / "run" / "draft" / "eval.json").read_text())
    assert report["backends"] == ["engine"] and "trained" not in report  # no in-process decoding
    assert report["engine"]["overall"]["verify_rounds"] > 0 and report["engine"]["overall"]["prompts"] == 3
    assert (tmp_path / "run" / "logs" / "eval-with-draft" / "server.log").is_file()
    assert (tmp_path / "run" / "draft" / "final" / "model.safetensors").is_file()


MARK_CRASHED = r"""
import asyncio, sys
from prefect.client.orchestration import get_client
from prefect.states import Crashed

async def main(flow_run_id):
    async with get_client() as client:  # what the UI's Change state -> Crashed does
        await client.set_flow_run_state(flow_run_id, Crashed(message="worker killed"), force=True)

asyncio.run(main(sys.argv[1]))
"""


@pytest.mark.e2e
def test_a_killed_worker_leaves_nothing_a_rerun_does_not_finish_exactly_once(prefect_server, tmp_path, tiny_target_dir):
    from emulators.sim import SimServer
    from tasks.responses.checkpoints import live_parts
    from tasks.runtime.run_lock import read_holder

    server = prefect_server
    prompts = tmp_path / "prompts.jsonl"
    n = 120
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))
    run_dir = tmp_path / "run"
    with SimServer(
        max_running=4,
        decode_s_per_token=0.01,
        mean_len=30,
        vocab_size=2048,
        eos_token_id=1,
        model_path=str(tiny_target_dir),
    ) as sim:
        config = write_run_config(
            tmp_path / "killed.yaml",
            run_dir,
            tiny_target_dir,
            [{"name": "B1", "kind": "generate", "path": str(prompts)}],
            server={"url": sim.url, "max_concurrency": 4},
            sampling={"max_new_tokens": 48, "temperature": 0.8},
            generate={"flush_every": 4, "retries": 0},
        )
        worker = server.worker("eagle3-cpu", tmp_path / "worker1.log")
        first = server.run_deployment("generate/generate", f"config_path={config}")
        deadline = time.monotonic() + 300
        while len(live_parts(run_dir / "responses/B1")) < 3:  # mid-run: some parts written, most prompts to go
            assert time.monotonic() < deadline, (tmp_path / "worker1.log").read_text()[-4000:]
            time.sleep(0.2)  # polling the run directory, the only signal a killed process leaves
        holder = read_holder(run_dir)["pid"]  # the flow-run process that writes the run dir
        os.killpg(worker.pid, signal.SIGKILL)  # the worker, as the OOM killer or a reboot would
        try:
            os.kill(holder, signal.SIGKILL)  # and its flow process, should it be in a session of its own
        except ProcessLookupError:
            pass
        worker.wait()
        assert server.flow_run_state(first) == "RUNNING"
        kept = len(
            {
                r["id"]
                for p in live_parts(run_dir / "responses/B1")
                for r in pq.read_table(p, columns=["id"]).to_pylist()
            }
        )
        assert 0 < kept < n

        # docs/operate-and-recover.md, 'A dead worker or a killed run': mark the stuck run Crashed, start a worker,
        # run the deployment again
        server.python(MARK_CRASHED, first)
        worker = server.worker("eagle3-cpu", tmp_path / "worker2.log")
        try:
            second = server.run_deployment("generate/generate", f"config_path={config}")
            state = server.wait_final(second)
            assert state == "COMPLETED", f"rerun {state}:\n{(tmp_path / 'worker2.log').read_text()[-6000:]}"
        finally:
            server.stop(worker)
    ids = [r["id"] for p in live_parts(run_dir / "responses/B1") for r in pq.read_table(p, columns=["id"]).to_pylist()]
    assert len(ids) == len(set(ids)) == n  # every prompt exactly once across the kill
