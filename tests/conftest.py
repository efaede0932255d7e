"""Session-wide fixtures shared by every test directory."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.targets import built, shared_root

# Tests never touch the network: the hub client reads these once, at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# vLLM's CPU build binds its worker's one OpenMP thread to core 0 of this 2-core box and keeps core 1 for its
# scheduler (VLLM_CPU_OMP_THREADS_BIND=auto: vllm/utils/ompmultiprocessing.py, 0.32.0), so the two test workers'
# servers took turns on core 0 while core 1 could be free. Unbound, with the one thread it had bound (unbound, torch
# would take one per core and spin-wait on them), each goes where the kernel finds room. Every process the tests
# start inherits both; DeepSpeed's ranks and SGLang get one thread anyway (tasks/runtime/launch_ranks.py,
# tasks/serving/sglang.py).
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
os.environ.setdefault("OMP_NUM_THREADS", "1")


# The order test files start in under `pytest -n 2 --dist loadscope --no-loadscope-reorder` (make test): the longest
# first, so that the two workers end together. The real-vLLM file alone takes about 12 minutes on one worker (its
# servers are module fixtures); started last, it was the suite's tail. Then the other heavy kinds, then the rest.
FIRST = ("vllm", "sglang", "slow", "e2e", "multiprocess")
# Before them all: the longest file (the Kimi demo and its servers, about 12 minutes of one worker in CI, its CPU
# busy), and the files that mostly wait (on Prefect workers' polls, servers' starts), for the other worker to run
# beside it. Started by marker, those waiting files ran side by side, and the two cores idled for minutes (a CI run:
# 344 CPU-s idle, most of it then).
LEAD = (
    "tests/tasks/serving/test_vllm_kimi.py",
    "tests/deploy/test_deployments.py",
    "tests/deploy/test_postgres.py",
    "tests/deploy/test_local_up.py",
)


def start_rank(item: pytest.Item) -> int:
    """Where `item`'s file starts: the first of FIRST that marks the item, else after them all."""
    return next((i for i, name in enumerate(FIRST) if item.get_closest_marker(name)), len(FIRST))


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank: dict[str, int] = {}
    for item in items:
        file = item.nodeid.split("::")[0]
        rank[file] = min(rank.get(file, len(FIRST)), start_rank(item))
    for i, file in enumerate(LEAD):
        if file in rank:
            rank[file] = -len(LEAD) + i
    items.sort(key=lambda item: rank[item.nodeid.split("::")[0]])  # stable: each file's own order is kept


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tests' models are tiny: one intra-op thread is faster than two spin-waiting on a busy 2-core box."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def one_torch_thread_in_module():
    """One intra-op thread for a module of tiny tensors even where an earlier module left more (one thread avoids
    OpenMP barrier spinning on a busy 2-core box), and the count it found put back after the module."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny target (tokenizer + trained Llama weights), the demo's, built once per test session.

    Its training takes most of a minute, so the xdist workers share one build: the first to ask
    builds it under a lock in the session's common temp dir (or $EAGLE3_TEST_TARGETS: tests/targets.py),
    the others wait and reuse it.
    """
    return built(shared_root(tmp_path_factory.getbasetemp()), "tiny")


@pytest.fixture(scope="session")
def kimi_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The Kimi-K2.5-shaped tiny target (models/target/tiny_kimi.py, trained: about 3 minutes), built once per test
    session and shared by the xdist workers like tiny_target_dir."""
    return built(shared_root(tmp_path_factory.getbasetemp()), "kimi")


@pytest.fixture(scope="session")
def prefect_harness(tmp_path_factory):
    """One Prefect test server per worker for every test that asks (starting one takes ~10 s; the flow tests all do:
    tests/flows/conftest.py)."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ["PREFECT_HOME"] = str(home)
    os.environ["PREFECT_RESULTS_LOCAL_STORAGE_PATH"] = str(home / "results")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture(scope="session")
def harness_api_url(prefect_harness) -> str:
    """The session's test server, for `eagle3` subprocesses that need not start a temporary one (~15 s on 2 cores)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    assert url and url.startswith("http://127.0.0.1:"), url
    return url


@pytest.fixture(scope="module")
def tokenizer(tiny_target_dir):
    """The tiny target's tokenizer, loaded once per test module."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir)


class Tmpfs:
    """Tiny real filesystems for full-disk tests: `with tmpfs(directory, size) as d:`, `tmpfs.remount(d, "size=4m")`."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    @contextmanager
    def __call__(self, directory: Path, size: int | str) -> Iterator[Path]:
        """A tmpfs of `size` (bytes, or "160k"/"3m") at `directory`; skips the test where mounting is not allowed."""
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
        self.mounted.append(directory)
        try:
            yield directory
        finally:
            self.unmount(directory)

    @staticmethod
    def remount(directory: Path, options: str) -> None:
        """E.g. "size=64m" (the disk grows) or "ro" (it turns read-only)."""
        subprocess.run(["mount", "-o", f"remount,{options}", str(directory)], check=True)

    def unmount(self, directory: Path) -> None:
        if directory in self.mounted:
            self.mounted.remove(directory)
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@pytest.fixture
def tmpfs() -> Iterator[Tmpfs]:
    """Mounts tmpfs filesystems (root only) and unmounts whatever a failing test left mounted."""
    disks = Tmpfs()
    yield disks
    for directory in list(disks.mounted):
        disks.unmount(directory)


class ProcessTree:
    """The process tree as /proc shows it (for kill tests: every rank a launch started must die with it)."""

    @staticmethod
    def descendants(pid: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
        out, todo = [], [pid]
        while todo:
            for child in children.get(todo.pop(), []):
                out.append(child)
                todo.append(child)
        return out

    @staticmethod
    def alive(pid: int) -> bool:
        """Running (a zombie waiting for its parent counts as dead)."""
        try:
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return False

    def kill(self, process: subprocess.Popen, timeout: float = 30) -> list[int]:
        """SIGKILL the process group of `process` and of each of its descendants (torchrun starts every rank in a
        session of its own), reap `process`, and wait (bounded by `timeout`) for the descendants to die: returns the
        descendants still alive."""
        victims = [process.pid, *self.descendants(process.pid)]
        for pid in victims:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        process.wait(timeout=timeout)
        deadline = time.monotonic() + timeout
        while any(self.alive(p) for p in victims[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)  # bounded poll: /proc has no event to wait on
        return [p for p in victims[1:] if self.alive(p)]


@pytest.fixture
def procs() -> ProcessTree:
    return ProcessTree()


@contextmanager
def _served(app) -> Iterator[str]:
    """Base URL of an ASGI `app` served by uvicorn in a thread, on a loopback port the OS picks."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))  # uvicorn serves on this very socket
    srv = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=srv.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not srv.started:  # bounded poll: uvicorn has no startup event to wait on
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        srv.should_exit = True
        thread.join(timeout=30)
        sock.close()


@pytest.fixture(scope="session")
def serve_app():
    """`with serve_app(app) as url:` an in-process server for the dev server's app (tests of deploy/)."""
    return _served
