"""One writer per run directory: a second writer is refused at once, naming the first; kill -9 frees it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.run_lock import RunDirLocked, read_holder, run_lock

REPO = Path(__file__).resolve().parents[2]
HOLDER = (
    "import sys\n"
    "from tasks.run_lock import run_lock\n"
    "with run_lock(sys.argv[1], 'generate'):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.read()\n"  # holds until its stdin closes, or it is killed
)

pytestmark = pytest.mark.multiprocess  # every test here starts processes of its own


@pytest.fixture
def holder(tmp_path):
    """Another process holding RUN_DIR's lock (the first writer)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(run_dir), "--as", "first-writer"], cwd=REPO,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "held"
    yield run_dir, proc
    if proc.poll() is None:
        proc.kill()
    proc.wait()


def test_a_second_writer_is_refused_naming_the_holder(holder):
    run_dir, proc = holder
    with pytest.raises(RunDirLocked) as caught:
        with run_lock(run_dir, "records"):
            pytest.fail("the lock was granted twice")
    text = str(caught.value)
    assert f"{run_dir} is in use by another writer: pid {proc.pid} on {socket.gethostname()}" in text
    assert "`-c " in text and "first-writer`" in text and "writing generate" in text and "since 20" in text
    assert "Wait for that one to finish, or stop it" in text
    assert read_holder(run_dir)["pid"] == proc.pid


def test_kill_9_of_the_holder_frees_the_lock_at_once(holder):
    run_dir, proc = holder
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    with run_lock(run_dir, "generate"):  # nothing stale to clean up
        assert read_holder(run_dir)["pid"] == os.getpid()
    assert read_holder(run_dir) == {}  # released: no holder shown


def test_the_lock_is_reentrant_in_one_process_and_released_at_the_end(tmp_path):
    run_dir = tmp_path / "run"
    with run_lock(run_dir, "pipeline"):
        with run_lock(run_dir, "generate"):  # a stage flow inside the pipeline flow
            assert read_holder(run_dir)["purpose"] == "pipeline"
        assert read_holder(run_dir)["pid"] == os.getpid()  # still held by the outer block
    proc = subprocess.run([sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, input="", capture_output=True, text=True)
    assert proc.returncode == 0 and proc.stdout.strip() == "held"  # another process can take it now


def test_eagle3_generate_is_refused_while_another_writer_holds_the_run_dir(holder, tmp_path):
    run_dir, proc = holder
    config = tmp_path / "cfg.yaml"
    config.write_text(
        f"run_dir: {run_dir}\ntarget: {{path: {tmp_path / 'target'}}}\n"
        f"datasets: [{{name: B1, kind: generate, path: {REPO / 'data/samples/gen_code.jsonl'}}}]\n"
    )
    eagle3 = Path(sys.executable).parent / "eagle3"
    done = subprocess.run([str(eagle3), "generate", str(config)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"refused: {run_dir} is in use by another writer: pid {proc.pid}" in " ".join(done.stderr.split())
    assert "Traceback" not in done.stderr
    assert not (run_dir / "responses").exists()  # nothing was written
