"""Prefect artifact keys: every stage names its progress bars and tables the same way; a sync task's progress bar;
the pipeline run's own summary of its stages."""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

from prefect import get_client, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowFilter,
    FlowFilterId,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.sorting import ArtifactSort, FlowRunSort
from prefect.runtime import flow_run
from prefect.utilities.urls import url_for


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) from free-form parts."""
    return "-".join(re.sub(r"[^a-z0-9]+", "-", p.lower()).strip("-") for p in parts if p)


def progress_artifact(progress: float, key: str, description: str) -> UUID:
    """`create_progress_artifact` from a sync task: the new artifact's id, for `update_progress_artifact`.

    Prefect types the call `UUID | Coroutine` (called from async code it is `acreate_progress_artifact`'s
    coroutine); an async task awaits `acreate_progress_artifact` itself.
    """
    artifact_id = create_progress_artifact(progress=progress, key=key, description=description)
    if not isinstance(artifact_id, UUID):
        artifact_id.close()  # not awaited: no "never awaited" warning on top of the error
        raise TypeError(
            f"create_progress_artifact for {key!r} returned a coroutine: it runs in async code, "
            "which awaits acreate_progress_artifact instead"
        )
    return artifact_id


def stage_headline(stage: str, result: Any) -> str:
    """What a finished stage of the pipeline made, in a phrase (its subflow's return value); "" for a result of
    another shape (a report, not a check: the run goes on)."""
    try:
        return _headline(stage, result)
    except (KeyError, TypeError, AttributeError):
        return ""


def _headline(stage: str, result: Any) -> str:
    if stage == "generate":
        return f"{sum(r.get('responses') or 0 for r in result):,} responses"
    if stage == "records":
        return f"{sum(r['records'] for r in result):,} records, {sum(r['tokens'] for r in result):,} tokens"
    if stage == "capture":
        return f"{result['samples']:,} samples, {result['tokens']:,} tokens"
    if stage == "train":
        return f"{result['steps']:,} steps"
    if stage == "eval":
        measured = [f"{result['trained']['acceptance_length']:.3f} in-process"] if "trained" in result else []
        if result.get("engine"):
            measured.append(f"{result['engine']['overall']['per_round']:.3f} per verify round in the engine")
        return "acceptance length " + ", ".join(measured) if measured else ""
    return ""


@dataclass(frozen=True)
class StageRun:
    """A stage's subflow run of the pipeline run, and the keys of the artifacts made in it."""

    stage: str
    flow_run_id: UUID
    name: str
    state: str
    artifact_keys: list[str]


def stage_runs(pipeline_run_id: UUID) -> list[StageRun]:
    """The subflow runs of a pipeline run, by start, each with its artifacts' keys (read from the Prefect API)."""
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline_run_id])),
            sort=FlowRunSort.START_TIME_ASC,
        )
        if not runs:
            return []
        flows = {
            f.id: f.name
            for f in client.read_flows(flow_filter=FlowFilter(id=FlowFilterId(any_=[r.flow_id for r in runs])))
        }
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[r.id for r in runs])),
            sort=ArtifactSort.KEY_ASC,
            limit=200,
        )
    keys: dict[UUID, list[str]] = {}
    for a in artifacts:
        if a.key and a.flow_run_id and a.key not in keys.setdefault(a.flow_run_id, []):
            keys[a.flow_run_id].append(a.key)
    return [StageRun(flows.get(r.flow_id, "?"), r.id, r.name, r.state_name or "?", keys.get(r.id, [])) for r in runs]


def pipeline_summary_markdown(
    title: str, stages: Sequence[str], runs: list[StageRun], headlines: dict[str, str]
) -> str:
    """The pipeline run's own report: a row per chosen stage with its subflow run (a link where the UI's address is
    known), its state, what it made, and its artifacts' keys (they are on the subflow run's Artifacts tab)."""
    by_stage = {r.stage: r for r in runs}
    lines = [
        f"# {title}",
        "",
        "Each stage is a subflow run; its progress bars, tables and reports are on that run's *Artifacts* tab.",
        "",
        "| stage | subflow run | state | made | artifacts |",
        "| --- | --- | --- | --- | --- |",
    ]
    for stage in stages:
        run = by_stage.get(stage)
        if run is None:
            lines.append(f"| {stage} | not started | | | |")
            continue
        url = url_for("flow-run", obj_id=run.flow_run_id)
        link = f"[{run.name}]({url})" if url else f"{run.name} (`{run.flow_run_id}`)"
        keys = ", ".join(f"`{k}`" for k in run.artifact_keys)
        lines.append(f"| {stage} | {link} | {run.state} | {headlines.get(stage, '')} | {keys} |")
    return "\n".join(lines) + "\n"


@task(name="pipeline-summary", cache_policy=NO_CACHE)
def publish_pipeline_summary(config_name: str, stages: Sequence[str], headlines: dict[str, str]) -> None:
    """The pipeline-summary markdown artifact on the pipeline's own flow run (the stages' artifacts are on their
    subflow runs), a new version after each stage; a failure to write it is logged, never fatal to the run."""
    pipeline_run_id = UUID(flow_run.get_id())
    try:
        markdown = pipeline_summary_markdown(
            f"pipeline {config_name}: {', '.join(stages)}", stages, stage_runs(pipeline_run_id), headlines
        )
        create_markdown_artifact(
            markdown=markdown,
            key=artifact_key("pipeline-summary", config_name),
            description="The pipeline run's stages: their subflow runs, states and artifacts",
        )
    except Exception as e:  # noqa: BLE001 - a report, not a stage: the run goes on
        get_run_logger().warning("pipeline summary artifact not written: %s", e)
