"""The pipeline run's own summary artifact (flows/pipeline.py, tasks/runtime/artifacts.py): the stages' subflow runs,
their states and artifacts, on the pipeline's flow run, whose Artifacts tab was empty before (issue 50)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prefect import flow, get_client
from prefect.artifacts import acreate_table_artifact, create_table_artifact
from prefect.client.schemas.filters import (
    ArtifactFilter,
    ArtifactFilterFlowRunId,
    FlowRunFilter,
    FlowRunFilterParentFlowRunId,
)
from prefect.client.schemas.sorting import ArtifactSort

import flows.pipeline as pipeline_module
from tasks.runtime.artifacts import artifact_key, stage_headline
from tests.run_configs import write_run_config

RESULTS = {
    "generate": [{"dataset": "B1_x", "responses": 3}, {"dataset": "B2_y", "responses": 4}],
    "records": [{"records": 7, "tokens": 1234}],
    "capture": {"samples": 7, "tokens": 1234},
    "train": {"steps": 12, "tokens": 5000, "plot": "p.png"},
    "eval": {"trained": {"acceptance_length": 1.5}, "engine": {"overall": {"per_round": 1.5}}},
}
HEADLINES = {
    "generate": "7 responses",
    "records": "7 records, 1,234 tokens",
    "capture": "7 samples, 1,234 tokens",
    "train": "12 steps",
    "eval": "acceptance length 1.500 in-process, 1.500 per verify round in the engine",
}


def fake_stages(monkeypatch, failing: str | None = None) -> None:
    """Each stage's subflow replaced by one of the same flow name that writes one table artifact (as a stage's
    report) and returns a result of the stage's shape, or raises at `failing`."""

    def make(stage: str):
        def body(config_path: str, *args):
            create_table_artifact(table=[{"n": 1}], key=artifact_key(f"{stage}-report", Path(config_path).stem))
            if stage == failing:
                raise RuntimeError(f"{stage} broke")
            return RESULTS[stage]

        if stage == "generate":  # the pipeline runs generate's coroutine (an async flow)

            async def generate(config_path: str, retry_rejects: bool = False):
                await acreate_table_artifact(
                    table=[{"n": 1}], key=artifact_key("generate-report", Path(config_path).stem)
                )
                return RESULTS[stage]

            return flow(name=stage, flow_run_name=f"{stage} {{config_path}}")(generate)
        return flow(name=stage, flow_run_name=f"{stage} {{config_path}}")(body)

    for stage, attr in zip(pipeline_module.STAGES, ("generate", "records", "capture", "train", "evaluate")):
        monkeypatch.setattr(pipeline_module, attr, make(stage))


@pytest.fixture
def config_path(tmp_path) -> str:
    data = tmp_path / "rows.jsonl"
    data.write_text('{"id": "a", "prompt": "hi"}\n')
    path = write_run_config(
        tmp_path / "sum-cfg.yaml",
        tmp_path / "run",
        tmp_path / "target",
        [{"name": "B1_x", "kind": "generate", "path": str(data)}],
        server={"url": "http://127.0.0.1:9", "launch": "none"},
    )
    return str(path)


async def read_back(pipeline_run_id):
    """The pipeline run's artifacts (newest first) and its subflow runs by flow-run name."""
    async with get_client() as client:
        mine = await client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[pipeline_run_id])),
            sort=ArtifactSort.CREATED_DESC,
        )
        subflows = await client.read_flow_runs(
            flow_run_filter=FlowRunFilter(parent_flow_run_id=FlowRunFilterParentFlowRunId(any_=[pipeline_run_id]))
        )
    return mine, {r.name.split()[0]: r for r in subflows}


def row(markdown: str, stage: str) -> list[str]:
    [line] = [line for line in markdown.splitlines() if line.startswith(f"| {stage} |")]
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_the_pipeline_run_carries_a_summary_of_its_stages(monkeypatch, config_path):
    fake_stages(monkeypatch)
    state = pipeline_module.pipeline(config_path, skip_checks=True, return_state=True)
    assert state.is_completed()
    mine, subflows = asyncio.run(read_back(state.state_details.flow_run_id))
    # one version after each stage, all on the pipeline's own flow run (the stages' reports are on theirs)
    assert [a.key for a in mine] == ["pipeline-summary-sum-cfg"] * 5
    assert all(a.type == "markdown" for a in mine)
    latest = mine[0].data
    assert "# pipeline sum-cfg: generate, records, capture, train, eval" in latest
    for stage in pipeline_module.STAGES:
        run = subflows[stage]
        name, link_state, made, keys = row(latest, stage)[1], row(latest, stage)[2], *row(latest, stage)[3:]
        assert f"{stage} {config_path}" in name and str(run.id) in name  # a link to (or the id of) the subflow run
        assert link_state == "Completed"
        assert made == HEADLINES[stage]
        assert keys == f"`{stage}-report-sum-cfg`"
    first = mine[-1].data  # after generate only: the later stages not started yet
    assert row(first, "generate")[2] == "Completed"
    assert row(first, "records")[1:] == ["not started", "", "", ""]


def test_a_failed_stage_is_in_the_summary(monkeypatch, config_path):
    fake_stages(monkeypatch, failing="capture")
    state = pipeline_module.pipeline(config_path, skip_checks=True, return_state=True)
    assert state.is_failed()
    mine, _ = asyncio.run(read_back(state.state_details.flow_run_id))
    mine = [a for a in mine if a.key]  # (a failed run's state also makes an artifact with no key)
    assert [a.key for a in mine] == ["pipeline-summary-sum-cfg"] * 3  # after generate, records, and capture's failure
    latest = mine[0].data
    assert row(latest, "records")[2:4] == ["Completed", "7 records, 1,234 tokens"]
    assert row(latest, "capture")[2:5] == ["Failed", "", "`capture-report-sum-cfg`"]
    assert row(latest, "train")[1] == "not started" and row(latest, "eval")[1] == "not started"


def test_a_result_of_another_shape_gives_no_headline():
    assert stage_headline("capture", {"samples": 1}) == ""
    assert stage_headline("eval", {"trained": {"acceptance_length": 2.0}}) == "acceptance length 2.000 in-process"
    assert stage_headline("eval", {}) == ""
