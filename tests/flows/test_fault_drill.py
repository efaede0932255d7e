"""Fault drill: `eagle3 generate` with its run directory on a small tmpfs that fills up mid-run.

Needs root (mount); skipped elsewhere. The stop must be immediate: responses the server finished
but the run could not keep are at most one flush window plus what was in flight; every part on
disk stays readable; the message says what happened, what was kept and how to resume; and a
rerun after the disk grows ends with every prompt exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from emulators.sim import SimServer
from tasks.responses.checkpoints import live_parts
from tests.run_configs import write_run_config

pytestmark = pytest.mark.multiprocess  # every test here starts processes of its own

FLUSH_EVERY = 16
SLOTS = 8
PROMPTS = (
    600  # the disk fills after ~230 responses: the first run stops well short of them all, the rerun does the rest
)


@pytest.fixture
def small_disk(tmp_path, tmpfs):
    with tmpfs(tmp_path / "disk", "3m") as disk:
        yield disk


def eagle3(*args: str, api_url: str | None = None) -> subprocess.CompletedProcess:
    """Without `api_url`: its own temporary Prefect server, like a user's first run."""
    exe = Path(sys.executable).parent / "eagle3"
    env = {**os.environ, "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    if api_url:
        env["PREFECT_API_URL"] = api_url
    return subprocess.run([str(exe), *args], capture_output=True, text=True, timeout=600, env=env)


@pytest.mark.slow
def test_disk_full_stops_generate_at_once_and_a_rerun_after_the_disk_grows_finishes(
    small_disk, tmpfs, tmp_path, tiny_target_dir, harness_api_url
):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"q{i}", "prompt": f"question {i}: " + "word " * (i % 20)}) + "\n" for i in range(PROMPTS)
        )
    )
    run_dir = small_disk / "run"
    # Ballast: the disk keeps ~160 KB free, a few hundred responses' worth.
    (small_disk / "ballast").write_bytes(b"\0" * (3 * 2**20 - 160 * 2**10))
    with SimServer(
        max_running=SLOTS,
        decode_s_per_token=0.0002,
        mean_len=40,
        vocab_size=2048,
        eos_token_id=1,
        model_path=str(tiny_target_dir),
    ) as srv:  # serving the target, as the preflight checks
        config = write_run_config(
            tmp_path / "drill.yaml",
            run_dir,
            tiny_target_dir,
            [{"name": "B1", "kind": "generate", "path": str(prompts)}],
            server={"url": srv.url, "max_concurrency": SLOTS, "health_timeout_s": 30},
            sampling={"max_new_tokens": 64, "temperature": 0.7},
            generate={"flush_every": FLUSH_EVERY, "flush_interval_s": 600, "retries": 0},
        )
        first = eagle3("generate", str(config))
        served = srv.snapshot().completed
        parts = live_parts(run_dir / "responses/B1")
        kept = [r for p in parts for r in pq.read_table(p).to_pylist()]  # every part on disk is whole
        message = " ".join(first.stderr.split())
        assert first.returncode == 1, first.stderr[-2000:]
        # The verdict is one line of its own (Prefect's flow-run log above it may show tracebacks).
        assert any(
            line.startswith("pipeline failed: generate failed for B1: cannot write")
            for line in first.stderr.splitlines()
        )
        assert f"cannot write {run_dir}/responses/B1" in message and "disk full:" in message
        assert f"bytes free on {small_disk}" in message
        assert f"kept: {len(kept):,} responses of B1" in message and "to resume: free space" in message
        assert 0 < len(kept) < PROMPTS
        lost = served - len(kept)
        assert lost <= FLUSH_EVERY + SLOTS, (served, len(kept))  # one flush window + what was in flight
        print(f"drill: served {served}, kept {len(kept)}, lost {lost} (bound {FLUSH_EVERY + SLOTS})")

        tmpfs.remount(small_disk, "size=64m")  # the disk grows
        second = eagle3("generate", str(config), api_url=harness_api_url)  # the rerun: against a running server
        assert second.returncode == 0, second.stderr[-2000:]
    ids = [r["id"] for p in live_parts(run_dir / "responses/B1") for r in pq.read_table(p, columns=["id"]).to_pylist()]
    assert len(ids) == len(set(ids)) == PROMPTS  # every prompt exactly once
