"""The rank harness: exit status, the one-line error report, tracebacks only where the message is not enough."""

from __future__ import annotations

import errno
import json

import pytest

from models.common.file_errors import WriteFailed
from models.common.rank_protocol import CAPTURE
from models.ranks import harness as rank
from models.ranks.harness import Dist, serve


@pytest.fixture
def one_process(monkeypatch):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)


def _serve(run, argv=("--job", "job.json"), **kw) -> int:
    return serve(list(argv), "models.test", "test", CAPTURE, run, **kw)


def _reports(err: str) -> list[dict]:
    return [json.loads(line.split(" ", 1)[1]) for line in err.splitlines() if line.startswith(CAPTURE.error.mark + " ")]


def test_a_finished_rank_exits_0_with_its_job_and_place(one_process, capsys):
    seen = []
    assert _serve(lambda job, dist: seen.append((job, dist)), argv=("--job", "j.json", "--local_rank=0")) == 0
    assert seen == [("j.json", Dist())]
    assert capsys.readouterr().err == ""


def test_a_failed_write_is_one_report_and_one_line_without_traceback(one_process, capsys, tmp_path):
    def run(job, dist):
        raise WriteFailed(tmp_path / "shard", OSError(errno.ENOSPC, "No space left on device"), kept="every shard")

    assert _serve(run) == 1
    err = capsys.readouterr().err
    (report,) = _reports(err)
    assert (report["kind"], report["rank"], report["errno"]) == ("write_failed", 0, errno.ENOSPC)
    assert f"capture rank 0 failed: {report['message']}" in err and "Traceback" not in err


def test_an_unexpected_error_also_gets_its_traceback(one_process, capsys):
    def run(job, dist):
        raise RuntimeError("a bug")

    assert _serve(run) == 1
    err = capsys.readouterr().err
    assert _reports(err)[0]["kind"] == "error"
    assert "capture rank 0 failed: RuntimeError('a bug')" in err and "Traceback" in err


def test_what_every_rank_raises_alike_is_reported_by_rank_0_only(monkeypatch, capsys):
    monkeypatch.setattr(rank, "watch_launcher", lambda name: None)  # no launcher here to watch
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("LOCAL_RANK", "1")

    def run(job, dist):
        raise LookupError("the same on every rank")

    for r, reported in (("1", []), ("0", ["LookupError"])):
        monkeypatch.setenv("RANK", r)
        assert _serve(run, told=(LookupError,), once=(LookupError,)) == 1
        err = capsys.readouterr().err
        assert [x["type"] for x in _reports(err)] == reported and "Traceback" not in err


def test_a_clean_system_exit_is_success(one_process):
    def run(job, dist):
        raise SystemExit(0)

    assert _serve(run) == 0


def test_every_rank_says_its_peak_memory_as_it_exits(one_process, capsys):
    from models.common.rank_protocol import RANK_MEMORY

    for run in (lambda job, dist: None, lambda job, dist: 1 / 0):
        _serve(run)
        (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith(RANK_MEMORY.mark)]
        values = RANK_MEMORY.parse(line)
        assert values["rank"] == 0 and values["host_peak_rss"] > 10**6  # a Python process with torch: > 1 MB
        assert "gpu_peak_allocated" not in values  # no CUDA used here
