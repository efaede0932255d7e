"""The `generate` flow under a real (test) Prefect server against the simulated SGLang server."""

from __future__ import annotations

import asyncio
import json
from datetime import datetime, timezone
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.sorting import ArtifactSort

from emulators.sim import SimServer
from flows.capture import capture
from flows.generate import generate
from flows.records import records
from models.capture.shards import read_sample
from tasks.capture import plan as capture_plan
from tasks.capture.plan import DiskTooSmall
from tasks.responses.checkpoints import live_parts

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, url: str, target: Path, **extra) -> Path:
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": str(target)},
        "server": {"url": url, "max_concurrency": 4, "outage_window_s": 5, "health_timeout_s": 10},
        "sampling": {"max_new_tokens": 32, "temperature": 0.5},
        "generate": {"flush_every": 10, "log_interval_s": 0.2, "retries": 0},
        "datasets": [
            {"name": "A1_chat", "kind": "passthrough", "path": str(REPO / "data/samples/passthrough_chat.jsonl")},
            {
                "name": "B1_code",
                "kind": "generate",
                "path": str(REPO / "data/samples/gen_code.jsonl"),
                "token_budget": 300,
            },
            {"name": "B2_math", "kind": "generate", "path": str(REPO / "data/samples/gen_math.jsonl")},
        ],
        **extra,
    }
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


async def artifacts_by_key(since: datetime) -> dict[str, object]:
    """The newest artifact of each key created since `since`. The worker's one test server holds every test's
    artifacts, and a generate's keys name the dataset only: an engine test's generate, killed mid-run, leaves a
    generate-b1-code of its own short of 100 (and the server answers 200 artifacts at most: newest first)."""
    async with get_client() as client:
        newest_first = await client.read_artifacts(sort=ArtifactSort.CREATED_DESC)
    found: dict[str, object] = {}
    for artifact in newest_first:
        if artifact.key and artifact.created is not None and artifact.created >= since:
            found.setdefault(artifact.key, artifact)
    return found


@pytest.mark.multiprocess
def test_generate_records_capture_flows_publish_their_artifacts(tmp_path, tiny_target_dir, monkeypatch):
    since = datetime.now(timezone.utc)
    sim = dict(max_running=4, decode_s_per_token=0.0005, mean_len=12, vocab_size=2048, eos_token_id=1)
    with SimServer(**sim) as srv, SimServer(**sim) as other:  # two servers: one pool, a limit each
        config = write_config(tmp_path, srv.url, tiny_target_dir)
        settings = yaml.safe_load(config.read_text())
        settings["server"]["urls"] = [srv.url, other.url]
        config.write_text(yaml.safe_dump(settings))
        rows = asyncio.run(generate(str(config)))
        served = [srv.snapshot(), other.snapshot()]
    assert [s.max_in_flight <= 4 for s in served] == [True, True] and min(s.completed for s in served) >= 5

    run = tmp_path / "run"
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["server"]["urls"] == [srv.url, other.url] and saved["datasets"][1]["token_budget"] == 300
    by_name = {r["dataset"]: r for r in rows}
    assert by_name["B2_math"]["responses"] == 50  # every math prompt, hashed ids included
    b1 = by_name["B1_code"]
    assert 300 <= b1["completion_tokens"] <= 300 + 3 * 32 and b1["responses"] < 42
    passthrough = pq.read_table(run / "passthrough/A1_chat/part-000000.parquet")
    assert passthrough.num_rows == 32

    artifacts = asyncio.run(artifacts_by_key(since))
    assert artifacts["generate-b1-code"].type == "progress" and artifacts["generate-b1-code"].data == 100.0
    assert artifacts["generate-b2-math"].data == 100.0
    table = artifacts["generate-summary-cfg"]
    assert table.type == "table"
    assert "B1_code" in str(table.data) and "B2_math" in str(table.data)
    servers = json.loads(artifacts["generate-servers-cfg"].data)  # per-server throughput
    assert [r["server"] for r in servers] == [srv.url, other.url]
    assert [r["responses"] for r in servers] == [s.completed for s in served]
    assert sum(r["responses"] for r in servers) == sum(r["responses"] for r in rows if r["dataset"] != "A1_chat")

    report = {r["dataset"]: r for r in records(str(config))}
    assert report["A1_chat"]["records"] >= 32  # every conversation, some split per turn
    stops = sum(
        1
        for p in live_parts(run / "responses/B2_math")
        for f in pq.read_table(p).column("finish_reason").to_pylist()
        if f == "stop"
    )
    assert report["B2_math"]["records"] == stops  # length-finished responses left out
    assert (run / "records/token_counts.parquet").exists()
    artifacts = asyncio.run(artifacts_by_key(since))
    assert artifacts["records-report-cfg"].type == "table"
    assert "cover" in artifacts["records-vocab-cfg"].data

    # capture: refused up front when the disk is too small, then run on 2 CPU ranks
    usage = capture_plan.shutil.disk_usage(tmp_path)
    monkeypatch.setattr(capture_plan.shutil, "disk_usage", lambda p: usage._replace(free=1000))
    with pytest.raises(DiskTooSmall, match="capture.max_tokens"):
        capture(str(config))
    assert not (run / "jobs/capture.json").exists()  # nothing launched
    monkeypatch.undo()
    data = yaml.safe_load(config.read_text())
    data["capture"] = {"num_gpus": 2, "shard_tokens": 2000, "max_batch_tokens": 1024}
    config.write_text(yaml.safe_dump(data))
    hidden = capture(str(config))
    total_records = sum(r["records"] for r in report.values())
    assert hidden["samples"] == total_records and hidden["aux_layers"] == [1, 3, 4] and hidden["hidden_size"] == 128
    index = pq.read_table(run / "hidden/index.parquet").to_pylist()
    assert len({(r["dataset"], r["id"]) for r in index}) == len(index) == total_records
    sample = read_sample(run / "hidden" / index[0]["shard"], index[0]["offset"], index[0]["length"])
    assert sample["aux_hidden"].shape == (index[0]["length"], 3 * 128) and sample["last_hidden"].shape == (
        index[0]["length"],
        128,
    )
    assert asyncio.run(artifacts_by_key(since))["capture-cfg"].data == 100.0
    again = capture(str(config))  # resume: nothing left to capture, nothing duplicated
    assert again["samples"] == total_records


