"""SIGTERM and SIGINT to `eagle3 generate`, `run` and `eval`, at several moments of a run (tasks/runtime/stopping.py).

Each command is started as a user starts it (the console script, stdout a pipe, in a session of its own), watched
until a gate -- a line it prints, a process it starts -- says the moment has come, then signalled. Every test asserts
that the command is gone within 10 s; that no process it started is left, whether found in its process tree while it
ran or, later, by a mark in the environment it handed down (an orphan has no parent to be found by); that the port of
Prefect's temporary server no longer answers and no second one was started (three of the generate moments start one;
the other commands use the session's server); and no `--- Logging error ---`. Where
the run had written checkpoints, a rerun finishes the work with every prompt answered exactly once.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from tasks.responses.checkpoints import live_parts
from tasks.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = Path(sys.executable).parent / "eagle3"
MARK = "EAGLE3_TEST_STOP_MARK"  # in the environment of every process a command starts, and of theirs
STOP_WITHIN_S = 10.0
GATE_S = 240.0  # how long a moment may take to come on a busy 2-core machine
PROMPTS = 20  # the first of data/samples/gen_math.jsonl's 50: a stop after the first part leaves 16 for the rerun

pytestmark = pytest.mark.multiprocess


def alive(pid: int) -> bool:
    """Running (a zombie waiting for its parent counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def children_of() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(stat.parent.name))
    return children


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return ""


def marked(mark: str) -> dict[int, str]:
    """Live processes whose environment holds MARK=mark: pid -> command line."""
    needle = f"{MARK}={mark}".encode()
    found = {}
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if needle in environ.read_bytes().split(b"\0"):
                pid = int(environ.parent.name)
                if alive(pid):
                    found[pid] = cmdline(pid)
        except (OSError, ValueError):
            continue
    return found


