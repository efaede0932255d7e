"""For the end-to-end tests against a real Prefect server: start one, drive its CLI and workers, poll its API.

Everything runs as the user would: `prefect server start` on loopback with a temporary PREFECT_HOME,
`prefect work-pool create`, `prefect deploy --all` from the repository's prefect.yaml, `prefect worker
start`, `prefect deployment run`. The database is the server's default SQLite unless the caller passes
`PREFECT_SERVER_DATABASE_CONNECTION_URL` (tests/deploy/test_postgres.py).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from tasks.runtime.ports import free_port

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")
RUN_TIMEOUT_S = 900
POOLS = ("eagle3-cpu", "eagle3-gpu")  # as deploy/local-up.sh creates them
DEPLOYMENTS = ("pipeline/demo", "pipeline/run", "generate/generate", "capture/capture", "train/train", "eval/eval")
FINAL = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")


def stop(*processes: subprocess.Popen) -> None:
    """SIGTERM to the process groups started by `PrefectServer.start` (all at once), SIGKILL after 30 s."""
    for process in processes:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            process.wait()


class PrefectServer:
    """A running `prefect server start`, and the environment that points the CLI, workers and clients at it."""

    def __init__(self, env: dict[str, str], log: Path):
        self.env = env
        self.log = log
        self.api_url = env["PREFECT_API_URL"]

    def start(self, command: list[str], log: Path) -> subprocess.Popen:
        """A process in the repository, in a session of its own (stop it with `stop`), output to `log`."""
        with open(log, "wb") as out:
            return subprocess.Popen(
                command, env=self.env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    @staticmethod
    def stop(*processes: subprocess.Popen) -> None:
        """End processes started by `start`, and their groups."""
        stop(*processes)

    def worker(self, pool: str, log: Path, *options: str) -> subprocess.Popen:
        """`prefect worker start --pool POOL --type process [options]`."""
        return self.start([PREFECT, "worker", "start", "--pool", pool, "--type", "process", *options], log)

    def cli(self, *args: str, timeout: float = 300) -> str:
        """`prefect ARGS`; its stdout, or the test fails with its output."""
        return self.clis(list(args), timeout=timeout)[0]

    def clis(self, *commands: list[str], timeout: float = 300) -> list[str]:
        """Several `prefect` commands at once (each imports Prefect for seconds); their stdouts, or the test fails."""
        running = [
            subprocess.Popen(
                [PREFECT, *args], env=self.env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for args in commands
        ]
        outputs = []
        for args, proc in zip(commands, running):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, (
                f"prefect {' '.join(args)} failed ({proc.returncode}):\n{out[-3000:]}\n{err[-3000:]}"
            )
            outputs.append(out)
        return outputs

    def python(self, script: str, *args: str, timeout: float = 120) -> str:
        """A Python script in a subprocess pointed at this server (the Prefect client); what it printed."""
        proc = subprocess.run(
            [sys.executable, "-c", script, *args],
            env=self.env,
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        return proc.stdout

    def create_pools_and_deploy(self, *alongside: list[str]) -> None:
        """The work pools and every deployment of prefect.yaml, as deploy/local-up.sh makes them.

        `alongside`: more `prefect` commands that need the pools, run at the same time as `prefect deploy`.
        """
        self.clis(*[["work-pool", "create", pool, "--type", "process"] for pool in POOLS])
        deployed = self.clis(["--no-prompt", "deploy", "--all"], *alongside)[0]
        for name in DEPLOYMENTS:
            assert name in deployed, deployed[-3000:]

    def run_deployment(self, name: str, *params: str) -> str:
        """`prefect deployment run NAME --param ...`; the flow run's id."""
        started = self.cli("deployment", "run", name, *[arg for p in params for arg in ("--param", p)])
        found = re.search(r"UUID:\s*([0-9a-f-]{36})", started)
        assert found, started
        return found.group(1)

    def flow_run_state(self, flow_run_id: str) -> str:
        return httpx.get(f"{self.api_url}/flow_runs/{flow_run_id}", timeout=30).json()["state"]["type"]

    def wait_final(self, flow_run_id: str, timeout_s: float = RUN_TIMEOUT_S) -> str:
        """The flow run's state type once it is final, or its last state when `timeout_s` passes."""
        state = ""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.flow_run_state(flow_run_id)
            if state in FINAL:
                break
            time.sleep(1)  # polling the API for a state change
        return state


@contextmanager
def prefect_server(home: Path, **settings: str) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port with PREFECT_HOME under `home`, plus `settings`; stopped after."""
    home.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(
        PREFECT_HOME=str(home / "prefect-home"),
        PREFECT_API_URL=f"http://127.0.0.1:{port}/api",
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        EAGLE3_HOME=str(REPO),
        PREFECT_WORKER_QUERY_SECONDS="2",
        PREFECT_WORKER_PREFETCH_SECONDS="2",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        PYTHONPATH=str(REPO),
        **settings,
    )
    server = PrefectServer(env, home / "server.log")
    process = server.start([PREFECT, "server", "start", "--host", "127.0.0.1", "--port", str(port)], server.log)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{server.api_url}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert process.poll() is None, server.log.read_text()[-3000:]
            time.sleep(0.25)  # polling a server that has no other readiness signal
        else:
            pytest.fail("prefect server did not come up:\n" + server.log.read_text()[-3000:])
        yield server
    finally:
        stop(process)


@pytest.fixture(scope="session")
def launch_prefect():
    """`with launch_prefect(home, **settings) as server:` a real Prefect server (see `prefect_server`)."""
    return prefect_server
