"""Prefect tasks of the capture stage: plan the disk, run the DeepSpeed job (or the vLLM capture), index the shards.

A failed rank reports its exception in one `CAPTURE_ERROR {json}` line (models/common/rank_protocol.py); the
job task raises that exception again (`rank_error`), so a full disk or a damaged file reads as one
line in `eagle3 run`, and `capture_retryable` tells Prefect to retry only a crashed or killed rank.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from models.capture.shards import METADATA_NAME, RESUME, iter_shard_index, list_shards, write_index
from models.common.atomic import write_atomic
from models.common.file_errors import DamagedFile, WriteFailed
from models.common.job_files import CaptureJobFile
from models.common.rank_protocol import CAPTURE, Message
from settings.capture import VllmCaptureSettings
from settings.distributed import Nodes
from tasks.capture.plan import CapturePlan, ExtractionWindow, TargetShape, check_fits, human_bytes, plan_capture
from tasks.runtime import launch_ranks
from tasks.runtime.artifacts import artifact_key, progress_artifact
from tasks.runtime.launch_ranks import RankFailure, RankRefused, follow_job, rank_command, run_job, write_job
from tasks.serving.capture_server import CaptureServer, launched_capture_server
from tasks.serving.errors import EngineDied, ServerOutage
from tasks.serving.watch import ServerWatch


class CaptureRefused(RankRefused):
    """A capture rank refused its job (records, settings or existing shards): a retry would do the same."""


def captured_tokens(out_dir: Path) -> int:
    """Tokens already in complete shards (headers only)."""
    return sum(row["length"] for row in iter_shard_index(out_dir)) if out_dir.is_dir() else 0


def last_throughput(out_dir: Path) -> float | None:
    """Tokens/s of the previous capture into `out_dir`, if one finished; DamagedFile if its metadata is."""
    meta = out_dir / METADATA_NAME
    if not meta.is_file():
        return None
    try:
        speed = json.loads(meta.read_text()).get("tokens_per_s")
        return float(speed) if speed is not None else None
    except (ValueError, AttributeError, TypeError) as e:  # not JSON, not an object, not a number
        raise DamagedFile(
            meta, f"not the capture's metadata: {e}", "Ignored: it only times the next capture, which writes it again"
        ) from None


def rank_error(reports: list[dict[str, Any]]) -> Exception | None:
    """The exception a failed capture job stands for, from its ranks' CAPTURE_ERROR reports (`launch_ranks.rank_error`).

    None when no rank said why (killed, crashed in C) or only unexpected errors were reported: the
    launcher's RankFailure, with the output tail, then stands (and is retried).
    """
    return launch_ranks.rank_error(reports, CAPTURE, refused=CaptureRefused)


def run_ranks(command: list[str], env: dict[str, str], on_line: Callable[[str], None]) -> None:
    """Run capture ranks, every output line to `on_line`; a rank that reported why it failed raises that
    (`rank_error`)."""
    follow_job(
        command,
        protocol=CAPTURE,
        env=env,
        log=on_line,
        on_message=lambda message: on_line(message.line),
        failure=_failure,
        run=run_job,
    )


def _failure(reports: list[dict[str, Any]], launcher_error: RankFailure) -> BaseException:
    return rank_error(reports) or launcher_error


def capture_retryable(task: Any, task_run: Any, state: Any) -> bool:
    """Prefect retry condition of the capture job: retry a crashed or killed rank, nothing a retry repeats.

    A failed write, a damaged file or a refused job (CaptureRefused) fails the same way again, so
    they fail at once; a rank that died (OOM kill, NCCL error, lost node) may well succeed, and the
    retry resumes: complete shards are skipped. Likewise a vLLM server that stayed unreachable for
    its outage window (ServerOutage), or a server the capture launched that died (EngineDied: the retry starts a
    new one); a refused record or an unusable reply file is not retried.
    """
    error = state.data if isinstance(state.data, BaseException) else state.result(raise_on_failure=False)
    return isinstance(error, (RankFailure, ServerOutage, EngineDied))


@task(name="plan-capture", cache_policy=NO_CACHE)
def plan_capture_task(
    records_dirs: list[Path],
    out_dir: Path,
    shape: TargetShape,
    dtype: str,
    storage: str,
    margin: float,
    max_tokens: int | None,
    engine: ExtractionWindow | None = None,
) -> CapturePlan:
    """The disk plan; refuses (DiskTooSmall) a capture that cannot fit."""
    logger = get_run_logger()
    try:
        speed = last_throughput(out_dir)
    except DamagedFile as e:
        logger.warning("%s", e)
        speed = None
    plan = plan_capture(
        records_dirs,
        out_dir,
        shape,
        dtype,
        margin=margin,
        storage=storage,
        max_tokens=max_tokens,
        tokens_done=captured_tokens(out_dir),
        tokens_per_s=speed,
        engine=engine,
    )
    logger.info(
        "capture plan: %s tokens to capture (%s done), %s needed (%s/token), %s free in %s%s",
        f"{plan.tokens_todo:,}",
        f"{plan.tokens_done:,}",
        human_bytes(plan.bytes_needed),
        f"{plan.bytes_per_token:,} B",
        human_bytes(plan.free_bytes),
        out_dir,
        f", about {plan.est_seconds / 3600:.1f} h at the last measured speed" if plan.est_seconds else "",
    )
    if plan.temp_dir is not None:
        logger.info(
            "capture plan: the vLLM connector's files take up to %s at once in %s%s",
            human_bytes(plan.temp_bytes),
            plan.temp_dir,
            " (counted above: same filesystem)"
            if plan.temp_usable_bytes is None
            else f" ({human_bytes(plan.temp_usable_bytes)} usable there)",
        )
    check_fits(plan)
    return plan


@task(name="capture-job", cache_policy=NO_CACHE)
def run_capture_job(
    job: CaptureJobFile,
    job_path: Path,
    num_ranks: int,
    launcher: str,
    config_name: str,
    token_cap: int | None = None,
    nodes: Nodes | None = None,
) -> float:
    """Launch the ranks, stream their output into the flow-run log, track progress; return tokens/s.

    `num_ranks` per node; with `nodes` over several, this is node 0: under torchrun only its own
    ranks' progress lines reach it (the deal balances tokens, so theirs stand for all), under the
    deepspeed launcher every node's (pdsh). `token_cap` caps the tokens of the whole capture: each
    attempt (a Prefect retry resumes) gets what is left of it after the complete shards on disk. A
    rank's failure is raised as the rank's own exception (`rank_error`) when it said one.
    """
    logger = get_run_logger()
    nodes = nodes or Nodes()
    world_size = num_ranks * nodes.nnodes
    if token_cap is not None:
        job = job.model_copy(update={"launch_tokens": max(0, token_cap - captured_tokens(Path(job.out_dir)))})
    command, env = rank_command(
        "models.capture", ["--job", str(job_path)], num_ranks=num_ranks, launcher=launcher, nodes=nodes
    )
    write_job(job, job_path, kept=lambda: "every complete shard (no rank was started)", resume=RESUME)
    logger.info("launching %d rank(s) on %d node(s): %s", world_size, nodes.nnodes, " ".join(command))
    artifact = progress_artifact(
        progress=0.0, key=artifact_key("capture", config_name), description="capture: starting"
    )
    ranks: dict[int, tuple[int, int, int]] = {}
    last_update = 0.0
    started = time.monotonic()
    tokens_before = captured_tokens(Path(job.out_dir)) if nodes.multinode else 0

    def on_progress(message: Message) -> None:
        nonlocal last_update
        rank, done, total, tokens = (message.values[k] for k in ("rank", "done", "total", "tokens"))
        ranks[rank] = (done, total, tokens)
        if time.monotonic() - last_update >= 2 or done == total:
            last_update = time.monotonic()
            done_all = sum(d for d, _, _ in ranks.values())
            total_all = sum(t for _, t, _ in ranks.values())
            tokens_all = sum(k for _, _, k in ranks.values())
            percent = 100.0 * done_all / total_all if total_all else 100.0
            line = progress_line(
                done_all,
                total_all,
                tokens_all,
                time.monotonic() - started,
                f"{len(ranks)} of {world_size} rank(s) reporting here",
            )
            update_progress_artifact(artifact, progress=round(percent, 2), description=line)
            logger.info(line)

    # run=run_job: this module's, the seam where tests/flows/test_capture_flow.py scripts the ranks
    follow_job(
        command, protocol=CAPTURE, env=env, log=logger.info, on_message=on_progress, failure=_failure, run=run_job
    )
    # From the shards, not the progress lines: under torchrun the other nodes' lines never reach this node.
    tokens = (
        captured_tokens(Path(job.out_dir)) - tokens_before if nodes.multinode else sum(k for _, _, k in ranks.values())
    )
    update_progress_artifact(artifact, progress=100.0, description=f"capture: done, {tokens:,} tokens this run")
    return tokens / max(1e-9, time.monotonic() - started)


def progress_line(done: int, total: int, tokens: int, seconds: float, where: str) -> str:
    """The capture artifact's description and log line, the same for either backend."""
    return f"capture: {done:,}/{total:,} samples, {tokens:,} tokens, {tokens / max(1e-9, seconds):,.0f} tok/s ({where})"


