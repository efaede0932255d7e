"""Prefect tasks of the train stage: run the DeepSpeed training job, publish its metrics and report.

A failed job raises what its failing rank reported in its `TRAIN_ERROR` line (models/common/rank_protocol.py):
a `WriteFailed`, a damaged file or a `CheckpointMismatch` with the rank's own one-line message, or `TrainFailed`.
Only a `TrainFailed` that is `retryable` (a rank that crashed or was killed without a final
verdict) is worth a Prefect retry (`retry_train_job`); the retry resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from models.common.job_files import TrainJobFile
from models.common.rank_protocol import TRAIN, TRAIN_BEST, TRAIN_EVAL, Message, most_telling
from models.train.best import describe
from models.train.checkpoint import RESUME, CheckpointMismatch, kept_checkpoint
from settings.distributed import Nodes
from settings.layout import CHECKPOINTS, EVAL_REPORT, FINAL, METRICS, TRAIN_SUMMARY, TRAINING_PLOT
from tasks.runtime.artifacts import artifact_key, progress_artifact
from tasks.runtime.heartbeat import Heartbeat
from tasks.runtime.launch_ranks import RankFailure, follow_job, rank_command, rank_error, run_job, write_job
from tasks.train.report import eval_table, load_metrics, plot_training, report_markdown


class TrainFailed(RankFailure):
    """The training job failed; `retryable`: a relaunch may succeed (a crashed or killed rank, a lost node)."""

    def __init__(self, message: str, retryable: bool = False):
        super().__init__(message)
        self.retryable = retryable


def retry_train_job(task, task_run, state) -> bool:  # noqa: ARG001 - Prefect's retry_condition_fn signature
    """Prefect retry condition of `run_train_job`: retry only what a relaunch can fix.

    A crashed or killed rank is retried (the relaunch resumes from the last checkpoint); a failed
    write, a checkpoint of another run, bad data or settings would fail the same way again.
    """
    error = state.result(raise_on_failure=False)
    return isinstance(error, TrainFailed) and error.retryable


def error_line(line: str) -> dict[str, Any] | None:
    """The report in a rank's `TRAIN_ERROR {json}` line (a launcher may prefix it), or None."""
    return TRAIN.error.parse(line)


def job_failure(reports: list[dict[str, Any]], failure: RankFailure) -> Exception:
    """The exception a failed training job raises, from its ranks' TRAIN_ERROR reports (none: killed)."""
    if not reports:
        return TrainFailed(
            f"the training job died without reporting an error (a rank killed: out of memory, "
            f"kill -9, a lost node?); retrying resumes from the last checkpoint. {failure}",
            retryable=True,
        )
    error = rank_error(reports, TRAIN, refused=TrainFailed, known=(CheckpointMismatch,))
    if error is not None:
        return error
    report = most_telling(reports) or reports[0]  # an unexpected error: a relaunch may not meet it again
    return TrainFailed(
        f"train rank {report.get('rank')} failed: {report.get('type')}: {report.get('message', '')}\n{failure}",
        retryable=True,
    )


def starting_ranks(seconds: float) -> str:
    """The heartbeat's line before the ranks' first (models/ranks/harness.py: each imports torch, then deepspeed)."""
    return f"train: starting the ranks, {seconds:.0f} s since the launch (each imports torch and deepspeed first)"


def ranks_silent(seconds: float) -> str:
    """The heartbeat's line when the running ranks have said nothing for a while."""
    return f"train: the ranks are working, no line from them for {seconds:.0f} s"


