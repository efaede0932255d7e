"""Prefect tasks of the generate stage: one per dataset, plus the run summary artifact."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import acreate_progress_artifact, acreate_table_artifact, aupdate_progress_artifact
from prefect.cache_policies import NO_CACHE

from models.common.jobs import GenerateJob
from settings.dataset import RowFormat
from settings.layout import RunLayout
from settings.server import ServerSettings
from tasks.datasets import HubDataset, OnBadRow, load_dataset
from tasks.generate.loop import generate_dataset
from tasks.generate.passthrough import PassthroughReport, copy_passthrough
from tasks.generate.prompts import default_stop_ids
from tasks.generate.provenance import Provenance, declared_engine, reported_engine, settle, target_fingerprint
from tasks.generate.report import GenerateReport, Progress
from tasks.responses.rejects import replace_stage_rejects
from tasks.runtime.artifacts import artifact_key
from tasks.serving.client import RetryPolicy, auth_hint
from tasks.serving.errors import ServerOutage
from tasks.serving.pool import ServerPool


async def _retry_on_outage(task: Any, task_run: Any, state: Any) -> bool:
    """Retry a dataset task only when the server was unreachable; bad data or bugs fail at once."""
    try:
        await state.aresult()
    except ServerOutage:
        return True
    except BaseException:
        return False
    return False


@task(
    name="generate-dataset",
    task_run_name="generate {name}",
    cache_policy=NO_CACHE,
    retry_condition_fn=_retry_on_outage,
)
async def generate_responses(
    name: str,
    source: Path | HubDataset,
    on_bad_row: OnBadRow,
    target_path: str,
    trust_remote_code: bool,
    settings: GenerateJob,
    layout: RunLayout,
    pool: ServerPool,
    row_format: RowFormat,
) -> GenerateReport:
    """Generate one dataset's responses through the run's servers (SGLang or vLLM); resumes from its checkpoints."""
    logger = get_run_logger()
    loaded = await asyncio.to_thread(load_dataset, source, "generate", row_format=row_format, on_bad_row=on_bad_row)
    # This load's bad rows replace the last load's: a row fixed in the file is used from now on.
    await asyncio.to_thread(replace_stage_rejects, loaded.rejects, layout.rejects(name), "load")
    if loaded.rejects:
        logger.warning("%s: %d bad row(s) sent to %s", name, len(loaded.rejects), layout.rejects(name))

    from models.target.tokenizer import load_tokenizer

    tokenizer = await asyncio.to_thread(load_tokenizer, target_path, trust_remote_code)
    if not settings.sampling_params.get("stop_token_ids"):
        stop = default_stop_ids(tokenizer)
        settings = settings.model_copy(update={"sampling_params": {**settings.sampling_params, "stop_token_ids": stop}})
    artifact_id = await acreate_progress_artifact(
        progress=0.0, key=artifact_key("generate", name), description=f"{name}: starting"
    )

    async def on_progress(p: Progress) -> None:
        await aupdate_progress_artifact(artifact_id, progress=round(p.percent, 2), description=p.line())

    report = await generate_dataset(
        loaded.rows,
        pool=pool,
        tokenizer=tokenizer,
        layout=layout,
        source=loaded.path,  # the hf: path of a Hub dataset
        settings=settings,
        vocab_size=len(tokenizer),
        on_progress=on_progress,
        logger=logger,
    )
    await aupdate_progress_artifact(
        artifact_id,
        progress=100.0,
        description=f"{name}: {report.status}, {report.responses:,} responses, "
        f"{report.completion_tokens:,} completion tokens",
    )
    causes = ", ".join(f"{cause} {n}" for cause, n in report.reject_causes.items())
    turns = (
        f" in {report.conversations:,} conversations ({report.ended_conversations:,} ended early by an answer cut at "
        "the length limit or a rejected turn)"
        if report.conversations is not None
        else ""
    )
    logger.info(
        "%s: %s — %d responses%s (%d new), %d rejects of prompts%s, %d completion tokens, %d wasted by aborts",
        name,
        report.status,
        report.responses,
        turns,
        report.new_responses,
        report.rejects,
        f" (rejects by cause: {causes})" if causes else "",
        report.completion_tokens,
        report.wasted_tokens,
    )
    return report


def server_pool(server: ServerSettings, logger: Any, *, max_concurrency: int | None = None) -> ServerPool:
    """The pool of the run's servers (`server.urls`, the launched replicas, or `server.url`), one for every dataset."""
    retry = RetryPolicy(outage_window_s=server.outage_window_s)
    configured: int = getattr(server, "max_concurrency", 64)  # the run config's server settings have one
    return ServerPool(
        server.endpoints,
        max_concurrency=max_concurrency or configured,
        retry=retry,
        request_timeout_s=server.request_timeout_s,
        health_timeout_s=server.health_timeout_s,
        api_key=server.api_key(),
        auth_hint=auth_hint(server),
        max_input_len=server.max_req_input_len,
        logger=logger,
        engine=server.engine,
    )


@task(name="generated-by", cache_policy=NO_CACHE)
async def check_generated_by(
    layout: RunLayout, pool: ServerPool, *, engine: str, launch: str, command: list[str] | None, target_path: str
) -> Provenance:
    """Refuse to continue a run made by another engine or target (tasks/generate/provenance.py OtherEngine), and
    record this one's where the run has no record yet (adopting a run written before records, with a log line).
    Run by the pool before its first request (ServerPool.before_first_request): the server answers by then."""
    logger = get_run_logger()
    said = await reported_engine(pool.servers[0].client, engine)
    kind, version, served = said or (declared_engine(launch, engine, command) or engine, None, None)
    fingerprint = await asyncio.to_thread(target_fingerprint, target_path)
    current = Provenance(kind, target_path, fingerprint, version, served, launch)
    return await asyncio.to_thread(settle, layout, current, logger)


@task(name="copy-passthrough", task_run_name="passthrough {name}", cache_policy=NO_CACHE)
def copy_passthrough_task(
    name: str, source: Path | HubDataset, on_bad_row: OnBadRow, layout: RunLayout, row_format: RowFormat
) -> PassthroughReport:
    """Validate a passthrough dataset and copy it into the run."""
    report = copy_passthrough(name, source, layout.passthrough(name), layout.rejects(name), on_bad_row, row_format)
    get_run_logger().info(
        "%s: %d passthrough rows %s (%d rejects, %d duplicates)",
        name,
        report.rows,
        "copied" if report.copied else "already in the run",
        report.rejects,
        report.duplicates,
    )
    return report


@task(name="generate-servers", cache_policy=NO_CACHE)
async def publish_server_table(rows: list[dict[str, Any]], config_name: str) -> None:
    """Per-server figures of the generate stage (throughput, busy share, failed requests) as a table artifact."""
    await acreate_table_artifact(
        table=rows,
        key=artifact_key("generate-servers", config_name),
        description="Generate stage, per server: responses, completion tokens, tokens/s over the stage, share of the "
        "time busy, requests that failed there and went to another server",
    )


@task(name="generate-summary", cache_policy=NO_CACHE)
async def publish_generate_summary(run_dir: Path, config_name: str) -> list[dict[str, Any]]:
    """The per-dataset table of the whole run as a Prefect table artifact (same figures as `eagle3 stats`)."""
    from tasks.responses.stats import collect_stats, stats_rows

    rows = stats_rows(await asyncio.to_thread(collect_stats, run_dir))
    await acreate_table_artifact(
        table=rows, key=artifact_key("generate-summary", config_name), description=f"Generate stage of {run_dir}"
    )
    return rows
