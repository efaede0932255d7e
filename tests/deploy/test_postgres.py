"""A team's Prefect (docs/prefect.md): the server on a real PostgreSQL, one GPU pool, one worker per box.

PostgreSQL runs from Debian's `postgresql` package (.ci/run installs it where it can), in a temporary
directory, as the `postgres` user when the tests run as root (PostgreSQL refuses to run as root). The
Prefect server migrates a fresh database owned by an unprivileged role, as a team would set it up;
two workers stand for two GPU boxes, each on a work queue of its own in the `eagle3-gpu` pool, and a
`pipeline/run` pinned to one box's queue runs generate and records against a simulated SGLang server.
The assertions read PostgreSQL itself: the flow run, its subflows, the artifacts and both workers
are rows there, and nothing went to SQLite.
"""

from __future__ import annotations

import glob
import json
import os
import pwd
import secrets
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tasks.runtime.ports import free_port
from tests.run_configs import write_run_config

RUN_ON_QUEUE = r"""
import json, sys
from prefect.deployments import run_deployment

# What `prefect deployment run` cannot do: choose the work queue, i.e. the box. timeout=0: do not wait.
run = run_deployment(sys.argv[1], parameters=json.loads(sys.argv[2]), work_queue_name=sys.argv[3], timeout=0)
print(run.id)
"""


def postgres_bindir() -> Path | None:
    """The directory of Debian's PostgreSQL server binaries (the newest version), or of `initdb` on PATH."""
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"), key=lambda p: int(Path(p).parts[-3]))
    initdb = found[-1] if found else shutil.which("initdb")
    return Path(initdb).parent if initdb else None


