"""Prefect tasks of the capture stage: plan the disk, run the DeepSpeed job, index the shards."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from models.hidden_shards import iter_shard_index, write_index
from tasks.capture_plan import CapturePlan, TargetShape, check_fits, human_bytes, plan_capture
from tasks.generate_tasks import artifact_key
from tasks.launch import rank_command, run_job

PROGRESS = re.compile(r"CAPTURE_PROGRESS rank=(\d+) done=(\d+) total=(\d+) tokens=(\d+)")
METADATA = "metadata.json"


def captured_tokens(out_dir: Path) -> int:
    """Tokens already in complete shards (headers only)."""
    return sum(row["length"] for row in iter_shard_index(out_dir)) if out_dir.is_dir() else 0


def last_throughput(out_dir: Path) -> float | None:
    """Tokens/s of the previous capture into `out_dir`, if one finished."""
    meta = out_dir / METADATA
    return json.loads(meta.read_text()).get("tokens_per_s") if meta.is_file() else None


@task(name="plan-capture", cache_policy=NO_CACHE)
def plan_capture_task(
    records_dirs: list[Path], out_dir: Path, shape: TargetShape, dtype: str, margin: float, max_tokens: int | None
) -> CapturePlan:
    """The disk plan; refuses (DiskTooSmall) a capture that cannot fit."""
    plan = plan_capture(
        records_dirs, out_dir, shape, dtype, margin=margin, max_tokens=max_tokens,
        tokens_done=captured_tokens(out_dir), tokens_per_s=last_throughput(out_dir),
    )
    get_run_logger().info(
        "capture plan: %s tokens to capture (%s done), %s needed (%s/token), %s free in %s%s",
        f"{plan.tokens_todo:,}", f"{plan.tokens_done:,}", human_bytes(plan.bytes_needed), f"{plan.bytes_per_token:,} B",
        human_bytes(plan.free_bytes), out_dir,
        f", about {plan.est_seconds / 3600:.1f} h at the last measured speed" if plan.est_seconds else "",
    )
    check_fits(plan)
    return plan


@task(name="capture-job", cache_policy=NO_CACHE)
def run_capture_job(job: dict[str, Any], job_path: Path, num_ranks: int, launcher: str, config_name: str) -> float:
    """Launch the ranks, stream their output into the flow-run log, track progress; return tokens/s."""
    logger = get_run_logger()
    job_path.parent.mkdir(parents=True, exist_ok=True)
    job_path.write_text(json.dumps(job, indent=2, default=str))
    command, env = rank_command("models.capture", ["--job", str(job_path)], num_ranks=num_ranks, launcher=launcher)
    logger.info("launching %d rank(s): %s", num_ranks, " ".join(command))
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("capture", config_name), description="capture: starting")
    ranks: dict[int, tuple[int, int, int]] = {}
    last_update = 0.0
    started = time.monotonic()

    def on_line(line: str) -> None:
        nonlocal last_update
        match = PROGRESS.search(line)
        if not match:
            logger.info(line)
            return
        rank, done, total, tokens = map(int, match.groups())
        ranks[rank] = (done, total, tokens)
        if time.monotonic() - last_update >= 2 or done == total:
            last_update = time.monotonic()
            done_all = sum(d for d, _, _ in ranks.values())
            total_all = sum(t for _, t, _ in ranks.values())
            tokens_all = sum(k for _, _, k in ranks.values())
            percent = 100.0 * done_all / total_all if total_all else 100.0
            rate = tokens_all / max(1e-9, time.monotonic() - started)
            line = f"capture: {done_all:,}/{total_all:,} samples, {tokens_all:,} tokens, {rate:,.0f} tok/s ({len(ranks)} rank(s) reporting)"
            update_progress_artifact(artifact, progress=round(percent, 2), description=line)
            logger.info(line)

    run_job(command, env=env, on_line=on_line)
    tokens = sum(k for _, _, k in ranks.values())
    update_progress_artifact(artifact, progress=100.0, description=f"capture: done, {tokens:,} tokens this run")
    return tokens / max(1e-9, time.monotonic() - started)


@task(name="index-hidden", cache_policy=NO_CACHE)
def index_hidden_states(out_dir: Path, metadata: dict[str, Any], tokens_per_s: float, config_name: str) -> dict[str, Any]:
    """hidden/index.parquet (id, dataset, shard, offset, length) and hidden/metadata.json from shard headers."""
    out_dir.mkdir(parents=True, exist_ok=True)
    write_index(out_dir)  # the ranks wrote it too; again here so an empty or resumed capture has one
    rows = list(iter_shard_index(out_dir))
    summary = {**metadata, "samples": len(rows), "tokens": int(sum(r["length"] for r in rows)), "tokens_per_s": tokens_per_s}
    tmp = out_dir / f".{METADATA}.tmp"
    tmp.write_text(json.dumps(summary, indent=2))
    tmp.replace(out_dir / METADATA)
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
