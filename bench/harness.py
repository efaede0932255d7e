"""Scaffolding the benches share: flags, scratch directory, machine facts, launches, passes, tables, JSON.

A bench script keeps what it measures (its data, its baselines, its ratios and its report) and takes
from here how a run is set up, started, timed and written down:

- `arguments` / `params_from`: `--json`, `--keep`, `--verbose`, `--quick` and one flag per field of
  the bench's `Params` dataclass;
- `run_bench`: one run in a scratch directory, timed, then the report, the closing line (the
  machine, the load average at start and end) and the figures written as JSON;
- `bench_main`: a bench's `main` of both: its flags, its Params, `run_bench`;
- `TargetParams`: the tiny Llama target's shape, its cache directory and its build;
- `record_row`, `write_records`, `length_summary`: synthetic records in the records stage's format;
- `start_server`: an engine's CPU command started and healthy;
- `launch`: a rank job started as the stage tasks start it (`tasks.runtime.launch_ranks.rank_command` + `run_job`),
  its lines time-stamped into a log; `spawn`: baselines in fresh processes, like ranks;
  `descendants_cpu_s` / `process_cpu_s` / `extension_builds`: what those processes cost;
- `passes`, `median_of`, `range_of`, `best_of`: repeats and their summaries;
- `table` / `markdown_table`: the printed tables.

Importing this module puts the repository root on `sys.path` and sets the Hugging Face offline
variables (a local checkpoint only), before any bench imports transformers; launched ranks and
spawned baselines inherit both. Heavy modules (torch, transformers) are imported where used.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

T = TypeVar("T")
P = TypeVar("P")  # a bench's Params dataclass

# ---------------------------------------------------------------------------------------------
# Flags
# ---------------------------------------------------------------------------------------------


def arguments(
    doc: str, defaults: Any, *, keep: str, verbose: bool = False, quick: str = "a smaller run: smoke test of the bench"
) -> argparse.ArgumentParser:
    """The common flags and one `--field-name` flag per field of `defaults` (a bench's Params).

    The description is the first line of `doc`; `keep` names what `--keep DIR` keeps; a boolean
    field is a switch. `--quick` (the `quick` field) picks the Params' `quick_preset`.
    """
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--quick", action="store_true", default=None, help=quick)
    ap.add_argument("--json", type=Path, help="write the figures here as JSON")
    ap.add_argument("--keep", type=Path, help=f"write {keep} here and keep them (default: a temp dir)")
    if verbose:
        ap.add_argument("--verbose", action="store_true", help="echo the ranks' output")
    for f in fields(defaults):
        if f.name == "quick":
            continue
        value = getattr(defaults, f.name)
        if isinstance(value, bool):
            ap.add_argument(f"--{f.name.replace('_', '-')}", action="store_true", default=None)
        else:
            ap.add_argument(f"--{f.name.replace('_', '-')}", type=type(value), default=None)
    return ap


def params_from(args: argparse.Namespace, cls: type[T]) -> T:
    """The Params of this run: the quick preset or the defaults, with every flag given on top; validated."""
    p = cls.quick_preset() if args.quick else cls()  # type: ignore[attr-defined]
    for f in fields(p):  # type: ignore[arg-type]
        if f.name != "quick" and getattr(args, f.name) is not None:
            setattr(p, f.name, getattr(args, f.name))
    if hasattr(p, "validate"):
        p.validate()
    return p


# ---------------------------------------------------------------------------------------------
# The run: scratch directory, machine facts, total, JSON
# ---------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (from /proc/cpuinfo where there is one)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def loadavg() -> list[float] | None:
    """The 1, 5 and 15 minute load averages: how much else ran on the machine."""
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except (OSError, ValueError):
        return None


def run_bench(
    stage: str,
    args: argparse.Namespace,
    params: dict[str, Any],
    versions: dict[str, str],
    measure: Callable[[Path, dict[str, Any]], None],
    report: Callable[[dict[str, Any]], None],
    *,
    kept: str,
) -> int:
    """One bench run: `measure(scratch dir, out)`, then `report(out)`, the closing line and `--json`; returns 0.

    `out` starts with the params and the machine's facts (CPU model, `versions`, load average); the
    run adds its total_s and the load average at its end. The scratch directory is a temp dir
    removed afterwards, or (`--keep DIR`) a new directory under DIR that stays (`kept` says what
    it holds).
    """
    out: dict[str, Any] = {
        "params": params,
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": cpu_model(),
            **versions,
            "loadavg_start": loadavg(),
        },
    }
    started = time.monotonic()
    if args.keep is not None:
        args.keep.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"bench-{stage}-", dir=args.keep))
    try:
        print(f"{stage}-stage bench" + (" (--quick)" if args.quick else ""), flush=True)
        measure(tmp, out)
    finally:
        if args.keep is None:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"{kept} kept in {tmp}")
    m = out["machine"]
    m["loadavg_end"] = loadavg()
    out["total_s"] = time.monotonic() - started
    report(out)
    print(
        f"\ntotal {out['total_s']:.0f} s on {m['cpus']} CPU(s) ({m['processor']}); load average at start "
        f"{m['loadavg_start']}, at end {m['loadavg_end']}"
        + ("  (--quick: a smoke run; take the figures from the default run)" if args.quick else "")
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2, default=str) + "\n")
        print(f"figures written to {args.json}")
    return 0


def bench_main(
    stage: str,
    doc: str,
    cls: type[P],
    measure: Callable[[P, Path, dict[str, Any]], None],
    report: Callable[[dict[str, Any]], None],
    argv: list[str] | None,
    *,
    kept: str,
    quick: str,
) -> int:
    """A bench's `main`: its flags (`arguments` of `cls`, its Params), its Params (`params_from`), then `run_bench`
    with `measure(params, scratch dir, out)` and `report(out)`, torch's version among the machine's facts."""
    args = arguments(doc, cls(), keep=kept, quick=quick).parse_args(argv)
    p = params_from(args, cls)
    import torch

    return run_bench(
        stage, args, asdict(p), {"torch": torch.__version__}, lambda d, o: measure(p, d, o), report, kept=kept
    )


# ---------------------------------------------------------------------------------------------
# Data: the tiny target and synthetic records
# ---------------------------------------------------------------------------------------------


@functools.cache
def tiny_target_defaults() -> dict[str, Any]:
    """build_tiny_target's keyword defaults: the shape of the test and demo target, declared there once."""
    from models.target.tiny import build_tiny_target

    return {
        name: q.default
        for name, q in inspect.signature(build_tiny_target).parameters.items()
        if q.default is not inspect.Parameter.empty
    }


def tiny_target_default(name: str) -> Any:
    """A dataclass field defaulting to build_tiny_target's default for `name`.

    Read when a Params is made, not when this module is imported: models.target.tiny loads torch
    and transformers, which the generate bench does without.
    """
    return field(default_factory=lambda: tiny_target_defaults()[name])


@dataclass
class TargetParams:
    """The bench's seed and the tiny Llama target's shape (the build_tiny_target arguments a bench varies).

    The defaults are the test and demo target's; a bench may declare a field again with its own.
    """

    seed: int = 0
    hidden_size: int = tiny_target_default("hidden_size")
    num_layers: int = tiny_target_default("num_layers")
    num_heads: int = tiny_target_default("num_heads")
    num_kv_heads: int = tiny_target_default("num_kv_heads")
    intermediate_size: int = tiny_target_default("intermediate_size")
    vocab_size: int = tiny_target_default("vocab_size")  # an upper bound: the BPE trainer decides the real size

    def target_dir(self, bench: str) -> Path:
        """Where this shape's target is cached: runs/<bench>/target-... (gitignored), one per shape and seed."""
        return (
            REPO
            / "runs"
            / bench
            / (
                f"target-h{self.hidden_size}-l{self.num_layers}-a{self.num_heads}-kv{self.num_kv_heads}"
                f"-i{self.intermediate_size}-v{self.vocab_size}-s{self.seed}"
            )
        )

    def build_target(self, bench: str, **extra: Any) -> tuple[Path, float]:
        """The target built into `target_dir` (or reused when there) and the seconds that took."""
        from models.target.tiny import build_tiny_target

        target = self.target_dir(bench)
        print(f"  target: {target.relative_to(REPO)} (built once, then reused) ...", flush=True)
        t0 = time.perf_counter()
        build_tiny_target(target, **self.target_shape(), **extra)
        return target, time.perf_counter() - t0

    def target_shape(self) -> dict[str, Any]:
        """build_tiny_target's arguments for this shape and seed (the fields declared here)."""
        return {f.name: getattr(self, f.name) for f in fields(TargetParams)}


def record_row(record_id: str, input_ids: list[int], prompt_tokens: int) -> dict[str, Any]:
    """One record in RECORD_SCHEMA: the loss on every token after the first `prompt_tokens`."""
    n = len(input_ids)
    return {
        "id": record_id,
        "input_ids": input_ids,
        "loss_mask": [0] * prompt_tokens + [1] * (n - prompt_tokens),
        "num_tokens": n,
        "num_loss_tokens": n - prompt_tokens,
        "truncated": False,
    }


def write_records(rows: list[dict[str, Any]], records_dir: Path, rows_per_part: int) -> int:
    """`rows` as records parts of `rows_per_part` rows, written as the records stage writes one; returns the parts."""
    import pyarrow as pa

    from tasks.records.build import RECORD_SCHEMA
    from tasks.responses.parquet_io import write_parquet_atomic

    parts = 0
    for k in range(0, len(rows), rows_per_part):
        table = pa.Table.from_pylist(rows[k : k + rows_per_part], schema=RECORD_SCHEMA)
        write_parquet_atomic(table, records_dir / f"part-{parts:06d}.parquet")
        parts += 1
    return parts


def length_summary(lengths: Iterable[int]) -> dict[str, Any]:
    """Mean, p50, p95 and max of sample lengths (as the bench reports print them)."""
    srt = sorted(int(x) for x in lengths)
    return {
        "mean_len": sum(srt) / len(srt),
        "p50_len": srt[len(srt) // 2],
        "p95_len": srt[min(len(srt) - 1, int(0.95 * len(srt)))],
        "max_len": srt[-1],
    }


# ---------------------------------------------------------------------------------------------
# Launches and spawned baselines
# ---------------------------------------------------------------------------------------------


@dataclass
class Launched:
    """How a launched job went: ok or the tail of its output, and its timing."""

    ok: bool
    error: str | None
    started_at: float  # time.time() at launch (to line up with wall-clock stamps the job writes)
    wall_s: float  # launch -> launcher exit
    ops_built: list[str] = field(default_factory=list)  # torch extensions (re)built during the launch


def start_server(command: list[str], engine: str, log: Path) -> Any:
    """A serving engine's `cpu_command` (tasks/serving/) started on a free loopback port, as the pipeline starts it,
    and healthy: its ServerProcess (`.url`; `.stop()` it when done)."""
    from tasks.runtime.ports import free_port
    from tasks.serving.launch import ServerProcess, fill_placeholders

    port = free_port()
    words = [fill_placeholders(w, {"host": "127.0.0.1", "port": str(port)}) for w in command]
    server = ServerProcess(words, f"http://127.0.0.1:{port}", log_path=log, engine=engine)
    server.start()
    print(f"  starting {engine} at {server.url} (log {log})", flush=True)
    try:
        server.wait_healthy(timeout_s=600)
    except BaseException:
        server.stop()
        raise
    return server


def launch(
    module: str,
    job: dict[str, Any],
    *,
    ranks: int,
    threads: int,
    job_path: Path,
    log_path: Path,
    verbose: bool,
    on_line: Callable[[str, float], None] | None = None,
) -> Launched:
    """Run `python -m module --job JOB` on `ranks` ranks as the stage tasks launch it; the job written to `job_path`.

    tasks.runtime.launch_ranks.rank_command (torchrun: DS_ACCELERATOR=cpu, gloo) + run_job, OMP_NUM_THREADS=threads
    per rank. Each output line is time-stamped (seconds since launch, as it reaches this process)
    into `log_path`, echoed with `verbose`, and passed to `on_line(line, seconds)`. A failing job
    is reported in the result, not raised.
    """
    from tasks.runtime.launch_ranks import RankFailure, rank_command, run_job

    job_path.write_text(json.dumps(job, indent=2))
    command, env = rank_command(module, ["--job", str(job_path)], num_ranks=ranks, launcher="torchrun")
    env = {**env, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    builds = extension_builds()
    with open(log_path, "w") as log:

        def line_out(line: str) -> None:
            t = time.monotonic() - t0
            log.write(f"{t:9.3f} {line}\n")
            if verbose:
                print(f"      | {line}", flush=True)
            if on_line is not None:
                on_line(line, t)

        started_at, t0 = time.time(), time.monotonic()
        try:
            run_job(command, env=env, on_line=line_out)
            ok, error = True, None
        except RankFailure as e:
            ok, error = False, str(e)[-3000:]
        wall = time.monotonic() - t0
    built = sorted(name for name, mtime in extension_builds().items() if builds.get(name) != mtime)
    return Launched(ok, error, started_at, wall, built)


def _spawned(fn: Callable[..., Any], args: tuple, index: int, barrier: Any, queue: Any) -> None:
    """A spawned process's body: fn's result (or its error) to the parent; a failure breaks the peers' barrier."""
    try:
        queue.put((index, fn(*args, barrier) if barrier is not None else fn(*args)))
    except BaseException as e:  # noqa: BLE001 - reported by the parent
        queue.put((index, {"error": f"{e!r}\n{traceback.format_exc()}"}))
        if barrier is not None:
            barrier.abort()


def spawn(
    fn: Callable[..., T], args: Sequence[tuple], *, threads: int, timeout_s: float, what: str, together: bool = True
) -> tuple[list[T], float]:
    """`fn(*a)` for each `a` in `args`, each in a fresh spawned process, all at once; (results in order, spawn time).

    The processes start with OMP_NUM_THREADS=threads, as rank_command sets it for a rank. With
    `together`, `fn` gets a shared barrier as its last argument (to start its timed part with its
    peers). A result of the form {"error": ...} or no result within `timeout_s` raises
    RuntimeError naming `what`. The spawn time is time.monotonic() just before the first start.
    """
    import multiprocessing as mp
    import queue as queue_mod

    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(len(args)) if together else None, ctx.Queue()
    saved = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = str(threads)  # the children's environment at their start
    try:
        spawned = time.monotonic()
        procs = [ctx.Process(target=_spawned, args=(fn, a, k, barrier, queue)) for k, a in enumerate(args)]
        for proc in procs:
            proc.start()
    finally:
        if saved is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = saved
    results: dict[int, Any] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < len(procs):
            try:
                k, result = queue.get(timeout=max(1.0, deadline - time.monotonic()))
            except queue_mod.Empty:
                raise RuntimeError(f"{what}: {len(procs)} process(es) did not finish in {timeout_s:.0f} s") from None
            results[k] = result
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    errors = [x["error"] for x in results.values() if isinstance(x, dict) and "error" in x]
    if errors:
        raise RuntimeError(f"{what} failed:\n" + "\n".join(errors))
    return [results[k] for k in range(len(procs))], spawned


def _proc_stat(pid: int | str) -> list[str]:
    """The fields of /proc/PID/stat after the command name (field 3 first)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (NaN where /proc cannot tell)."""
    try:
        stat = _proc_stat(pid)
        return (int(stat[11]) + int(stat[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def descendants_cpu_s(root: int) -> tuple[float, float] | None:
    """User + system CPU seconds so far of the live descendants of `root`: (its children, e.g. the
    launcher; their descendants, e.g. the ranks)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        parent: dict[int, int] = {}
        cpu: dict[int, int] = {}
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                stat = _proc_stat(name)
            except OSError:
                continue  # gone meanwhile
            parent[int(name)], cpu[int(name)] = int(stat[1]), int(stat[11]) + int(stat[12])
    except (OSError, ValueError):
        return None
    children = deeper = 0
    for pid, ticks in cpu.items():
        up, depth = parent.get(pid), 1
        while up is not None and up > 1 and up != root:
            up, depth = parent.get(up), depth + 1
        if up == root:
            if depth == 1:
                children += ticks
            else:
                deeper += ticks
    return children / tick, deeper / tick


def extension_builds() -> dict[str, float]:
    """Modification times of the JIT-built torch extensions (DeepSpeed's CPU comm op is one)."""
    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or Path.home() / ".cache" / "torch_extensions")
    found = {}
    for so in root.glob("*/*/*.so"):
        try:
            found[so.parent.name] = so.stat().st_mtime
        except OSError:
            pass
    return found


# ---------------------------------------------------------------------------------------------
# Repeats and summaries
# ---------------------------------------------------------------------------------------------


def passes(sequence: Sequence[T], repeats: int, *, announce: bool = False) -> Iterator[tuple[int, T]]:
    """(pass number, step) over `sequence`, `repeats` times, every other pass in reverse order.

    Reversing spreads slow drifts of the machine's other load over every step alike; with
    `announce`, each pass is named as it starts (when there are several).
    """
    for k in range(repeats):
        if announce and repeats > 1:
            print(f"  pass {k + 1} of {repeats}" + (" (reverse order)" if k % 2 else ""), flush=True)
        for step in sequence if k % 2 == 0 else sequence[::-1]:
            yield k, step


def median_of(values: Iterable[float | None]) -> float | None:
    """The median of the values measured (None: a pass without that figure); None if there are none."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def range_of(values: Iterable[float | None]) -> list[float] | None:
    """[min, max] of the values measured; None if there are none."""
    present = [v for v in values if v is not None]
    return [min(present), max(present)] if present else None


def best_of(repeats: int, fn: Callable[[], T]) -> tuple[float, list[float], T]:
    """`fn` run `repeats` times: (the fastest wall time, every wall time, the last result)."""
    times, result = [], None
    for _ in range(repeats):
        t0 = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - t0)
    return min(times), times, result  # type: ignore[return-value]


# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """An aligned text table, indented: the first column left-aligned, the others right-aligned."""
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)]
    fmt = "   " + "  ".join(f"{{:<{w}}}" if i == 0 else f"{{:>{w}}}" for i, w in enumerate(widths))
    print(fmt.format(*head))
    print("   " + "  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt.format(*row))


def markdown_table(head: Sequence[str], rows: Sequence[Sequence[Any]], *, align: str | None = None) -> None:
    """A markdown table (pipes), columns padded for the terminal.

    With `align` (one letter per column, "l" or "r"), a table as docs/ hold them instead: cells not
    padded, the rule under the head marking each column's alignment (`---`, `---:`).
    """
    if align is not None and len(align) != len(head):
        raise ValueError(f"align {align!r}: one letter per column, {len(head)} columns")
    widths = [max(len(str(x)) for x in col) for col in zip(head, *rows)] if align is None else [0] * len(head)

    def line(cells: Sequence[Any]) -> str:
        return "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"

    print(line(head))
    if align is None:
        print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    else:
        print("| " + " | ".join("---:" if a == "r" else "---" for a in align) + " |")
    for row in rows:
        print(line(row))
