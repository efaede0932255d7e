"""The `capture` flow's failure handling under a real (test) Prefect server, with the rank launch faked.

What the ranks themselves do on a full disk or a damaged file is tested with real launches in
tests/models/capture/test_job.py; here the launch is replaced so that the flow's side is quick to check:
a killed rank is retried (resuming, with the token cap less what is on disk), a failed write is not,
and the flow fails with the rank's one-line message.
"""

from __future__ import annotations

import errno
import json
from datetime import datetime, timezone
from pathlib import Path

import pytest
import torch
import yaml
from prefect.states import Failed

from flows.capture import capture
from models.capture.job import ERROR_MARK
from models.capture.shards import ShardWriter
from models.common.file_errors import DamagedShard, WriteFailed
from models.common.jobs import RecordsJob
from models.common.rank_protocol import error_report
from tasks.capture import tasks as capture_tasks
from tasks.capture.plan import DiskTooSmall
from tasks.capture.tasks import CaptureRefused, capture_retryable, rank_error
from tasks.records.build import build_records
from tasks.responses.checkpoints import responses_table, write_part
from tasks.runtime.launch_ranks import RankFailure
from tests.generate_runs import response_row

REPO = Path(__file__).resolve().parents[2]


def write_run(tmp_path: Path, target: Path, **capture_settings) -> Path:
    """A config with one dataset whose records (10 records of 40 tokens) are already built."""
    run = tmp_path / "run"
    rows = [response_row(f"r{i}", [5] * 30, [6] * 9 + [1]) for i in range(10)]
    write_part(run / "responses/B1", responses_table(rows))
    build_records(
        "B1", "generate", run / "responses/B1", run / "records/B1", run / "rejects/B1", RecordsJob(vocab_size=2048)
    )
    config = {
        "run_dir": str(run),
        "target": {"path": str(target)},
        "server": {"url": "http://127.0.0.1:30000"},
        "capture": {"num_gpus": 2, "launcher": "torchrun", **capture_settings},
        "datasets": [{"name": "B1", "kind": "generate", "path": str(REPO / "data/samples/gen_math.jsonl")}],
    }
    path = tmp_path / "capture-flow.yaml"  # its own artifact keys: the session shares one Prefect server
    path.write_text(yaml.safe_dump(config))
    return path


class FakeLaunch:
    """Stands in for `run_job`: each call plays the next scripted attempt and records the job it was given."""

    def __init__(self, attempts):
        self.attempts = list(attempts)
        self.jobs: list[dict] = []

    def __call__(self, command, *, env=None, on_line, tail_lines=40):
        job = json.loads(Path(command[command.index("--job") + 1]).read_text())
        self.jobs.append(job)
        self.attempts.pop(0)(job, on_line)


def capture_some(job: dict, n: int) -> None:
    """What a rank does before it dies: write a shard of the first `n` records (40 tokens each)."""
    with ShardWriter(job["out_dir"], rank=0, shard_tokens=1, aux_layers=job["aux_layers"]) as w:
        for i in range(n):
            w.add(
                f"r{i}",
                "B1",
                torch.zeros(40, dtype=torch.int32),
                torch.ones(40, dtype=torch.uint8),
                torch.zeros(40, 3 * 128),
                torch.zeros(40, 128),
            )


def killed(job, on_line):
    capture_some(job, 3)
    on_line("W torch.distributed.elastic: Sending process 123 closing signal SIGTERM")
    raise RankFailure(
        "job exited with code 1: python -m torch.distributed.run ...\n--- last output ---\nexitcode: -9 (SIGKILL)"
    )


def disk_full(job, on_line):
    error = WriteFailed(
        Path(job["out_dir"]) / "shard-001-000004.safetensors",
        OSError(errno.ENOSPC, "No space left on device"),
        kept="every complete shard",
        resume="make room there",
    )
    on_line(f"{ERROR_MARK} {json.dumps(error_report(error, 1))}")
    on_line("Traceback (most recent call last):")
    raise RankFailure("job exited with code 1: ...")


def test_a_killed_rank_is_retried_and_resumes_under_the_token_cap(tmp_path, tiny_target_dir, monkeypatch):
    config = write_run(tmp_path, tiny_target_dir, retries=1, retry_delay_s=0, max_tokens=300)
    launch = FakeLaunch([killed, lambda job, on_line: None])
    monkeypatch.setattr(capture_tasks, "run_job", launch)
    summary = capture(str(config))
    assert [job["launch_tokens"] for job in launch.jobs] == [300, 300 - 3 * 40]  # the retry resumed
    assert summary["samples"] == 3


