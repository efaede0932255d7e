"""Generate stage against a REAL engine: our loop vs a plain asyncio client with the same requests in flight, one run.

A real vLLM (`--engine vllm`, the default: the CPU build in .venv-vllm, `make vllm`) or a real SGLang 0.5.23
(`--engine sglang`: .venv-sglang, `make sglang`), or `--url` of one already running, serves the tiny target.
The same prompts (the sample datasets' prompts, rendered with the target's chat template, repeated under fresh
ids to `--prompts`) go through

(a) ours: `tasks.generate.loop.generate_dataset` through a `ServerPool` of that one server with
    `max_concurrency` = `--concurrency`, writing its checkpoints as the stage does;
(b) the baseline: an asyncio client that keeps `--concurrency` requests in flight (a semaphore) with
    the same request body (vLLM's /v1/completions, SGLang's /generate), and keeps the replies in a list
    (no checks, no disk).

Greedy (temperature 0), so both decode the same tokens. The two alternate, `--repeats` times each,
after one warm-up pass of each; the figure is output tokens per second over the wall time of a pass, and
the target is median(a) / median(b) >= 0.95. Nothing is asserted: the report prints PASS or FAIL.
Results and their reading: docs/benchmarks.md ("Generate"). Usage::

    make vllm && .venv/bin/python bench/generate_real.py [--quick] [--json out.json] [--url URL] [--PARAM VALUE ...]
    make sglang && .venv/bin/python bench/generate_real.py --engine sglang [--quick] ...
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, tasks
import httpx  # noqa: E402

from bench import harness  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SAMPLES = sorted((REPO / "data" / "samples").glob("gen_*.jsonl"))
TARGET = 0.95


@dataclass
class Params:
    """Every knob of one bench run (printed and saved with the figures)."""

    engine: str = "vllm"  # vllm | sglang
    url: str = ""  # a running server of that engine; empty: start one from .venv-vllm / .venv-sglang on the tiny target
    prompts: int = 256
    concurrency: int = 16
    max_new_tokens: int = 128
    repeats: int = 3
    quick: bool = False

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(prompts=48, concurrency=8, max_new_tokens=64, repeats=1, quick=True)


VENVS = {"vllm": ".venv-vllm", "sglang": ".venv-sglang"}  # `make vllm`, `make sglang`


def prompt_rows(tokenizer: Any, n: int) -> list[Any]:
    """`n` prompts: the sample datasets' prompts in order, repeated under fresh ids."""
    from tasks.datasets import PromptRow, load_dataset

    base = [row for path in SAMPLES for row in load_dataset(path, "generate").rows]
    return [PromptRow(id=f"p{i}", messages=base[i % len(base)].messages) for i in range(n)]


async def run_ours(
    p: Params, url: str, rows: list[Any], tokenizer: Any, root: Path, params: dict[str, Any]
) -> dict[str, Any]:
    from models.common.jobs import GenerateJob
    from settings.layout import RunLayout
    from tasks.generate.loop import generate_dataset
    from tasks.serving.client import RetryPolicy
    from tasks.serving.pool import ServerPool

    settings = GenerateJob(
        dataset="bench", sampling_params=params, flush_every=64, flush_interval_s=5.0, log_interval_s=3600.0
    )
    async with ServerPool(
        [url],
        max_concurrency=p.concurrency,
        retry=RetryPolicy(outage_window_s=60),
        engine=p.engine,
        request_timeout_s=300,
    ) as pool:
        # The pool's start (once per run, shared by every dataset) waits for the health path, which is SGLang's
        # /health_generate: at least 1 s, its own asyncio.sleep(1) (entrypoints/http_server.py). The plain client
        # checks no health, so the start is timed apart (start_s) and the pass is timed from the first send.
        began = time.perf_counter()
        await pool.start()
        start_s = time.perf_counter() - began
        started, cpu = time.perf_counter(), time.process_time()
        layout = RunLayout(root)
        report = await generate_dataset(
            rows,
            pool=pool,
            tokenizer=tokenizer,
            layout=layout,
            source=root / "bench.jsonl",
            settings=settings,
            vocab_size=len(tokenizer),
        )
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    assert report.new_responses == len(rows), report
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "start_s": start_s,
        "tokens": report.completion_tokens,
        "tok_s": report.completion_tokens / wall,
    }


def plain_request(engine: str, model: str, ids: list[int], params: dict[str, Any], rid: str) -> tuple[str, dict]:
    """The path and body the baseline posts: the engine's own request, as our client builds it."""
    if engine == "sglang":
        return "/generate", {"input_ids": ids, "sampling_params": params, "rid": rid}
    from tasks.serving.vllm import completion_body

    return "/v1/completions", completion_body(model, ids, params, rid)


def completion_tokens(engine: str, reply: dict[str, Any]) -> int:
    return reply["meta_info"]["completion_tokens"] if engine == "sglang" else reply["usage"]["completion_tokens"]


async def run_plain(
    p: Params, url: str, model: str, prompts: list[list[int]], params: dict[str, Any]
) -> dict[str, Any]:
    gate = asyncio.Semaphore(p.concurrency)
    replies: list[Any] = []
    async with httpx.AsyncClient(
        base_url=url, timeout=300, limits=httpx.Limits(max_connections=p.concurrency + 8)
    ) as http:

        async def one(i: int, ids: list[int]) -> None:
            async with gate:
                path, body = plain_request(p.engine, model, ids, params, f"plain-{i}-{time.monotonic_ns()}")
                r = await http.post(path, json=body)
                replies.append(r.json())

        started, cpu = time.perf_counter(), time.process_time()
        await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))
        wall, cpu = time.perf_counter() - started, time.process_time() - cpu
    tokens = sum(completion_tokens(p.engine, r) for r in replies)
    return {"wall_s": wall, "cpu_s": cpu, "tokens": tokens, "tok_s": tokens / wall}


