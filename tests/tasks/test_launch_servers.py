"""The server lifecycle of the generate stage: started for it, stopped after, also on failure."""

from __future__ import annotations

import contextlib

import httpx
import pytest

from tasks.runtime.ports import free_port, free_ports
from tasks.serving.launch import launched_servers


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


@pytest.mark.multiprocess
def test_the_dev_server_on_kimi_s_remote_tokenizer_starts_with_trust_and_says_why_without(kimi_target_dir, tmp_path):
    """The kimi checkpoint's tokenizer is its own code: the dev server the pipeline launches loads it with
    target.trust_remote_code (SGLang's --trust-remote-code), and without it exits at start naming the setting."""
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(RuntimeError) as caught:
        with launched_servers("dev", url, target=kimi_target_dir, log_dir=tmp_path / "untrusted", health_timeout_s=300):
            pytest.fail("the dev server loaded a remote tokenizer without trust_remote_code")
    said = " ".join(str(caught.value).split())
    assert "before becoming healthy" in said and "set target.trust_remote_code: true" in said
    launch = launched_servers(
        "dev", url, target=kimi_target_dir, log_dir=tmp_path / "trusted", health_timeout_s=300, trust_remote_code=True
    )
    with launch as servers:
        [server] = servers
        assert "--trust-remote-code" in server.command
        info = httpx.get(url + "/server_info", timeout=10).json()
        assert info["model_path"] == str(kimi_target_dir)


# A stand-in server: answers 200 to every GET, prints its replica, port and GPUs first.
STANDIN = (
    "import http.server, os, sys\n"
    "print('replica', sys.argv[1], 'port', sys.argv[2], 'gpus', os.environ.get('CUDA_VISIBLE_DEVICES'), flush=True)\n"
    "class H(http.server.BaseHTTPRequestHandler):\n"
    "    def do_GET(self):\n"
    "        self.send_response(200); self.end_headers()\n"
    "    def log_message(self, *a):\n"
    "        pass\n"
    "http.server.HTTPServer(('127.0.0.1', int(sys.argv[2])), H).serve_forever()\n"
)


@pytest.mark.multiprocess
def test_command_replicas_each_get_their_port_and_gpus_and_all_are_stopped(tmp_path):
    import sys

    base = free_ports(2)
    command = [sys.executable, "-c", STANDIN, "{replica}", "{port}"]
    with launched_servers(
        "command",
        f"http://127.0.0.1:{base}",
        replicas=2,
        gpus_per_replica=4,
        command=command,
        log_dir=tmp_path,
        health_timeout_s=60,
    ) as servers:
        urls = [s.url for s in servers]
        assert urls == [f"http://127.0.0.1:{base}", f"http://127.0.0.1:{base + 1}"]
        assert [_up(u) for u in urls] == [True, True]
    assert [_up(u) for u in urls] == [False, False]  # both stopped
    logs = [(tmp_path / f"server-{i}.log").read_text().splitlines()[:2] for i in (0, 1)]  # the launch's header first
    assert [header.startswith("===== ") and f"{i} {base + i}" in header for i, (header, _) in enumerate(logs)] == [
        True,
        True,
    ]
    said = [line for _, line in logs]
    assert said == [f"replica 0 port {base} gpus 0,1,2,3", f"replica 1 port {base + 1} gpus 4,5,6,7"]


@pytest.mark.multiprocess
def test_a_replica_that_dies_at_start_stops_the_others(tmp_path):
    import sys

    base = free_ports(2)
    # replica 1 exits at once, replica 0 comes up: the launch fails and replica 0 is stopped too
    command = [
        sys.executable,
        "-c",
        "import sys\nif sys.argv[1] == '1': sys.exit(1)\n" + STANDIN,
        "{replica}",
        "{port}",
    ]
    with pytest.raises(RuntimeError, match="server exited with code 1 before becoming healthy"):
        with launched_servers(
            "command", f"http://127.0.0.1:{base}", replicas=2, command=command, log_dir=tmp_path, health_timeout_s=60
        ):
            pytest.fail("a dead replica was taken as healthy")
    assert not _up(f"http://127.0.0.1:{base}")


@pytest.mark.multiprocess
def test_a_second_launch_keeps_the_first_s_log_and_reports_only_its_own(tmp_path):
    """Two engines launched into one log directory (the dev server, then vLLM): both outputs stay, each after a
    header naming its command, and the second's failure quotes its own output, not the first's."""
    import sys

    from tasks.serving.launch import SERVER_LOG

    url = f"http://127.0.0.1:{free_port()}"
    errors = []
    for words, engine, code in (("dev server says hello", "sglang", 3), ("vllm says hello", "vllm", 4)):
        command = [sys.executable, "-c", f"import sys; print({words!r}, flush=True); sys.exit({code})"]
        with pytest.raises(RuntimeError) as caught:
            with launched_servers("command", url, command=command, log_dir=tmp_path, engine=engine):
                pytest.fail("a dead server was taken as healthy")
        errors.append(str(caught.value))
    log = (tmp_path / SERVER_LOG).read_text()
    headers = [line for line in log.splitlines() if line.startswith("===== ")]
    assert [("(sglang API" in h, "(vllm API" in h) for h in headers] == [(True, False), (False, True)]
    assert log.index(headers[0]) < log.index("dev server says hello") < log.index(headers[1])
    assert log.index(headers[1]) < log.index("vllm says hello")
    assert "dev server says hello" in errors[0] and "code 3" in errors[0]
    assert "vllm says hello" in errors[1] and "dev server says hello" not in errors[1]