@task(name="capture-engine", cache_policy=NO_CACHE)
def run_vllm_capture(
    job: CaptureJobFile,
    engine: VllmCaptureSettings,
    server: CaptureServer,
    config_name: str,
    token_cap: int | None = None,
    log_dir: Path | None = None,
    health_timeout_s: float = 3600.0,
) -> float:
    """Capture through the vLLM server (tasks/capture/vllm_capture.py), tracking progress like the DeepSpeed job;
    return tokens/s.

    Each attempt starts the server itself (capture.engine.launch: dev | command) and stops it at the end, so a retry
    gets a fresh one; while it runs, a launched server that exits (or whose engine dies) ends the attempt at once
    with EngineDied (tasks/serving/watch.py), which the retry condition retries, instead of the outage window's wait.
    `token_cap` caps the whole capture as for the job: each attempt gets what is left after the complete shards.
    """
    from prefect.utilities.asyncutils import run_coro_as_sync

    from tasks.capture.vllm_capture import capture_with_vllm

    logger = get_run_logger()
    if token_cap is not None:
        job = job.model_copy(update={"launch_tokens": max(0, token_cap - captured_tokens(Path(job.out_dir)))})
    artifact = progress_artifact(
        progress=0.0, key=artifact_key("capture", config_name), description="capture: starting"
    )
    started = time.monotonic()
    last_update = 0.0

    def on_progress(done: int, total: int, tokens: int) -> None:
        nonlocal last_update
        if time.monotonic() - last_update >= 2 or done == total:
            last_update = time.monotonic()
            line = progress_line(done, total, tokens, time.monotonic() - started, f"vLLM at {engine.url}")
            update_progress_artifact(
                artifact, progress=round(100.0 * done / total if total else 100.0, 2), description=line
            )
            logger.info(line)

    if server.launch != "none":
        logger.info("capture: starting the vLLM server at %s (log: %s)", server.url, log_dir)
    with launched_capture_server(server, log_dir=log_dir, health_timeout_s=health_timeout_s, logger=logger) as launched:
        started = time.monotonic()  # tokens/s of the capture, not of the server's start (minutes for a 1 T target)
        watch = ServerWatch.of(
            launched,
            engine.outage_window_s,
            "vLLM server",
            stage="capture",
            next_step="this attempt stops now instead of waiting out capture.engine.outage_window_s "
            f"({engine.outage_window_s:.0f} s); a retry (capture.retries) starts a new server and resumes after the "
            "complete shards",
        )
        work = capture_with_vllm(
            job,
            engine,
            server.shared_dir,
            on_progress=on_progress,
            logger=logger,
            on_failure=watch.after_failure if watch is not None else None,
        )
        result: dict[str, int] = run_coro_as_sync(watch.guard(work) if watch is not None else work)
    update_progress_artifact(
        artifact, progress=100.0, description=f"capture: done, {result['tokens']:,} tokens this run"
    )
    return result["tokens"] / max(1e-9, time.monotonic() - started)