def measure(p: Params, tmp: Path, out: dict[str, Any]) -> None:
    from transformers import AutoTokenizer

    from tasks.generate.prompts import chat_prompt_ids, default_stop_ids, request_sampling_params

    target = None
    server = None
    url = p.url
    if p.engine not in VENVS:
        raise SystemExit(f"--engine must be {' or '.join(VENVS)}, got {p.engine!r}")
    if not url:
        from tasks.serving import sglang, vllm

        python = REPO / VENVS[p.engine] / "bin" / "python"
        if not python.is_file():
            raise SystemExit(f"{python} is missing: `make {p.engine}` installs it (or pass --url)")
        target, _ = harness.TargetParams().build_target("generate-real")
        command = (sglang if p.engine == "sglang" else vllm).cpu_command(str(python), str(target))
        server = harness.start_server(command, p.engine, tmp / f"{p.engine}.log")
        url = server.url
    try:
        model = served_model(p.engine, url)
        tokenizer = AutoTokenizer.from_pretrained(target or model)
        params = request_sampling_params(
            {"max_new_tokens": p.max_new_tokens, "temperature": 0.0}, default_stop_ids(tokenizer)
        )
        rows = prompt_rows(tokenizer, p.prompts)
        prompts = [chat_prompt_ids(tokenizer, r.messages) for r in rows]
        out["prompt_tokens"] = harness.length_summary(len(x) for x in prompts)
        print("warm-up (one pass of each)", flush=True)
        asyncio.run(run_plain(p, url, model, prompts, params))
        asyncio.run(run_ours(p, url, rows, tokenizer, tmp / "ours-warm-up", params))
        ours, plain = [], []
        for i in range(p.repeats):
            plain.append(asyncio.run(run_plain(p, url, model, prompts, params)))
            ours.append(asyncio.run(run_ours(p, url, rows, tokenizer, tmp / f"ours-{i}", params)))
            print(
                f"pass {i + 1}/{p.repeats}: ours {ours[-1]['tok_s']:,.0f} tok/s, plain {plain[-1]['tok_s']:,.0f} tok/s",
                flush=True,
            )
        out["ours"], out["plain"] = ours, plain
        a, b = harness.median_of(x["tok_s"] for x in ours), harness.median_of(x["tok_s"] for x in plain)
        out["ratio"] = a / b if a and b else None
        out["same_tokens"] = all(x["tokens"] == plain[0]["tokens"] for x in ours + plain)
        out["version"] = engine_version(p.engine, url)
    finally:
        if server is not None:
            server.stop()


def served_model(engine: str, url: str) -> str:
    """The served model's path or name (the tokenizer is read from it when no target was built here)."""
    if engine == "sglang":
        return httpx.get(url + "/model_info", timeout=10).json()["model_path"]
    return httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]


def engine_version(engine: str, url: str) -> str | None:
    if engine == "sglang":
        return httpx.get(url + "/server_info", timeout=10).json().get("version")
    return httpx.get(url + "/version", timeout=10).json().get("version")


def report(out: dict[str, Any]) -> None:
    p = out["params"]
    name = {"vllm": "vLLM", "sglang": "SGLang"}[p.get("engine", "vllm")]
    version = out.get("version", out.get("vllm"))  # "vllm": the key of runs saved before --engine
    print(
        f"\n{name} {version}: {p['prompts']} prompts, {p['concurrency']} in flight, max_new_tokens "
        f"{p['max_new_tokens']}, greedy; {p['repeats']} pass(es) each, alternating"
    )
    rows = [
        ["ours (generate_dataset + ServerPool + checkpoints)", *[f"{x['tok_s']:,.1f}" for x in out["ours"]]],
        ["plain asyncio client, same in flight", *[f"{x['tok_s']:,.1f}" for x in out["plain"]]],
    ]
    harness.table(["output tokens/s per pass", *[f"pass {i + 1}" for i in range(p["repeats"])]], rows)
    if "cpu_s" in out["ours"][0]:  # the client's own CPU time per pass: what it takes from a server on the same cores
        harness.table(
            ["client CPU seconds per pass", *[f"pass {i + 1}" for i in range(p["repeats"])]],
            [
                ["ours", *[f"{x['cpu_s']:.1f}" for x in out["ours"]]],
                ["plain", *[f"{x['cpu_s']:.1f}" for x in out["plain"]]],
            ],
        )
    if "start_s" in out["ours"][0]:
        starts = ", ".join(f"{x['start_s']:.2f}" for x in out["ours"])
        print(f"ours: the pool's start (its health check, once per run), timed apart from each pass: {starts} s")
    ratio = out["ratio"]
    verdict = "PASS" if ratio is not None and ratio >= TARGET else "FAIL"
    print(
        f"ratio ours / plain (medians): {ratio:.3f}  target >= {TARGET}  {verdict}; same output tokens in every pass: "
        f"{out['same_tokens']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = harness.arguments(__doc__, Params(), keep="the checkpoints and the server log").parse_args(argv)
    p = harness.params_from(args, Params)
    return harness.run_bench(
        f"generate-{p.engine}",
        args,
        asdict(p),
        {},
        lambda tmp, out: measure(p, tmp, out),
        report,
        kept="the checkpoints and the server log",
    )


if __name__ == "__main__":
    raise SystemExit(main())
