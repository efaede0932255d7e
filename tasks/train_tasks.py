"""Prefect tasks of the train stage: run the DeepSpeed training job, publish its metrics and report.

A failed job raises what its failing rank reported in its `TRAIN_ERROR` line (models/train.py): a
`WriteFailed` or a `CheckpointMismatch` with the rank's own one-line message, or `TrainFailed`.
Only a `TrainFailed` that is `retryable` (a rank that crashed or was killed without a final
verdict) is worth a Prefect retry (`retry_train_job`); the retry resumes from the last checkpoint.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import (create_markdown_artifact, create_progress_artifact, create_table_artifact,
                               update_progress_artifact)
from prefect.cache_policies import NO_CACHE

from models.train import ERROR_MARK, RESUME, CheckpointMismatch, kept_checkpoint
from models.write_failure import WriteFailed, is_write_error
from tasks.generate_tasks import artifact_key
from tasks.launch import RankFailure, rank_command, run_job
from tasks.train_report import eval_table, load_metrics, plot_training, report_markdown

PROGRESS = re.compile(r"TRAIN_PROGRESS step=(\d+) total=(\d+) tokens=(\d+)")
EVAL = re.compile(r"TRAIN_EVAL step=(\d+) acceptance_length=([\d.]+)")
SUMMARY = "train_summary.json"
PLOT = "training.png"
_VERDICT = {"write_failed": 0, "damaged": 1, "invalid": 2, "error": 3}  # the most telling report wins


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
    at = line.find(ERROR_MARK + " {")
    if at < 0:
        return None
    try:
        report = json.loads(line[at + len(ERROR_MARK) + 1:])
    except ValueError:
        return None  # cut short: an ordinary line
    return report if isinstance(report, dict) else None


def job_failure(reports: list[dict[str, Any]], failure: RankFailure) -> Exception:
    """The exception a failed training job raises, from its ranks' TRAIN_ERROR reports (none: killed)."""
    if not reports:
        return TrainFailed(f"the training job died without reporting an error (a rank killed: out of memory, "
                           f"kill -9, a lost node?); retrying resumes from the last checkpoint. {failure}", retryable=True)
    report = min(reports, key=lambda r: _VERDICT.get(r.get("kind"), len(_VERDICT)))
    kind, message = report.get("kind"), report.get("message", "")
    if kind == "write_failed":
        code, text = report.get("errno"), report.get("error", "")
        cause = OSError(code, text) if code is not None else OSError(text)
        error = WriteFailed(report["path"], cause, kept=report.get("kept", ""), resume=report.get("resume", ""))
        error.args = (message,)  # the rank's words: the free space it saw when the write failed
        return error
    if report.get("type") == CheckpointMismatch.__name__:
        return CheckpointMismatch(message)
    if kind in ("invalid", "damaged"):
        return TrainFailed(f"train rank {report.get('rank')}: {message}", retryable=False)
    return TrainFailed(f"train rank {report.get('rank')} failed: {report.get('type')}: {message}\n{failure}", retryable=True)


@task(name="train-job", cache_policy=NO_CACHE)
def run_train_job(job: dict[str, Any], job_path: Path, num_ranks: int, launcher: str, config_name: str) -> dict[str, Any]:
    """Launch the ranks (resuming from the latest checkpoint), stream their output, track progress; return the summary."""
    logger = get_run_logger()
    try:
        job_path.parent.mkdir(parents=True, exist_ok=True)
        job_path.write_text(json.dumps(job, indent=2, default=str))
    except OSError as e:
        if not is_write_error(e):
            raise
        raise WriteFailed(job_path, e, kept=kept_checkpoint(Path(job["out_dir"]) / "checkpoints"), resume=RESUME) from None
    command, env = rank_command("models.train", ["--job", str(job_path)], num_ranks=num_ranks, launcher=launcher)
    logger.info("launching %d rank(s): %s", num_ranks, " ".join(command))
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("train", config_name), description="train: starting")
    state = {"started": time.monotonic(), "first": None, "last": 0.0, "eval": None}
    reports: list[dict[str, Any]] = []

    def on_line(line: str) -> None:
        report = error_line(line)
        if report is not None:
            reports.append(report)
            return  # the rank's next line says it in words
        match = PROGRESS.search(line)
        if not match:
            found = EVAL.search(line)
            if found:
                state["eval"] = float(found.group(2))
            logger.info(line)
            return
        step, total, tokens = map(int, match.groups())
        now = time.monotonic()
        if state["first"] is None:  # steps and tokens at the start of this launch (a resume starts past 0)
            state["first"] = (step, tokens, now)
        if now - state["last"] < 2 and step != total:
            return
        state["last"] = now
        step0, tokens0, t0 = state["first"]
        rate = (tokens - tokens0) / max(1e-9, now - t0)
        eta = (total - step) * (now - t0) / (step - step0) if step > step0 else None
        text = (f"train: step {step:,}/{total:,}, {tokens:,} tokens, {rate:,.0f} tok/s"
                + (f", ETA {eta / 60:.1f} min" if eta is not None else "")
                + (f", held-out acceptance length {state['eval']:.2f}" if state["eval"] is not None else ""))
        update_progress_artifact(artifact, progress=round(100.0 * step / max(1, total), 2), description=text)
        logger.info(text)

    try:
        run_job(command, env=env, on_line=on_line)
    except RankFailure as failure:
        raise job_failure(reports, failure) from None
    summary = json.loads((Path(job["out_dir"]) / SUMMARY).read_text())
    update_progress_artifact(artifact, progress=100.0, description=f"train: done, {summary['steps']:,} steps; draft in {summary['final']}")
    return summary


@task(name="train-report", cache_policy=NO_CACHE)
def report_training(draft_dir: Path, config_name: str) -> dict[str, Any]:
    """Plot metrics.jsonl to draft/training.png; publish the eval table and a markdown report as artifacts."""
    metrics = load_metrics(draft_dir / "metrics.jsonl")
    png = plot_training(metrics, draft_dir / PLOT)
    rows = eval_table(metrics)
    if rows:
        create_table_artifact(table=rows, key=artifact_key("train-eval", config_name),
                              description="Held-out TTT metrics during training (acceptance length simulated over the draft steps)")
    create_markdown_artifact(markdown=report_markdown(metrics, png, draft_dir=draft_dir / "final"),
                             key=artifact_key("train-report", config_name), description="EAGLE-3 draft training report")
    get_run_logger().info("training report: %s (plot %s)", draft_dir / "metrics.jsonl", png)
    return {"plot": str(png), "evals": rows}