@task(name="train-job", cache_policy=NO_CACHE)
def run_train_job(
    job: TrainJobFile, job_path: Path, num_ranks: int, launcher: str, config_name: str, nodes: Nodes | None = None
) -> dict[str, Any]:
    """Launch the ranks (resuming from the latest checkpoint), stream their output, track progress; return the summary.

    `num_ranks` per node; with `nodes` over several, this is node 0 (rank 0, which reports progress, is here).
    """
    logger = get_run_logger()
    nodes = nodes or Nodes()
    command, env = rank_command(
        "models.train", ["--job", str(job_path)], num_ranks=num_ranks, launcher=launcher, nodes=nodes
    )
    write_job(job, job_path, kept=lambda: kept_checkpoint(Path(job.out_dir) / CHECKPOINTS), resume=RESUME)
    logger.info("launching %d rank(s) on %d node(s): %s", num_ranks * nodes.nnodes, nodes.nnodes, " ".join(command))
    beat = Heartbeat(logger.info)  # a line every ~10 s of silence: the ranks' start-up, a long checkpoint or eval
    beat.doing(starting_ranks)
    artifact = progress_artifact(progress=0.0, key=artifact_key("train", config_name), description="train: starting")
    first: tuple[int, int, float] | None = (
        None  # steps, tokens and time at the start of this launch (a resume starts past 0)
    )
    last = 0.0
    held_out: float | None = None
    best: dict[str, Any] | None = None  # the last TRAIN_BEST: the best held-out eval so far, exported to best/

    def on_message(message: Message) -> None:
        nonlocal first, last, held_out, best
        beat.doing(ranks_silent)
        if message.kind is TRAIN_EVAL:
            held_out = message.values["acceptance_length"]
            return
        if message.kind is TRAIN_BEST:
            best = message.values
            return
        if message.kind is not TRAIN.progress:
            return  # a checkpoint or the end: in the log already
        step, total, tokens = (message.values[k] for k in ("step", "total", "tokens"))
        now = time.monotonic()
        if first is None:
            first = (step, tokens, now)
        if now - last < 2 and step != total:
            return
        last = now
        step0, tokens0, t0 = first
        rate = (tokens - tokens0) / max(1e-9, now - t0)
        eta = (total - step) * (now - t0) / (step - step0) if step > step0 else None
        text = (
            f"train: step {step:,}/{total:,}, {tokens:,} tokens, {rate:,.0f} tok/s"
            + (f", ETA {eta / 60:.1f} min" if eta is not None else "")
            + (f", held-out acceptance length {held_out:.2f}" if held_out is not None else "")
            + (f" (best {best['acceptance_length']:.2f} at step {best['step']:,})" if best is not None else "")
        )
        update_progress_artifact(artifact, progress=round(100.0 * step / max(1, total), 2), description=text)
        beat.log(text)

    def log(line: str) -> None:  # a line of the ranks': their next silence counts from here
        beat.doing(ranks_silent)
        beat.log(line)

    # run=run_job: this module's, the seam where tests/flows/test_train_flow.py scripts the ranks
    with beat:
        follow_job(command, protocol=TRAIN, env=env, log=log, on_message=on_message, failure=job_failure, run=run_job)
    summary = json.loads((Path(job.out_dir) / TRAIN_SUMMARY).read_text())
    done = f"train: done, {summary['steps']:,} steps; the last step's draft in {summary['final']}"
    if "best" in summary:  # models/train/best.py: the best held-out eval and its draft in best/
        done += "; " + describe(summary["best"])
    update_progress_artifact(artifact, progress=100.0, description=done)  # rank 0 logged the same words
    return summary


@task(name="train-report", cache_policy=NO_CACHE)
def report_training(draft_dir: Path, config_name: str, eval_steps: int | None = None) -> dict[str, Any]:
    """Plot metrics.jsonl to draft/training.png; publish the eval table and a markdown report as artifacts.

    eval_steps: the eval stage's num_steps; the report then shows the training-time estimate at that
    many steps beside the measured value of an eval.json newer than this training (else "not measured yet").
    """
    metrics = load_metrics(draft_dir / METRICS)
    png = plot_training(metrics, draft_dir / TRAINING_PLOT)
    rows = eval_table(metrics)
    if rows:
        create_table_artifact(
            table=rows,
            key=artifact_key("train-eval", config_name),
            description="Held-out TTT metrics during training (acceptance length simulated over the draft steps)",
        )
    measured = measured_acceptance(draft_dir, eval_steps) if eval_steps is not None else None
    create_markdown_artifact(
        markdown=report_markdown(
            metrics,
            png,
            draft_dir=draft_dir / FINAL,
            eval_steps=eval_steps,
            measured=measured,
            best=trained_best(draft_dir),
        ),
        key=artifact_key("train-report", config_name),
        description="EAGLE-3 draft training report",
    )
    get_run_logger().info("training report: %s (plot %s)", draft_dir / METRICS, png)
    return {"plot": str(png), "evals": rows}


def trained_best(draft_dir: Path) -> dict | None | Literal[False]:
    """train_summary.json's "best" (None: no held-out evals), or False when no summary says (none, or written before
    best/ existed)."""
    try:
        summary = json.loads((draft_dir / TRAIN_SUMMARY).read_text())
    except (OSError, ValueError):
        return False
    return summary["best"] if isinstance(summary, dict) and "best" in summary else False


def measured_acceptance(draft_dir: Path, num_steps: int) -> float | None:
    """The trained draft's measured acceptance length in draft/eval.json, when that eval ran at num_steps
    after this training wrote train_summary.json (an older eval measured an older draft); else None."""
    eval_file, summary = draft_dir / EVAL_REPORT, draft_dir / TRAIN_SUMMARY
    if not eval_file.is_file() or (summary.is_file() and eval_file.stat().st_mtime < summary.stat().st_mtime):
        return None
    try:
        report = json.loads(eval_file.read_text())
    except (OSError, ValueError):
        return None
    if report.get("num_steps") != num_steps:
        return None
    if "trained" in report:  # the HF backend's per-round mean
        return float(report["trained"]["acceptance_length"])
    engine = (report.get("engine") or {}).get("overall") or {}
    return (
        None if engine.get("per_round") is None else float(engine["per_round"])
    )  # the same convention, engine-measured
