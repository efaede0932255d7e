"""One writer per run directory: a second writer is refused at once, naming the first; kill -9 frees it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tasks.runtime.run_lock import RunDirLocked, read_holder, run_lock

REPO = Path(__file__).resolve().parents[2]
HOLDER = (
    "import sys\n"
    "from tasks.runtime.run_lock import run_lock\n"
    "with run_lock(sys.argv[1], 'generate'):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.read()\n"  # holds until its stdin closes, or it is killed
)

pytestmark = pytest.mark.multiprocess  # every test here starts processes of its own


@pytest.fixture
def holder(tmp_path):
    """Another process holding RUN_DIR's lock (the first writer)."""
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(run_dir), "--as", "first-writer"],
        cwd=REPO,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
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
    proc = subprocess.run(
        [sys.executable, "-c", HOLDER, str(run_dir)], cwd=REPO, input="", capture_output=True, text=True
    )
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


OUTPUT_HOLDER = (  # RUN_DIR argv[1], holding argv[3] (capture.out_dir) for writing (argv[2] == 'also') or reading
    "import sys\n"
    "from pathlib import Path\n"
    "from tasks.runtime.run_lock import run_lock\n"
    "pairs = [('capture.out_dir', Path(sys.argv[3]))]\n"
    "with run_lock(sys.argv[1], sys.argv[4], **{sys.argv[2]: pairs}):\n"
    "    print('held', flush=True)\n"
    "    sys.stdin.read()\n"
)