def test_a_failed_write_is_not_retried_and_fails_with_the_ranks_line(tmp_path, tiny_target_dir, monkeypatch):
    config = write_run(tmp_path, tiny_target_dir, retries=2, retry_delay_s=0)
    launch = FakeLaunch([disk_full, killed, killed])
    monkeypatch.setattr(capture_tasks, "run_job", launch)
    with pytest.raises(WriteFailed) as failed:
        capture(str(config))
    assert len(launch.jobs) == 1
    hidden = tmp_path / "run/hidden"
    assert str(failed.value).startswith(f"cannot write {hidden / 'shard-001-000004.safetensors'}: disk full: ")
    assert str(failed.value).endswith(". kept: every complete shard. to resume: make room there")


def test_retry_condition_retries_only_what_a_retry_can_fix(tmp_path):
    def retried(error: Exception) -> bool:
        return capture_retryable(None, None, Failed(data=error))

    assert retried(RankFailure("job exited with code -9"))  # a killed or crashed rank
    assert not retried(WriteFailed(tmp_path / "x", OSError(errno.ENOSPC, "full")))
    assert not retried(DamagedShard(tmp_path / "shard-000-000000.safetensors", "truncated"))
    assert not retried(CaptureRefused("capture rank 0: shards captured with other settings"))
    assert not retried(DiskTooSmall("the capture needs 1 TiB"))
    assert not retried(ValueError("anything else"))


def test_rank_error_prefers_the_cause_over_its_peers_lost_connections(tmp_path):
    peer = error_report(RuntimeError("Connection closed by peer"), 0)
    cause = error_report(DamagedShard(tmp_path / "s.safetensors", "7 bytes, not a complete safetensors file"), 1)
    error = rank_error([peer, cause])
    assert isinstance(error, DamagedShard) and str(error) == str(
        DamagedShard(tmp_path / "s.safetensors", "7 bytes, not a complete safetensors file")
    )
    assert rank_error([peer]) is None  # an unexpected error: the launcher's RankFailure (with the output tail) stands
    refused = rank_error([error_report(ValueError("hidden holds shards captured with other settings"), 0)])
    assert (
        isinstance(refused, CaptureRefused)
        and str(refused) == "capture rank 0: hidden holds shards captured with other settings"
    )


@pytest.mark.multiprocess
def test_the_vllm_backend_runs_the_flow_plan_and_artifact_like_the_deepspeed_one(tmp_path, tiny_target_dir):
    """capture.backend: vllm with the dev server's emulation launched by the flow.

    Same summary, index, metadata, artifact.
    """
    import asyncio

    from rich.console import Console

    from cli.plan import print_plan
    from flows.config.file import load_config
    from models.capture.shards import done_sample_keys
    from tasks.runtime.ports import free_port
    from tests.flows.test_generate_flow import artifacts_by_key

    since = datetime.now(timezone.utc)

    engine = {"launch": "dev", "url": f"http://127.0.0.1:{free_port()}", "max_concurrency": 3, "health_timeout_s": 120}
    config = write_run(tmp_path, tiny_target_dir, backend="vllm", engine=engine, shard_tokens=100)
    config = config.rename(
        config.with_name("capture-vllm.yaml")
    )  # artifact keys of its own: the session shares one server
    console = Console(record=True, width=200)
    assert print_plan(load_config(config), console)
    printed = console.export_text()
    assert "capture: 400 tokens to go (0 done)" in printed and "the connector's files take up to" in printed

    summary = capture(str(config))
    run = tmp_path / "run"
    assert summary["samples"] == 10 and summary["tokens"] == 400 and summary["tokens_per_s"] > 0
    assert summary["aux_layers"] == [1, 3, 4] and summary["dtype"] == "float32" and summary["hidden_size"] == 128
    assert json.loads((run / "hidden/metadata.json").read_text())["samples"] == 10
    assert len(done_sample_keys(run / "hidden")) == 10
    assert not list((run / "engine").iterdir()), "connector files left behind"
    assert "POST /v1/completions" in (run / "logs/capture-server.log").read_text()
    artifact = asyncio.run(artifacts_by_key(since))["capture-capture-vllm"]
    assert artifact.type == "progress" and artifact.data == 100.0
    console = Console(record=True, width=200)
    assert print_plan(load_config(config), console)
    assert "capture: 0 tokens to go (400 done)" in console.export_text()
    # Nothing left: no server is started (its port stays free), the index and metadata are written again.
    assert capture(str(config))["samples"] == 10