def test_a_bad_dataset_fails_the_flow_but_not_the_others(tmp_path, tiny_target_dir):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"prompt": 7}\n')
    with SimServer(max_running=4, decode_s_per_token=0.0005, mean_len=12, vocab_size=2048) as srv:
        config = write_config(tmp_path, srv.url, tiny_target_dir)
        data = yaml.safe_load(config.read_text())
        data["datasets"].append({"name": "B3_bad", "kind": "generate", "path": str(bad)})
        config.write_text(yaml.safe_dump(data))
        with pytest.raises(RuntimeError) as info:
            asyncio.run(generate(str(config)))
    message = str(info.value)
    assert "B3_bad" in message and "re-run the same command to resume" in message
    assert "line 2" in repr(info.value.__cause__)
    assert len(live_parts(tmp_path / "run/responses/B2_math")) >= 1  # the good datasets finished


def test_a_run_records_its_engine_adopts_an_older_run_and_refuses_another_engine(tmp_path, tiny_target_dir):
    """RUN_DIR/generated-by.json (tasks/generate/provenance.py): written by the first generate with what the server
    says it is; a run without one (from before it) is adopted; one made by another engine is refused, unchanged."""
    from settings.layout import RunLayout
    from tasks.generate.provenance import OtherEngine

    layout = RunLayout(tmp_path / "run")
    with SimServer(max_running=4, decode_s_per_token=0.0005, mean_len=12, vocab_size=2048) as srv:
        config = str(write_config(tmp_path, srv.url, tiny_target_dir))
        data = yaml.safe_load(Path(config).read_text())
        data["datasets"][2]["max_prompts"] = 10  # B2_math: 10 of its 50 prompts
        Path(config).write_text(yaml.safe_dump(data))
        asyncio.run(generate(config))
        first = json.loads(layout.generated_by.read_text())
        assert (first["engine"], first["engine_version"], first["adopted"]) == ("sim", "0.1.0-eagle3-sim", False)
        assert first["target_path"] == str(tiny_target_dir) and len(first["target_fingerprint"]) == 64

        def more_prompts() -> None:  # work left for the next generate: the check runs before its first request
            data = yaml.safe_load(Path(config).read_text())
            data["datasets"][2]["max_prompts"] += 5
            Path(config).write_text(yaml.safe_dump(data))

        layout.generated_by.unlink()  # as a run directory written before the record
        asyncio.run(generate(config))  # nothing left to send: no request, so nothing checked nor recorded
        assert not layout.generated_by.exists()
        more_prompts()
        asyncio.run(generate(config))
        adopted = json.loads(layout.generated_by.read_text())
        assert adopted["adopted"] is True and adopted["engine"] == "sim"

        parts = {d.name: live_parts(d) for d in layout.responses_root.iterdir()}
        layout.generated_by.write_text(json.dumps({**first, "engine": "vllm", "engine_version": "0.11.0"}))
        more_prompts()
        with pytest.raises(OtherEngine) as refused:
            asyncio.run(generate(config))
    message = str(refused.value)
    assert "holds responses made by a real vLLM 0.11.0" in message
    assert "this run asks for the simulated server (emulators/sim)" in message
    assert "give a new run_dir" in message and "run it with a real vLLM (server.engine: vllm" in message
    assert {d.name: live_parts(d) for d in layout.responses_root.iterdir()} == parts  # nothing written
    assert json.loads(layout.generated_by.read_text())["engine"] == "vllm"