@task(name="index-hidden", cache_policy=NO_CACHE)
def index_hidden_states(
    out_dir: Path, metadata: dict[str, Any], tokens_per_s: float, config_name: str
) -> dict[str, Any]:
    """hidden/index.parquet (id, dataset, shard, offset, length) and hidden/metadata.json from shard headers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_index(out_dir)  # the ranks wrote it too; again here so an empty or resumed capture has one
    rows = list(iter_shard_index(out_dir))
    summary = {
        **metadata,
        "samples": len(rows),
        "tokens": int(sum(r["length"] for r in rows)),
        "tokens_per_s": tokens_per_s,
    }
    try:
        write_atomic(out_dir / METADATA_NAME, json.dumps(summary, indent=2))
    except OSError as e:
        raise WriteFailed(
            out_dir / METADATA_NAME,
            e,
            resume=RESUME,
            kept=f"{len(list_shards(out_dir))} complete shards and index.parquet in {out_dir}",
        ) from None
    per_dataset: dict[str, list[int]] = {}
    for r in rows:
        per_dataset.setdefault(r["dataset"], []).append(r["length"])
    create_table_artifact(
        table=[{"dataset": d, "samples": len(v), "tokens": sum(v)} for d, v in sorted(per_dataset.items())],
        key=artifact_key("capture-summary", config_name),
        description=f"Hidden states in {out_dir}",
    )
    get_run_logger().info("indexed %d samples, %d tokens in %s", summary["samples"], summary["tokens"], out_dir)
    return summary
