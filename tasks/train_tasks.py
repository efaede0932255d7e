"""Prefect tasks of the train stage: run the DeepSpeed training job, publish its metrics and report."""

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

from tasks.generate_tasks import artifact_key
from tasks.launch import rank_command, run_job
from tasks.train_report import eval_table, load_metrics, plot_training, report_markdown

PROGRESS = re.compile(r"TRAIN_PROGRESS step=(\d+) total=(\d+) tokens=(\d+)")
EVAL = re.compile(r"TRAIN_EVAL step=(\d+) acceptance_length=([\d.]+)")
SUMMARY = "train_summary.json"
PLOT = "training.png"


@task(name="train-job", cache_policy=NO_CACHE)
def run_train_job(job: dict[str, Any], job_path: Path, num_ranks: int, launcher: str, config_name: str) -> dict[str, Any]:
    """Launch the ranks (resuming from the latest checkpoint), stream their output, track progress; return the summary."""
    logger = get_run_logger()
    job_path.parent.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(job, indent=2, default=str))
    ds_path = Path(job["out_dir"]) / "ds_config.json"  # the DeepSpeed config as run, next to the checkpoints
    ds_path.parent.mkdir(parents=True, exist_ok=True)
    ds_path.write_text(json.dumps(job["ds_config"], indent=2))
    command, env = rank_command("models.train", ["--job", str(job_path)], num_ranks=num_ranks, launcher=launcher)
    logger.info("launching %d rank(s): %s", num_ranks, " ".join(command))
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("train", config_name), description="train: starting")
    state = {"started": time.monotonic(), "first": None, "last": 0.0, "eval": None}

    def on_line(line: str) -> None:
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

    run_job(command, env=env, on_line=on_line)
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
