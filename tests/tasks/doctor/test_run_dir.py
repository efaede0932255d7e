"""tasks/doctor/run_dir.py: another process's lock, a damaged part and a checkpoint of other settings are FAILs."""

from __future__ import annotations

import json

from models.findings import Finding
from tasks.doctor.run_dir import run_dir_findings
from tests.run_locks import lock_held_elsewhere

SETTINGS = {"mode": "offline", "lr": 0.002, "ttt_steps": 7, "world_size": 2}


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.name: f for f in findings}


def test_a_new_run_directory_passes(tmp_path):
    (f,) = run_dir_findings(
        tmp_path / "run", checkpoint_dir=tmp_path / "run" / "draft" / "checkpoints", settings=SETTINGS
    )
    assert f.status == "PASS" and "is new" in f.detail


def test_a_lock_held_by_another_process_fails_naming_it(tmp_path):
    run = tmp_path / "run"
    with lock_held_elsewhere(run, "generate") as holder:
        f = by_name(run_dir_findings(run, checkpoint_dir=run / "ckpt", settings=SETTINGS))["run directory: lock"]
        assert f.status == "FAIL" and f"pid {holder.pid}" in f.detail and "writing generate" in f.detail
    f = by_name(run_dir_findings(run, checkpoint_dir=run / "ckpt", settings=SETTINGS))["run directory: lock"]
    assert f.status == "PASS"  # released with its process


def test_the_lock_this_process_holds_is_not_a_fail(tmp_path):
    from tasks.run_lock import run_lock

    with run_lock(tmp_path / "run", "pipeline"):
        f = by_name(run_dir_findings(tmp_path / "run", checkpoint_dir=tmp_path / "c", settings=SETTINGS))[
            "run directory: lock"
        ]
    assert f.status == "PASS"


def test_a_damaged_part_fails_naming_the_file(tmp_path):
    part = tmp_path / "run" / "responses" / "B1" / "part-000000.parquet"
    part.parent.mkdir(parents=True)
    part.write_bytes(b"not parquet")
    f = by_name(run_dir_findings(tmp_path / "run", checkpoint_dir=tmp_path / "c", settings=SETTINGS))[
        "run directory: parts"
    ]
    assert f.status == "FAIL" and "part-000000.parquet" in f.detail


def checkpoint(ckpt_dir, step: int, settings: dict) -> None:
    from models.train_checkpoint import COMPLETE, FINGERPRINT

    tag = ckpt_dir / f"step-{step}"
    tag.mkdir(parents=True)
    (tag / COMPLETE).write_text("")
    (tag / FINGERPRINT).write_text(
        json.dumps(
            {
                "version": 1,
                "data": {},
                "vocab": {},
                "settings": {**settings, "total_steps": 40, "draft.hidden_size": 128},
            }
        )
    )


def test_a_checkpoint_of_other_settings_fails_saying_which(tmp_path):
    ckpt = tmp_path / "run" / "draft" / "checkpoints"
    checkpoint(ckpt, 20, SETTINGS)
    f = by_name(run_dir_findings(tmp_path / "run", checkpoint_dir=ckpt, settings=SETTINGS))["train checkpoint"]
    assert f.status == "PASS" and f.detail.startswith("step-20")  # keys only the launch knows are not compared
    checkpoint(ckpt, 40, {**SETTINGS, "lr": 0.001})
    f = by_name(run_dir_findings(tmp_path / "run", checkpoint_dir=ckpt, settings=SETTINGS))["train checkpoint"]
    assert f.status == "FAIL" and "step-40 was trained with other settings: lr 0.001 -> 0.002" in f.detail
