"""Disk planning for the capture stage."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from models.common.jobs import RecordsJob
from tasks.capture import plan as capture_plan
from tasks.capture.plan import DiskTooSmall, TargetShape, capture_layers, check_fits, plan_capture, target_shape
from tasks.records.build import build_records
from tasks.responses.checkpoints import responses_table, write_part
from tasks.responses.parquet_io import DamagedPart
from tests.generate_runs import response_row
from tests.kimi_k25 import CONFIG_JSON

KIMI = TargetShape(hidden_size=7168, num_layers=61, dtype="bfloat16")


def records_dir(tmp_path, n_tokens: list[int]):
    rows = [response_row(f"r{i}", [5] * (n - 2), [6, 1]) for i, n in enumerate(n_tokens)]
    write_part(tmp_path / "responses", responses_table(rows))
    build_records(
        "B1", "generate", tmp_path / "responses", tmp_path / "records", tmp_path / "rej", RecordsJob(vocab_size=10)
    )
    return tmp_path / "records"


def fake_disk(monkeypatch, free: int):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(capture_plan.shutil, "disk_usage", lambda path: usage(free * 2, free, free))


def test_kimi_bytes_per_token_is_8h_plus_ids(tmp_path, monkeypatch):
    fake_disk(monkeypatch, 10**15)
    plan = plan_capture([records_dir(tmp_path, [100, 300])], tmp_path / "hidden", KIMI, "auto", margin=0.05)
    assert plan.bytes_per_token == 4 * 7168 * 2 + 5 == 57349  # 56 KiB of hidden states per token
    assert plan.tokens_todo == 400 and plan.bytes_needed == 400 * 57349
    assert plan.fits and plan.dtype == "bfloat16"


def test_kimi_fp8_bytes_per_token_is_4h_plus_scales_and_ids(tmp_path, monkeypatch):
    fake_disk(monkeypatch, 10**15)
    d = records_dir(tmp_path, [100, 300])
    plan = plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.05, storage="fp8")
    # e4m3 aux [3H] and last [H], a float32 scale per token for each aux layer and the last: 4 scales
    assert plan.bytes_per_token == 4 * 7168 + 4 * 4 + 5 == 28693
    assert plan.bytes_needed == 400 * 28693 and plan.storage == "fp8" and plan.dtype == "bfloat16"
    # the reference run's 92M tokens: 4.8 TiB in bf16, 2.4 TiB in fp8 (docs/kimi-k25.md)
    bf16 = plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.05)
    assert (92e6 * bf16.bytes_per_token / 2**40, 92e6 * plan.bytes_per_token / 2**40) == pytest.approx(
        (4.80, 2.40), abs=0.01
    )


def test_resume_counts_only_what_is_left_and_max_tokens_caps(tmp_path, monkeypatch):
    fake_disk(monkeypatch, 10**15)
    d = records_dir(tmp_path, [100, 300, 600])
    assert plan_capture([d], tmp_path / "h", KIMI, "auto", margin=0.0, tokens_done=250).tokens_todo == 750
    assert (
        plan_capture([d], tmp_path / "h", KIMI, "auto", margin=0.0, max_tokens=500, tokens_done=100).tokens_todo == 400
    )
    assert plan_capture([d], tmp_path / "h", KIMI, "auto", margin=0.0, tokens_per_s=100.0).est_seconds == 10.0


def test_refuses_a_job_that_does_not_fit_with_figures_and_ways_out(tmp_path, monkeypatch):
    fake_disk(monkeypatch, 10 * 57349 * 10)  # room for about 100 tokens
    plan = plan_capture([records_dir(tmp_path, [1000])], tmp_path / "hidden", KIMI, "auto", margin=0.05)
    assert not plan.fits
    with pytest.raises(DiskTooSmall) as info:
        check_fits(plan)
    message = str(info.value)
    assert "1,000 tokens" in message and "57,349 B" in message
    assert f"capture.max_tokens: {int(plan.usable_bytes // 57349):,}" in message
    assert "capture.out_dir" in message and "train.mode: online" in message


def test_damaged_records_part_is_named_with_what_to_do(tmp_path, monkeypatch):
    fake_disk(monkeypatch, 10**15)
    d = records_dir(tmp_path, [100, 300])
    part = d / "part-000000.parquet"
    part.write_bytes(part.read_bytes()[:-100])  # truncated: the footer is gone
    with pytest.raises(DamagedPart) as info:
        plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.05)
    message = str(info.value)
    assert message.startswith(
        f"{part} is damaged ({part.stat().st_size:,} bytes, not a readable Parquet file: Parquet magic bytes"
    )
    assert message.endswith(
        "Delete it and run the records stage again: it is rebuilt from its responses or passthrough part"
    )


def test_target_shape_reads_nested_text_config(tmp_path):
    shutil.copy(CONFIG_JSON, tmp_path / "config.json")  # Kimi-K2.5's: the text config nested
    assert target_shape(str(tmp_path)) == KIMI


def test_target_shape_of_the_tiny_target(tiny_target_dir):
    shape = target_shape(str(tiny_target_dir))
    assert (shape.hidden_size, shape.num_layers, shape.dtype) == (128, 8, "float32")


def test_capture_layers():
    assert capture_layers(61, None) == [1, 29, 57]
    assert capture_layers(8, [0, 2, 7]) == [0, 2, 7]
    for bad in ([1, 2], [1, 1, 2], [1, 2, 8], [-1, 2, 3]):
        with pytest.raises(ValueError, match="3 distinct"):
            capture_layers(8, bad)


def test_the_vllm_connectors_files_are_planned_where_they_go(tmp_path, tmpfs):
    from tasks.capture.plan import ExtractionWindow

    d = records_dir(tmp_path, [100, 300, 600, 1000, 1000])
    per_file_token = 4 * 7168 * 2 + 8  # the connector's bf16 [n, 4, H] + int64 ids
    window = ExtractionWindow(tmp_path / "engine", max_concurrency=1, shard_tokens=10)
    same = plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.0, engine=window)
    assert (
        same.temp_bytes == (10 + 1000 + 1000) * per_file_token
    )  # the shard window (+ one record) + the longest in flight
    assert same.bytes_needed == 3000 * 57349 + same.temp_bytes and same.temp_usable_bytes is None
    assert (
        plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.0, tokens_done=2900, engine=window).temp_bytes
        == 100 * per_file_token
    )  # never more than what is left
    assert plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.0).temp_bytes == 0  # the DeepSpeed backend
    with tmpfs(tmp_path / "shm", "16m") as shm:  # another filesystem, too small for the window
        apart = plan_capture([d], tmp_path / "hidden", KIMI, "auto", margin=0.0, engine=ExtractionWindow(shm, 1, 10))
        assert apart.bytes_needed == 3000 * 57349 and apart.temp_usable_bytes <= 16 * 2**20 and not apart.fits
        with pytest.raises(DiskTooSmall, match="capture.engine.max_concurrency"):
            check_fits(apart)
