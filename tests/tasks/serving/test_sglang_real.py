"""Generate through a REAL SGLang 0.5.23 (.venv-sglang, `make sglang`; tests/sglang_real.py says what is real).

One server for the module, on the tiny target, with `--max-running-requests 4` while the pipeline keeps 10 requests
in flight, so requests queue at the server and the budget is reached while some wait there (SGLang answers those
"Abort in waiting queue"). Every test asserts on data the real server produced:
- `eagle3 generate` with a budgeted and an unbudgeted dataset, killed with SIGKILL mid-run and resumed, then the
  SGLang server itself killed with SIGKILL mid-run and restarted on the same port: every prompt at most once,
  the unbudgeted dataset exactly once, no reject, the budget within 2 x max_new_tokens, and every recorded output
  equal to SGLang's own greedy output for the same prompt ids (asked over plain HTTP, not through our client);
- the real sglang-router in front of two real SGLang servers, one killed with SIGKILL mid-run: every prompt
  exactly once, each output SGLang's own greedy one;
- the Kimi-shaped target (MLA, MoE, YaRN) through the Kimi demo's SGLang command: `eagle3 generate`'s greedy answers
  equal to transformers'.

Without .venv-sglang every test here skips, saying so.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import yaml

from tasks.datasets import load_dataset
from tasks.responses.checkpoints import live_parts
from tasks.runtime.ports import free_port
from tasks.serving.launch import ServerProcess, router_process
from tests.sglang_real import sglang_python, start_sglang
from tests.tasks.serving.test_vllm_real import eagle3, rows_of, wait_for  # the CLI as a user runs it; parts

pytestmark = [pytest.mark.sglang, pytest.mark.multiprocess, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[3]
CONTEXT = 2048
MAX_NEW = 32
MAX_RUNNING = 4  # the server decodes 4 at once ...
IN_FLIGHT = 10  # ... while the pipeline keeps 10 in flight: 6 wait in the server's queue


class Served:
    """The module's real SGLang on a fixed port, which a test may kill (SIGKILL, the whole process group) and
    start again there."""

    def __init__(self, target: Path, logs: Path):
        self.target, self.logs, self.port = target, logs, free_port()
        self.starts = 0
        self.server = self.start()

    @property
    def url(self) -> str:
        return self.server.url

    def start(self) -> ServerProcess:
        self.starts += 1
        return start_sglang(
            self.target,
            self.logs / f"sglang-{self.starts}.log",
            context_length=CONTEXT,
            max_running=MAX_RUNNING,
            port=self.port,
        )

    def kill(self) -> None:
        process = self.server.process
        assert process is not None and process.poll() is None
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()

    def restart(self) -> None:
        self.server = self.start()


@pytest.fixture(scope="module")
def module_served(tiny_target_dir, tmp_path_factory):
    sglang_python()
    served = Served(tiny_target_dir, tmp_path_factory.mktemp("sglang"))
    yield served
    served.server.stop()


@pytest.fixture
def served(module_served):
    """The module's server, started again if a test before left it dead (a failed restart must not fail the rest)."""
    process = module_served.server.process
    if process is None or process.poll() is not None:
        module_served.restart()
    return module_served


@pytest.fixture(scope="module")
def eos(tiny_target_dir) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_target_dir).convert_tokens_to_ids("<|im_end|>")


def greedy(url: str, prompts: list[list[int]], eos: int) -> list[dict]:
    """SGLang's own greedy answers for `prompts`, asked in one batch /generate over plain HTTP (not our client)."""
    body = {
        "input_ids": prompts,
        "sampling_params": {"max_new_tokens": MAX_NEW, "temperature": 0, "stop_token_ids": [eos]},
    }
    r = httpx.post(url + "/generate", json=body, timeout=900)
    assert r.status_code == 200, r.text
    return r.json()


def kill(process: subprocess.Popen) -> None:
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()


def subset(tmp_path: Path, name: str, n: int) -> Path:
    """The first n prompts of a sample dataset (the real server on 2 busy cores makes ~15 tokens/s)."""
    lines = (REPO / "data/samples" / name).read_text().splitlines()[:n]
    path = tmp_path / name
    path.write_text("\n".join(lines) + "\n")
    return path


