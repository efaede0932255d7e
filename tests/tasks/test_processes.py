"""The server lifecycle of the generate stage: started for it, stopped after, also on failure."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tasks.ports import free_port
from tasks.processes import launched_servers


def _up(url: str) -> bool:
    try:
        return httpx.get(url + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def test_launch_none_starts_nothing():
    assert isinstance(launched_servers("none", "http://127.0.0.1:1"), contextlib.nullcontext)


@pytest.mark.multiprocess
def test_dev_server_runs_inside_and_is_stopped_after_a_failure(tiny_target_dir, tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError, match="generation broke"):
        with launched_servers("dev", url, target=tiny_target_dir, log_dir=tmp_path, health_timeout_s=120) as servers:
            [server] = servers
            assert _up(url) and server.url == url
            raise RuntimeError("generation broke")
    assert server.process.poll() is not None and not _up(url)

    # Something already answering at the URL would silently be used instead: refused.
    with launched_servers("dev", url, target=tiny_target_dir, log_dir=tmp_path, health_timeout_s=120):
        with pytest.raises(RuntimeError, match="already answers"):
            launched_servers("command", url, command=["true"])
    assert not _up(url)


def test_command_launch_needs_a_command():
    with pytest.raises(ValueError, match="needs a command"):
        launched_servers("command", f"http://127.0.0.1:{free_port()}")


@pytest.mark.multiprocess
def test_a_server_that_dies_at_start_is_reported_at_once_with_its_log(tmp_path):
    import sys
    import time

    url = f"http://127.0.0.1:{free_port()}"
    crash = [sys.executable, "-c", "import sys; print('CUDA out of memory while loading', flush=True); sys.exit(3)"]
    started = time.monotonic()
    with pytest.raises(RuntimeError) as caught:
        with launched_servers("command", url, command=crash, log_dir=tmp_path, health_timeout_s=600):
            pytest.fail("a dead server was taken as healthy")
    assert time.monotonic() - started < 60  # not the 600 s health timeout
    assert "server exited with code 3 before becoming healthy" in str(caught.value)
    assert "CUDA out of memory while loading" in str(caught.value)