@dataclass
class Postgres:
    """A PostgreSQL server on 127.0.0.1: a database `prefect` owned by the role `prefect` (not a superuser)."""

    url: str  # what PREFECT_SERVER_DATABASE_CONNECTION_URL gets
    bindir: Path
    socket_dir: Path
    port: int
    as_user: list[str]

    def query(self, sql: str) -> list[list[str]]:
        """Rows of `sql` on the database `prefect`, as the superuser over the Unix socket."""
        done = subprocess.run(
            [
                *self.as_user,
                str(self.bindir / "psql"),
                "-h",
                str(self.socket_dir),
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                "prefect",
                "-v",
                "ON_ERROR_STOP=1",
                "-At",
                "-F",
                "|",
                "-c",
                sql,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return [line.split("|") for line in done.stdout.splitlines()]


@pytest.fixture(scope="module")
def postgres():
    """initdb, pg_ctl start, a role and a database for Prefect; stopped and removed after the module."""
    bindir = postgres_bindir()
    if bindir is None:
        pytest.skip(
            "PostgreSQL is not installed (no initdb under /usr/lib/postgresql/*/bin or on PATH); "
            "on Debian: apt-get install --no-install-recommends postgresql (.ci/run does this as root)"
        )
    as_user: list[str] = []
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: run it as the user Debian's package creates
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no `postgres` user to run PostgreSQL as (it refuses root)")
        if shutil.which("runuser") is None:
            pytest.skip("running as root without `runuser` to start PostgreSQL as the `postgres` user")
        as_user = ["runuser", "-u", "postgres", "--"]
    base = Path(tempfile.mkdtemp(prefix="eagle3-pg-"))  # not under pytest's root-only tmp dir: `postgres` must reach it
    if as_user:
        os.chown(base, owner.pw_uid, owner.pw_gid)

    def run(*command: str) -> None:
        done = subprocess.run([*as_user, *command], capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, f"{' '.join(command)}:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"

    data, socket_dir, port = base / "data", base / "socket", free_port()
    password = secrets.token_hex(12)
    started = False
    try:
        run(
            str(bindir / "initdb"),
            "-D",
            str(data),
            "-U",
            "postgres",
            "-E",
            "UTF8",
            "--no-sync",
            "--auth-local=trust",
            "--auth-host=scram-sha-256",
        )
        run("mkdir", str(socket_dir))
        # -w: pg_ctl itself waits until the server accepts connections. fsync off: a throwaway database.
        run(
            str(bindir / "pg_ctl"),
            "-D",
            str(data),
            "-l",
            str(base / "postgres.log"),
            "-w",
            "-t",
            "60",
            "-o",
            f"-c listen_addresses=127.0.0.1 -p {port} -k {socket_dir} -c fsync=off",
            "start",
        )
        started = True
        run(
            str(bindir / "psql"),
            "-h",
            str(socket_dir),
            "-p",
            str(port),
            "-U",
            "postgres",
            "-v",
            "ON_ERROR_STOP=1",
            "-c",
            f"CREATE ROLE prefect LOGIN PASSWORD '{password}'",
            "-c",
            "CREATE DATABASE prefect OWNER prefect",
        )
        yield Postgres(
            f"postgresql+asyncpg://prefect:{password}@127.0.0.1:{port}/prefect", bindir, socket_dir, port, as_user
        )
    finally:
        if started:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base)


@pytest.mark.e2e
def test_a_team_server_on_postgresql_runs_a_deployment_on_the_box_its_queue_names(
    postgres, launch_prefect, tmp_path, tiny_target_dir
):
    from emulators.sim import SimServer
    from tasks.responses.checkpoints import live_parts

    n = 24
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt": f"question {i}"}) + "\n" for i in range(n)))
    run_dir = tmp_path / "run"
    with (
        launch_prefect(tmp_path / "prefect", PREFECT_SERVER_DATABASE_CONNECTION_URL=postgres.url) as server,
        SimServer(
            max_running=8,
            decode_s_per_token=0.001,
            mean_len=20,
            vocab_size=2048,
            eos_token_id=1,
            model_path=str(tiny_target_dir),
        ) as sim,
    ):
        # docs/prefect.md, 'Setting it up': the pool's limit is the number of boxes, a queue per box, one worker
        # per box polling only its queue and running one flow run at a time
        boxes = ("box-a", "box-b")
        server.create_pools_and_deploy(
            ["work-pool", "set-concurrency-limit", "eagle3-gpu", str(len(boxes))],
            *[["work-queue", "create", box, "--pool", "eagle3-gpu"] for box in boxes],
        )
        workers = {
            box: server.worker(
                "eagle3-gpu", tmp_path / f"worker-{box}.log", "--name", box, "--work-queue", box, "--limit", "1"
            )
            for box in boxes
        }
        try:
            config = write_run_config(
                tmp_path / "team.yaml",
                run_dir,
                tiny_target_dir,
                [{"name": "B1", "kind": "generate", "path": str(prompts)}],
                server={"url": sim.url, "max_concurrency": 8},
                sampling={"max_new_tokens": 32, "temperature": 0.8},
            )
            params = {"config_path": str(config), "stages": "generate,records"}
            flow_run_id = server.python(RUN_ON_QUEUE, "pipeline/run", json.dumps(params), "box-b").split()[-1]
            state = server.wait_final(flow_run_id, timeout_s=300)
        finally:
            server.stop(*workers.values())
        logs = {box: (tmp_path / f"worker-{box}.log").read_text() for box in workers}
        assert state == "COMPLETED", f"flow run {state}:\n{logs['box-b'][-6000:]}"

    # The state is in PostgreSQL, read there, not through Prefect; the server's SQLite file was never made.
    assert not list((tmp_path / "prefect").rglob("*.db")), list((tmp_path / "prefect").rglob("*"))
    assert postgres.query(f"SELECT state_type, work_queue_name FROM flow_run WHERE id = '{flow_run_id}'") == [
        ["COMPLETED", "box-b"]
    ]
    subflows = postgres.query(
        "SELECT name, state_type FROM flow_run WHERE parent_task_run_id IS NOT NULL ORDER BY name"
    )
    assert subflows == [[f"generate {config}", "COMPLETED"], [f"records {config}", "COMPLETED"]]
    keys = {row[0] for row in postgres.query("SELECT DISTINCT key FROM artifact WHERE key IS NOT NULL")}
    assert {"generate-b1", "generate-summary-team", "records-report-team", "records-vocab-team"} <= keys, keys
    assert postgres.query(
        "SELECT w.name FROM worker w JOIN work_pool p ON p.id = w.work_pool_id "
        "WHERE p.name = 'eagle3-gpu' ORDER BY w.name"
    ) == [["box-a"], ["box-b"]]
    assert postgres.query("SELECT extname FROM pg_extension WHERE extname = 'pg_trgm'") == [["pg_trgm"]]

    # The box whose queue the run named ran it; the other never saw it.
    assert flow_run_id in logs["box-b"] and flow_run_id not in logs["box-a"]
    responses = [
        r
        for p in live_parts(run_dir / "responses/B1")
        for r in pq.read_table(p, columns=["id", "finish_reason"]).to_pylist()
    ]
    assert sorted(r["id"] for r in responses) == sorted(f"q{i}" for i in range(n))  # every prompt exactly once
    records = [
        r["id"]
        for p in (run_dir / "records/B1").glob("part-*.parquet")
        for r in pq.read_table(p, columns=["id"]).to_pylist()
    ]
    assert sorted(records) == sorted(
        r["id"] for r in responses if r["finish_reason"] == "stop"
    )  # cut-off replies left out