class Command:
    """`eagle3 ARGS`, its output read line by line as it comes, the processes it starts noted as they appear."""

    def __init__(self, args: list[str], *, api_url: str | None = None):
        self.mark = uuid.uuid4().hex
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_API_URL")}
        env.pop("PYTHONUNBUFFERED", None)  # the output comes line by line through a pipe of its own accord (item 9)
        env.update({"COLUMNS": "220", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", MARK: self.mark})
        if api_url:
            env["PREFECT_API_URL"] = api_url
        self.lines: list[str] = []
        self.seen: dict[int, str] = {}  # every descendant seen while it ran: pid -> command line
        self._changed = threading.Condition()
        self.process = subprocess.Popen(
            [str(EAGLE3), *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        threading.Thread(target=self._read, daemon=True).start()
        threading.Thread(target=self._watch, daemon=True).start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()

    def _watch(self) -> None:
        while self.process.poll() is None:
            tree = children_of()
            todo, found = [self.process.pid], []
            while todo:
                for child in tree.get(todo.pop(), []):
                    found.append(child)
                    todo.append(child)
            with self._changed:
                for pid in found:
                    # read again while it lives: a child seen between its fork and its exec still shows its parent's
                    # command line (a CI run missed the temporary Prefect server so, and waited for the command's end)
                    line = cmdline(pid)
                    if line or pid not in self.seen:
                        self.seen[pid] = line
                self._changed.notify_all()
            time.sleep(0.05)  # /proc has no event to wait on

    @property
    def output(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def wait_until(self, what: str, ready: Callable[[], object], timeout_s: float = GATE_S) -> object:
        """`ready()`'s first truthy value, checked whenever a line or a process appears; the test fails with the output
        when the command ends first or `timeout_s` passes."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while True:
                value = ready()
                if value:
                    return value
                if self.process.poll() is not None or time.monotonic() > deadline:
                    pytest.fail(f"never came: {what} (exit {self.process.poll()})\n{self.output[-6000:]}")
                self._changed.wait(timeout=0.2)

    def wait_line(self, pattern: str) -> re.Match:
        regex = re.compile(pattern)
        return self.wait_until(  # type: ignore[return-value]
            f"a line matching {pattern!r}", lambda: next((m for m in map(regex.search, self.lines) if m), None)
        )

    def wait_process(self, needle: str, *, but_not: str = "\0") -> int:
        """The pid of the first process this command started whose command line holds `needle` (and not `but_not`)."""

        def found() -> int | None:
            return next(
                (p for p, c in self.seen.items() if needle in c and but_not not in c and alive(p)),
                None,
            )

        return self.wait_until(f"a process running {needle!r}", found)  # type: ignore[return-value]

    def stop(self, sig: int = signal.SIGTERM, *, again_after_s: float | None = None) -> float:
        """Send `sig` (and again after `again_after_s`); the seconds until the command exited."""
        self._watch_once()
        started = time.monotonic()
        self.process.send_signal(sig)
        if again_after_s is not None:
            time.sleep(again_after_s)  # the second signal of a user who presses Ctrl-C twice
            if self.process.poll() is None:
                self.process.send_signal(sig)
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 60 s after {signal.Signals(sig).name}\n{self.output[-6000:]}")
        return time.monotonic() - started

    def _watch_once(self) -> None:
        """Note the tree as it is at the signal (the watcher thread looks every 50 ms)."""
        with self._changed:
            self._changed.wait(timeout=0.2)

    def left(self, grace_s: float = 2.0) -> dict[int, str]:
        """What the command started that still runs, `grace_s` after it exited (a SIGKILLed process takes a moment
        to go): seen in its tree, or found by the mark."""
        deadline = time.monotonic() + grace_s
        while True:
            left = {p: c for p, c in self.seen.items() if alive(p)} | marked(self.mark)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.1)  # bounded: processes being torn down


def assert_stopped(command: Command, seconds: float, sig: int = signal.SIGTERM) -> None:
    """Gone within STOP_WITHIN_S with 128+signal, said why, nothing left, no second Prefect server, no log spam."""
    out = command.output
    print(f"{' '.join(command.process.args[1:2])}: exited {seconds:.2f} s after {signal.Signals(sig).name}")  # type: ignore[index]
    assert seconds < STOP_WITHIN_S, f"exited {seconds:.1f} s after the signal\n{out[-6000:]}"
    assert command.process.returncode == 128 + sig, out[-6000:]
    assert f"stopped by {signal.Signals(sig).name}" in out, out[-6000:]
    assert not command.left(), f"left running: {command.left()}\n{out[-4000:]}"
    assert "Logging error" not in out, out[-6000:]
    assert "Starting temporary server" not in out, out[-6000:]  # Prefect's own, of which a second outlived the run
    servers = re.findall(r"Prefect: temporary server at http://127\.0\.0\.1:(\d+)/api", out)
    assert len(servers) <= 1, out[-6000:]
    for port in servers:
        with socket.socket() as sock:
            assert sock.connect_ex(("127.0.0.1", int(port))) != 0, f"Prefect's server on {port} still listens"


def response_ids(run_dir: Path, dataset: str = "B1") -> list[str]:
    ids: list[str] = []
    for part in live_parts(run_dir / "responses" / dataset):
        ids += pq.read_table(part, columns=["id"]).column("id").to_pylist()
    return ids


def write_config(tmp_path: Path, target: Path, run_dir: Path | None = None, **dataset: object) -> Path:
    """A dev-server run of gen_math's prompts (`dataset`'s max_prompts, else PROMPTS), checkpointed every 4 responses;
    capture and eval on 1 CPU rank."""
    config = {
        "run_dir": str(run_dir or tmp_path / "run"),
        "target": {"path": str(target)},
        "server": {"url": f"http://127.0.0.1:{free_port()}", "launch": "dev", "max_concurrency": 4},
        "sampling": {"max_new_tokens": 48, "temperature": 0.8},
        "generate": {"flush_every": 4, "flush_interval_s": 1, "log_interval_s": 1},
        "capture": {"num_gpus": 1, "max_batch_tokens": 2048, "shard_tokens": 4096},
        "eval": {
            "backend": "both",
            "prompts": 3,
            "prompt_files": [str(REPO / "data" / "eval" / "prompts.jsonl")],
            "max_new_tokens": 16,
            "baseline": False,
            "compare_untrained": False,
        },
        "datasets": [
            {
                "name": "B1",
                "kind": "generate",
                "path": str(REPO / "data" / "samples" / "gen_math.jsonl"),
                "max_prompts": PROMPTS,
                **dataset,
            }
        ],
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def rerun(args: list[str], api_url: str) -> str:
    """The same command again, to its end (against the session's Prefect server: no temporary one to wait for)."""
    command = Command(args, api_url=api_url)
    assert command.process.wait(timeout=600) == 0, command.output[-6000:]
    assert not command.left(), command.left()
    return command.output


def mid_generate(command: Command, run_dir: Path) -> None:
    """Some responses checkpointed, more to come."""
    command.wait_until("a checkpoint part", lambda: list(live_parts(run_dir / "responses" / "B1")))


# (moment, signal, second signal after s, Prefect: the command's temporary server or the session's)
GENERATE_MOMENTS = {
    "prefect-server-start": (signal.SIGTERM, None, "temporary"),
    "dev-server-start": (signal.SIGTERM, None, "session"),
    "mid-generate": (signal.SIGTERM, None, "temporary"),
    "mid-generate-twice": (signal.SIGTERM, 0.3, "temporary"),
    "mid-generate-sigint": (signal.SIGINT, None, "session"),
}


@pytest.mark.parametrize("moment", list(GENERATE_MOMENTS))
def test_generate_stops_within_10s_leaving_nothing_and_resumes_exactly_once(
    moment, tmp_path, tiny_target_dir, harness_api_url
):
    sig, again, prefect = GENERATE_MOMENTS[moment]
    config = write_config(tmp_path, tiny_target_dir)
    run_dir = tmp_path / "run"
    args = ["generate", str(config), "--skip-checks"]
    command = Command(args, api_url=None if prefect == "temporary" else harness_api_url)
    if moment == "prefect-server-start":
        command.wait_process("prefect.server.api.server:create_app")
        assert "Prefect: temporary server" not in command.output  # still starting
    elif moment == "dev-server-start":
        command.wait_process("emulators.dev_server")
        assert not list(live_parts(run_dir / "responses" / "B1"))
    else:
        mid_generate(command, run_dir)
    assert_stopped(command, command.stop(sig, again_after_s=again), sig)

    done = response_ids(run_dir)
    assert len(done) == len(set(done)) < PROMPTS, f"{len(done)} responses at the stop, {len(set(done))} distinct"
    if done:  # checkpoints to resume from: a rerun sends only what they lack
        out = rerun(args, harness_api_url)
        assert f"{len(set(done))} already done" in out
        ids = response_ids(run_dir)
        assert len(ids) == len(set(ids)) == PROMPTS, f"{len(ids)} responses, {len(set(ids))} distinct"


@pytest.fixture(scope="module")
def records_run(tmp_path_factory, tiny_target_dir, harness_api_url) -> Path:
    """A run directory with 12 responses and their records (capture, train and eval read them), made once."""
    tmp = tmp_path_factory.mktemp("records-run")
    config = write_config(tmp, tiny_target_dir, max_prompts=12)
    rerun(["run", str(config), "--stages", "generate,records", "--skip-checks"], harness_api_url)
    return tmp / "run"


def copy_run(records_run: Path, tmp_path: Path, tiny_target_dir: Path) -> Path:
    shutil.copytree(records_run, tmp_path / "run")
    return write_config(tmp_path, tiny_target_dir, max_prompts=12)


def test_run_stops_during_a_capture_rank_job_leaving_no_rank(tmp_path, records_run, tiny_target_dir, harness_api_url):
    """torchrun starts each rank in a session of its own: killing the launcher's group alone left the rank running."""
    config = copy_run(records_run, tmp_path, tiny_target_dir)
    args = ["run", str(config), "--stages", "generate,records,capture", "--skip-checks"]
    command = Command(args, api_url=harness_api_url)  # a temporary Prefect server's stop: the generate moments'
    rank = command.wait_process("models.capture", but_not="torch.distributed.run")
    assert os.getsid(rank) != os.getsid(command.process.pid)  # the case this test is for
    assert_stopped(command, command.stop())

    rerun(args, harness_api_url)
    records = [
        i
        for part in sorted((tmp_path / "run" / "records" / "B1").glob("part-*.parquet"))
        for i in pq.read_table(part, columns=["id"]).column("id").to_pylist()
    ]
    captured = pq.read_table(tmp_path / "run" / "hidden" / "index.parquet", columns=["id"]).column("id").to_pylist()
    assert len(captured) == len(set(captured)) and set(captured) == set(records), (len(captured), len(records))
    ids = response_ids(tmp_path / "run")
    assert len(ids) == len(set(ids)) == 12


@pytest.fixture(scope="module")
def random_draft(tmp_path_factory, tiny_target_dir) -> Path:
    from tests.drafts import export_random_draft, load_target

    out = tmp_path_factory.mktemp("draft")
    export_random_draft(load_target(tiny_target_dir), out, draft_vocab_size=1024)
    return out


@pytest.mark.parametrize("moment", ["rank-job", "engine-decode"])
def test_eval_stops_within_10s_leaving_nothing(
    moment, tmp_path, records_run, tiny_target_dir, random_draft, harness_api_url
):
    config = copy_run(records_run, tmp_path, tiny_target_dir)
    if moment == "rank-job":  # a rank job that decodes for seconds: one of 1-2 s was once over before it was seen
        data = yaml.safe_load(config.read_text())
        data["eval"]["max_new_tokens"] = 256
        config.write_text(yaml.safe_dump(data, sort_keys=False))
    args = ["eval", str(config), "--draft", str(random_draft), "--skip-checks"]
    command = Command(args, api_url=harness_api_url)  # a temporary Prefect server's stop: the generate moments'
    if moment == "rank-job":
        command.wait_process("models.eval", but_not="torch.distributed.run")
    else:  # the dev server with the draft answers: the eval decodes through it
        url = yaml.safe_load(config.read_text())["server"]["url"]
        command.wait_line(r"engine eval: starting the dev server .* with the draft")

        def answers() -> bool:
            try:
                return httpx.get(f"{url}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        command.wait_until(f"{url}/health answering", answers)
    assert_stopped(command, command.stop())
    if moment == "engine-decode":  # nothing of it stands in the way of the next eval (a server on its port, a lock)
        rerun(args, harness_api_url)
        assert list((tmp_path / "run" / "evals").glob("*/eval.json"))


def test_output_reaches_a_pipe_line_by_line(tmp_path):
    """`print` in a command shows in a piped log when it is printed, not when the command ends (Python buffers whole
    blocks of a pipe unless told otherwise)."""
    gate = tmp_path / "go"
    script = (
        "import sys, time, pathlib\n"
        "from cli.app import Eagle3\n"
        "app = Eagle3()\n"
        "@app.command()\n"
        "def hello() -> None:\n"
        "    print('hello before the wait')\n"
        f"    while not pathlib.Path({str(gate)!r}).exists():\n"
        "        time.sleep(0.05)\n"
        "app()\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}
    process = subprocess.Popen(
        [sys.executable, "-c", script], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        got: list[str] = []
        reader = threading.Thread(target=lambda: got.append(process.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout=60)
        assert got == ["hello before the wait\n"], "the line waited in a buffer"
    finally:
        gate.touch()
        process.wait(timeout=60)