def generate_config(tmp_path: Path, url: str, target: Path, datasets: list[dict]) -> tuple[Path, Path]:
    """A greedy generate config against the running server at `url`: its path and RUN_DIR."""
    run_dir = tmp_path / "run"
    config = {
        "run_dir": str(run_dir),
        "target": {"path": str(target)},
        "server": {"engine": "sglang", "url": url, "launch": "none", "max_concurrency": IN_FLIGHT},
        "sampling": {"max_new_tokens": MAX_NEW, "temperature": 0.0},
        "generate": {"flush_every": 4, "flush_interval_s": 1, "log_interval_s": 2},
        "datasets": datasets,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path, run_dir


def rejects_of(run_dir: Path, dataset: str) -> list[dict]:
    return [r for p in live_parts(run_dir / "rejects" / dataset) for r in pq.read_table(p).to_pylist()]


def assert_sglangs_own(url: str, rows: list[dict], eos: int) -> None:
    """Each row's output is the server's greedy answer to the row's prompt ids, token for token."""
    own = greedy(url, [r["prompt_ids"] for r in rows], eos)
    for r, o in zip(rows, own):
        assert r["output_ids"] == o["output_ids"], r["id"]
        assert r["finish_reason"] == o["meta_info"]["finish_reason"]["type"], r["id"]
        assert r["completion_tokens"] == len(r["output_ids"]) == o["meta_info"]["completion_tokens"], r["id"]
        # the server sent no text (--skip-tokenizer-init): the loop decoded the ids, the end-of-turn token kept
        assert "text" not in o and r["text"], r["id"]
        assert r["text"].endswith("<|im_end|>") == (r["finish_reason"] == "stop"), r["id"]


def test_generate_killed_then_the_server_killed_is_exactly_once_and_sglangs_own_greedy(
    served, tiny_target_dir, eos, tmp_path, harness_api_url
):
    budget = 100  # below what the 14 greedy answers of B1_code add up to: the budget stops it
    starts = served.starts
    files = {"B1_code": subset(tmp_path, "gen_code.jsonl", 14), "B2_math": subset(tmp_path, "gen_math.jsonl", 18)}
    datasets = [
        {"name": "B1_code", "kind": "generate", "path": str(files["B1_code"]), "token_budget": budget},
        {"name": "B2_math", "kind": "generate", "path": str(files["B2_math"])},
    ]
    path, run_dir = generate_config(tmp_path, served.url, tiny_target_dir, datasets)
    count = lambda: sum(len(rows_of(run_dir, d)) for d in files)  # noqa: E731

    first = eagle3("generate", str(path), api_url=harness_api_url, wait=False)  # 1. generate killed mid-run
    try:
        wait_for(lambda: first.poll() is not None or count() > 0, "the first checkpoint part", 300)
        assert first.poll() is None, "generate ended before it could be killed"
    finally:
        kill(first)
    killed_at = count()

    # 2. resumed; the server killed under it and restarted
    second = eagle3("generate", str(path), api_url=harness_api_url, wait=False)
    try:
        wait_for(lambda: second.poll() is not None or count() >= killed_at + 4, "the resumed run's first parts", 300)
        assert second.poll() is None, "the resumed generate ended before the server could be killed"
        served.kill()
        served_again_at = time.monotonic()
        served.restart()
        outage_s = time.monotonic() - served_again_at
        assert second.wait(timeout=1200) == 0
    finally:
        kill(second)

    assert served.starts == starts + 1 and outage_s > 5  # the server was down while generate ran
    for name, file in files.items():
        rows = rows_of(run_dir, name)
        prompts = {r.id for r in load_dataset(file, "generate").rows}
        ids = [r["id"] for r in rows]
        assert len(ids) == len(set(ids)) and set(ids) <= prompts, name  # at most once, across both kills
        assert rejects_of(run_dir, name) == [], name  # nothing given up: the outage was waited out
        spent = sum(r["completion_tokens"] for r in rows)
        if name == "B1_code":
            assert len(rows) < len(prompts) and budget <= spent <= budget + 2 * MAX_NEW
        else:  # no budget: every prompt exactly once after the resume and the restart
            assert killed_at < len(prompts) and set(ids) == prompts
        assert_sglangs_own(served.url, rows, eos)


def test_the_real_router_over_two_real_servers_one_killed_answers_every_prompt_once(
    served, tiny_target_dir, eos, tmp_path, harness_api_url
):
    """The sglang-router (the pipeline's router_process: round robin) over the module's server and a second one; the
    second is killed with SIGKILL once answers come back. The router has no /abort_request, and a request on the
    dead worker fails: the pipeline retries it, the router sends it to the live one."""
    second = start_sglang(tiny_target_dir, tmp_path / "second.log", context_length=CONTEXT, max_running=MAX_RUNNING)
    router_url = f"http://127.0.0.1:{free_port()}"
    router = router_process(router_url, [served.url, second.url], [], log_path=tmp_path / "router.log")
    router.start()
    try:
        router.wait_healthy(timeout_s=120)
        file = subset(tmp_path, "gen_math.jsonl", 20)
        path, run_dir = generate_config(
            tmp_path, router_url, tiny_target_dir, [{"name": "B2_math", "kind": "generate", "path": str(file)}]
        )
        run = eagle3("generate", str(path), api_url=harness_api_url, wait=False)
        try:
            wait_for(lambda: run.poll() is not None or len(rows_of(run_dir, "B2_math")) > 0, "the first part", 300)
            assert run.poll() is None, "generate ended before a worker could be killed"
            process = second.process
            assert process is not None
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            assert run.wait(timeout=1200) == 0
        finally:
            kill(run)
    finally:
        router.stop()
        second.stop()

    rows = rows_of(run_dir, "B2_math")
    ids = sorted(r["id"] for r in rows)
    assert ids == sorted(r.id for r in load_dataset(file, "generate").rows)  # every prompt exactly once
    assert rejects_of(run_dir, "B2_math") == []
    assert_sglangs_own(served.url, rows, eos)
    # the router used the second server before it died (uvicorn logs each answered /generate)
    assert '"POST /generate HTTP/1.1" 200' in (tmp_path / "second.log").read_text()


def test_the_kimi_demo_s_sglang_generates_transformers_greedy_tokens(kimi_target_dir, tmp_path, harness_api_url):
    """`eagle3 generate` on a few of the demo's prompts, greedy, with the server section `eagle3 demo --target kimi
    --engine sglang` writes (the pipeline starts that SGLang and stops it; `--trust-remote-code`: SGLang builds the
    kimi_k25 checkpoint's processor from its remote code, and the pipeline reads the prompts with its tiktoken
    tokenizer, also remote code): each answer recorded equals transformers' greedy tokens for its prompt ids. MLA
    (prefilled as multi-head attention, decoded over the latent cache, both through our attention stand-ins), the MoE
    with DeepSeek-V3 routing and YaRN, on SGLang's CPU path. (SGLang serving the Kimi drafts, and its aux states
    against our capture: tests/tasks/serving/test_vllm_kimi.py.)"""
    import torch

    from cli.demo import demo_config, demo_server
    from flows.config.file import dump_config
    from models.target.loader import load_language_model
    from models.target.tokenizer import load_tokenizer

    sglang_python()
    config = demo_config(tmp_path / "run", target="kimi", engine="sglang")
    config.target.path = str(kimi_target_dir)
    config.server = demo_server(config, "sglang", f"http://127.0.0.1:{free_port()}")
    assert config.target.trust_remote_code and "--trust-remote-code" in (config.server.command or [])
    assert (kimi_target_dir / "tiktoken.model").is_file()  # the tokenizer as Kimi-K2.5 publishes it
    tokenizer = load_tokenizer(str(kimi_target_dir), True)
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    config.sampling = type(config.sampling).model_validate(
        {"max_new_tokens": MAX_NEW, "temperature": 0.0, "stop_token_ids": stop}
    )
    file = subset(tmp_path, "gen_code.jsonl", 6)
    config.datasets = [
        type(config.datasets[0]).model_validate({"name": "B1_code", "kind": "generate", "path": str(file)})
    ]
    path = tmp_path / "config.yaml"
    path.write_text(dump_config(config))
    done = eagle3("generate", str(path), api_url=harness_api_url)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = rows_of(config.run_dir, "B1_code")
    assert sorted(r["id"] for r in rows) == sorted(r.id for r in load_dataset(file, "generate").rows)
    assert json.loads((config.run_dir / "generated-by.json").read_text())["engine"] == "sglang"
    model = load_language_model(str(kimi_target_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for r in rows:
            prompt = torch.tensor([r["prompt_ids"]])
            ours = model.generate(prompt, max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=stop)[
                0, prompt.shape[1] :
            ]
            assert r["output_ids"] == ours.tolist(), r["id"]
