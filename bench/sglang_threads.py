"""The real SGLang on a CPU: one OpenMP thread against torch's default, alone and beside a busy process.

Why `tasks/serving/sglang.py` `cpu_command` sets `OMP_NUM_THREADS=1`: on a CPU without AMX, SGLang 0.5.23 binds no
OpenMP threads of its own, so torch runs one spin-waiting thread per core, and each op of a decode step waits for
all of them. When another process holds a core (CI's second test worker, a user's build), a step waits for the
scheduler's time slices.

The same server (`cpu_command` on the tiny target, .venv-sglang: `make sglang`) is started twice: with the command
as the pipeline writes it (one thread) and with `OMP_NUM_THREADS=1` taken out (torch's default). Each serves the same
greedy requests (`--requests`, `--new-tokens` each with ignore_eos, `--concurrency` at once) alone, then beside one
process that spins a core. The figure is output tokens per second over the wall time of a pass; the ratios are one
thread's over the default's, in the same run. Nothing is asserted. Results: docs/engines.md ("The real SGLang on
CPU"). Usage::

    make sglang && .venv/bin/python bench/sglang_threads.py [--quick] [--json out.json] [--PARAM VALUE ...]
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import os
import random
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: bench.harness, tasks
import httpx  # noqa: E402

from bench import harness  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SGLANG_PYTHON = REPO / ".venv-sglang" / "bin" / "python"
ONE_THREAD = "OMP_NUM_THREADS=1"


@dataclass
class Params:
    """Every knob of one bench run (printed and saved with the figures)."""

    requests: int = 16
    new_tokens: int = 48
    concurrency: int = 8
    prompt_tokens: int = 200
    quick: bool = False

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(requests=8, new_tokens=16, quick=True)


def spin(stop: Any) -> None:
    """A busy neighbour: one core's worth of pure Python until told to stop."""
    x = 0
    while not stop.is_set():
        for _ in range(100_000):
            x += 1


def serve_pass(url: str, p: Params) -> tuple[int, float]:
    """(output tokens, seconds) of `p.requests` greedy /generate calls, `p.concurrency` at once."""
    rng = random.Random(0)
    prompts = [[rng.randrange(10, 1000) for _ in range(p.prompt_tokens)] for _ in range(p.requests)]
    sampling = {"max_new_tokens": p.new_tokens, "temperature": 0, "ignore_eos": True}

    def one(ids: list[int]) -> int:
        reply = client.post(f"{url}/generate", json={"input_ids": ids, "sampling_params": sampling})
        reply.raise_for_status()
        return len(reply.json()["output_ids"])

    with httpx.Client(timeout=3600) as client, concurrent.futures.ThreadPoolExecutor(p.concurrency) as pool:
        started = time.perf_counter()
        tokens = sum(pool.map(one, prompts))
        return tokens, time.perf_counter() - started


def measure_server(threads: str, target: Path, p: Params, scratch: Path) -> dict[str, Any]:
    """tok/s alone and beside a spinning process, with `threads` "one" (the command as written) or "default"."""
    from tasks.serving.sglang import cpu_command

    words = cpu_command(str(SGLANG_PYTHON), str(target), context_length=2048)
    assert ONE_THREAD in words, "cpu_command no longer sets OMP_NUM_THREADS=1: this bench compares against that"
    if threads == "default":
        words = [w for w in words if w != ONE_THREAD]
    started = time.monotonic()
    server = harness.start_server(words, "sglang", scratch / f"sglang-{threads}.log")
    try:
        print(f"  {threads} threads: healthy after {time.monotonic() - started:.0f} s", flush=True)
        serve_pass(server.url, Params(requests=2, new_tokens=4))  # warm-up
        out: dict[str, Any] = {}
        for beside in ("alone", "busy"):
            stop = multiprocessing.Event()
            neighbours = [multiprocessing.Process(target=spin, args=(stop,))] if beside == "busy" else []
            for n in neighbours:
                n.start()
            try:
                tokens, seconds = serve_pass(server.url, p)
            finally:
                stop.set()
                for n in neighbours:
                    n.join()
            out[beside] = {"tokens": tokens, "s": seconds, "tok_s": tokens / seconds}
            print(f"  {threads} threads, {beside}: {tokens} tokens in {seconds:.1f} s", flush=True)
        return out
    finally:
        server.stop()


def measure(scratch: Path, out: dict[str, Any]) -> None:
    p = Params(**out["params"])
    if not SGLANG_PYTHON.is_file():
        raise SystemExit(f"no real SGLang: {SGLANG_PYTHON} is missing (`make sglang` installs it)")
    os.environ.pop("OMP_NUM_THREADS", None)  # "default": torch's own choice, not one inherited from here
    target, _ = harness.TargetParams().build_target("sglang-threads")
    out["servers"] = {threads: measure_server(threads, target, p, scratch) for threads in ("one", "default")}


def report(out: dict[str, Any]) -> None:
    s = out["servers"]
    rows = [
        [threads, f"{s[threads]['alone']['tok_s']:.1f}", f"{s[threads]['busy']['tok_s']:.1f}"]
        for threads in ("default", "one")
    ]
    rows.append(
        ["ratio one/default", *(f"{s['one'][b]['tok_s'] / s['default'][b]['tok_s']:.1f}x" for b in ("alone", "busy"))]
    )
    print()
    harness.table(["OpenMP threads", "tok/s alone", "tok/s beside a busy process"], rows)


def main() -> int:
    args = harness.arguments(__doc__ or "", Params(), keep="the servers' logs").parse_args()
    p = harness.params_from(args, Params)
    return harness.run_bench("sglang-threads", args, asdict(p), {}, measure, report, kept="the servers' logs")


if __name__ == "__main__":
    raise SystemExit(main())