@pytest.fixture
def output_holder(tmp_path):
    """Start other processes holding a shared capture.out_dir; all are killed at the end."""
    started = []

    def start(run: str, kind: str, shared: Path, purpose: str) -> subprocess.Popen:
        proc = subprocess.Popen(
            [sys.executable, "-c", OUTPUT_HOLDER, str(tmp_path / run), kind, str(shared), purpose],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        started.append(proc)
        assert proc.stdout.readline().strip() == "held"
        return proc

    yield start
    for proc in started:
        proc.kill()
        proc.wait()


def _config(tmp_path: Path, run: str, shared: Path) -> Path:
    config = tmp_path / f"{run}.yaml"
    config.write_text(
        f"run_dir: {tmp_path / run}\ntarget: {{path: {tmp_path / 'target'}}}\ncapture: {{out_dir: {shared}}}\n"
        f"datasets: [{{name: B1, kind: generate, path: {REPO / 'data/samples/gen_code.jsonl'}}}]\n"
    )
    return config


def test_a_second_run_writing_the_same_capture_out_dir_is_refused(tmp_path, output_holder):
    # run A captures into a directory on a bigger disk; run B's config (a copy of A's) names it too
    shared = tmp_path / "big-disk" / "hidden"
    a = output_holder("run-a", "also", shared, "capture")
    eagle3 = Path(sys.executable).parent / "eagle3"
    done = subprocess.run(
        [str(eagle3), "run", str(_config(tmp_path, "run-b", shared)), "--stages", "capture"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = " ".join(done.stderr.split())
    assert done.returncode == 1, done.stderr
    assert f"refused: {shared} (capture.out_dir) is in use by another writer: pid {a.pid}" in said
    assert "writing capture" in said and "another run's config may name the same directory" in said
    assert "Traceback" not in said
    assert read_holder(tmp_path / "run-b") == {}  # B let its own run directory go again

    from flows.config.file import load_config

    b = load_config(_config(tmp_path, "run-b", shared))
    every = ["generate", "records", "capture", "train", "eval"]
    with pytest.raises(RunDirLocked) as caught:  # training from it while A writes: refused too
        with run_lock(b.run_dir, "train", also=b.written_dirs(["train"]), reads=b.read_dirs(["train"])):
            pytest.fail("a capture being written was read")
    assert caught.value.setting == "capture.out_dir" and caught.value.holder["pid"] == a.pid
    with pytest.raises(RunDirLocked):  # what `eagle3 run` (every stage) takes
        with run_lock(b.run_dir, "pipeline", also=b.written_dirs(every), reads=b.read_dirs(every)):
            pytest.fail("the shared capture.out_dir was locked twice")


def test_runs_may_train_from_one_capture_at_once_and_a_capture_waits_for_them(tmp_path, output_holder):
    from flows.config.file import load_config

    shared = tmp_path / "big-disk" / "hidden"
    b = output_holder("run-b", "reads", shared, "train")  # run B trains from the finished capture
    c = load_config(_config(tmp_path, "run-c", shared))
    assert c.written_dirs(["train"]) == [("train.out_dir", tmp_path / "run-c" / "draft")]
    assert c.read_dirs(["train"]) == [("capture.out_dir", shared)]
    with run_lock(c.run_dir, "train", also=c.written_dirs(["train"]), reads=c.read_dirs(["train"])):
        assert read_holder(c.run_dir)["purpose"] == "train"  # C trains beside B
    d = output_holder("run-d", "reads", shared, "train")  # and D, the last reader to start
    for gone in (None, b):  # a capture into it now would change what they train on, while any one reads
        if gone is not None:
            gone.kill()
            gone.wait()
        with pytest.raises(RunDirLocked) as caught:
            with run_lock(tmp_path / "run-a", "capture", also=[("capture.out_dir", shared)]):
                pytest.fail("a capture wrote what a training run reads")
        text = " ".join(str(caught.value).split())
        assert f"{shared} (capture.out_dir) is in use by another reader: pid {d.pid}" in text
        assert "reading it for train" in text and "(the last reader to start; others may read it too)" in text
    d.kill()
    d.wait()
    with run_lock(tmp_path / "run-a", "capture", also=[("capture.out_dir", shared)]):  # free once the readers are gone
        assert read_holder(shared)["purpose"] == "capture"
    assert read_holder(shared) == {}


def test_output_dirs_inside_the_run_dir_take_no_lock_of_their_own(tmp_path):
    run_dir = tmp_path / "run"
    outside = tmp_path / "elsewhere" / "draft"
    with run_lock(run_dir, "train", also=[("capture.out_dir", run_dir / "hidden"), ("train.out_dir", outside)]):
        assert not (run_dir / "hidden").exists()  # covered by RUN_DIR/.lock
        assert read_holder(outside)["purpose"] == "train"
    assert read_holder(outside) == {}  # released with the block


def test_a_directory_read_in_this_process_cannot_be_written_by_an_inner_block(tmp_path):
    shared = tmp_path / "hidden"
    with run_lock(tmp_path / "run", "pipeline", also=[("capture.out_dir", shared)]):
        with run_lock(tmp_path / "run", "train", reads=[("capture.out_dir", shared)]):  # written outside: may read
            pass
    with run_lock(tmp_path / "run", "train", reads=[("capture.out_dir", shared)]):
        with pytest.raises(RuntimeError, match="locked for reading in this process"):
            with run_lock(tmp_path / "run", "capture", also=[("capture.out_dir", shared)]):
                pytest.fail("a shared lock was taken for writing")


KILLED_FLOW = (
    "import sys\n"
    "from prefect import flow\n"
    "from tasks.runtime.run_lock import run_lock\n"
    "@flow(name='killed-writer')\n"
    "def writer(run_dir: str) -> None:\n"
    "    with run_lock(run_dir, 'generate'):\n"  # as the pipeline flow re-enters the CLI's lock
    "        print('held', flush=True)\n"
    "        sys.stdin.read()\n"
    "with run_lock(sys.argv[1], 'eagle3 generate'):\n"  # the CLI's lock, taken before the flow run starts
    "    writer(sys.argv[1])\n"
)


def test_the_flow_runs_of_a_killed_writer_are_ended_as_crashed_by_the_next_writer(tmp_path, prefect_harness):
    """A writer killed with SIGKILL reports nothing: its flow run stays Running in Prefect. The next writer to take the
    run directory finds it in `.lock` (a clean release empties the file) and sets it to Crashed, naming the process;
    Prefect's own record says so."""
    from uuid import UUID

    from prefect import flow, get_run_logger
    from prefect.client.orchestration import get_client
    from prefect.settings import get_current_settings

    from tasks.runtime.dead_runs import end_dead_runs

    run_dir = tmp_path / "run"
    env = {**os.environ, "PREFECT_API_URL": str(get_current_settings().api.url)}
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED_FLOW, str(run_dir)],
        cwd=REPO,
        env=env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline().strip() == "held"
    [killed_run] = read_holder(run_dir)["flow_run_ids"]
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(UUID(killed_run)).state.type.value == "RUNNING"  # what the UI showed

    @flow(name="next-writer")
    def next_writer() -> list[str]:
        with run_lock(run_dir, "generate"):
            return end_dead_runs(run_dir, get_run_logger())

    assert next_writer() == [killed_run]
    with get_client(sync_client=True) as client:
        state = client.read_flow_run(UUID(killed_run)).state
    assert state.type.value == "CRASHED" and f"pid {child.pid} on {socket.gethostname()}" in state.message
    assert next_writer() == []  # released cleanly this time: nothing left to end
