"""tasks/doctor/run_dir.py: another process's lock, a damaged part and a checkpoint of other settings are FAILs."""

from __future__ import annotations

import json

from models.common.findings import Finding
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
    from tasks.runtime.run_lock import run_lock

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
    from models.train.checkpoint import COMPLETE, FINGERPRINT

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


def _trained(ckpt_dir, variant: str) -> dict:
    """A checkpoint whose fingerprint the train stage wrote (run_fingerprint) for a `variant` draft; its job."""
    import torch

    from models.common.job_files import TrainJobFile
    from models.draft.config import DRAFT_VARIANTS, Eagle3Config
    from models.train.checkpoint import COMPLETE, FINGERPRINT, run_fingerprint
    from settings.target import Target

    job = TrainJobFile(
        target=Target(path="t"), out_dir="o", token_counts="tc", hidden_dir="h", device="cpu", draft_variant=variant
    )
    shape = {"hidden_size": 8, "intermediate_size": 16, "num_attention_heads": 2, "num_key_value_heads": 1}
    config = Eagle3Config(**shape, vocab_size=10, draft_vocab_size=3, aux_layers=[0, 1, 2], **DRAFT_VARIANTS[variant])
    tag = ckpt_dir / "step-10"
    tag.mkdir(parents=True)
    (tag / COMPLETE).write_text("")
    (tag / FINGERPRINT).write_text(json.dumps(run_fingerprint(job, {}, torch.tensor([0, 1, 2]), config, 1, 10)))
    return job


def test_a_checkpoint_of_the_other_draft_variant_fails_both_ways(tmp_path):
    """The doctor's settings for a config (optimisation_settings | variant_settings) against what training wrote."""
    from models.train.checkpoint import optimisation_settings, variant_settings

    def finding(trained: str, configured: str) -> Finding:
        ckpt = tmp_path / "run" / trained / configured
        job = _trained(ckpt, trained).model_copy(update={"draft_variant": configured})
        settings = optimisation_settings(job, 1) | variant_settings(job)
        return by_name(run_dir_findings(tmp_path / "run", checkpoint_dir=ckpt, settings=settings))["train checkpoint"]

    assert finding("eagle3", "eagle3").status == "PASS"  # its fingerprint has no flags: absent means off
    assert finding("eagle3.1", "eagle3.1").status == "PASS"
    for trained, configured, change in (
        ("eagle3", "eagle3.1", "False -> True"),
        ("eagle3.1", "eagle3", "True -> False"),
    ):
        f = finding(trained, configured)
        assert f.status == "FAIL", (trained, configured, f.detail)
        assert f"draft.fc_norm {change}, draft.norm_output {change}" in f.detail


def test_a_damaged_shard_fails_naming_it_and_none_passes(tmp_path):
    from tasks.doctor.run_dir import shards_finding

    want = {"hidden_size": 8, "aux_layers": [1, 3, 4], "dtype": "float32", "storage": "native"}
    f = shards_finding(tmp_path / "hidden", want)
    assert f.status == "PASS" and "the capture starts fresh" in f.detail
    (tmp_path / "hidden").mkdir()
    (tmp_path / "hidden" / "shard-000-000000.safetensors").write_bytes(b"not a shard")
    f = shards_finding(tmp_path / "hidden", want)
    assert f.status == "FAIL" and "shard-000-000000.safetensors" in f.detail and "move" in f.advice


def test_a_capture_directory_that_cannot_be_listed_fails(tmp_path, monkeypatch):
    import tasks.doctor.run_dir as run_dir

    def denied(out_dir):
        raise PermissionError(13, "Permission denied", str(out_dir))

    monkeypatch.setattr(run_dir, "list_shards", denied)  # as for a directory of another user (root reads any)
    (tmp_path / "hidden").mkdir()
    f = run_dir.shards_finding(tmp_path / "hidden", {"storage": "native"})
    assert f.status == "FAIL" and f.detail.startswith(f"cannot list {tmp_path / 'hidden'}: [Errno 13]")


def test_responses_of_another_engine_fail_in_seconds_and_the_same_engine_passes(tmp_path):
    """The generate stage would refuse the run (tasks/generate/provenance.py): the doctor says so before any server
    starts, and warns of responses with no record, which the next generate adopts."""
    from settings.layout import RunLayout
    from tasks.generate.provenance import Provenance, settle
    from tests.tasks.generate.test_provenance import add_response, fake_target, log

    layout = RunLayout(tmp_path / "run")
    target = str(fake_target(tmp_path / "target"))
    dev, vllm = Provenance("dev", target, launch="dev"), Provenance("vllm", target, launch="command")

    def finding(current: Provenance) -> Finding:
        found = run_dir_findings(layout.run_dir, checkpoint_dir=tmp_path / "c", settings=SETTINGS, generated_by=current)
        return by_name(found)["run directory: generated by"]

    add_response(layout)
    f = finding(vllm)
    assert f.status == "WARN" and "the next generate adopts them as made by a real vLLM" in f.advice
    settle(layout, dev, log)
    f = finding(vllm)
    assert f.status == "FAIL" and "made by the dev server (an SGLang emulation)" in f.detail
    assert "this run asks for a real vLLM" in f.detail and f.advice.startswith("To use the new one, give a new run_dir")
    assert finding(dev).status == "PASS"
    assert "run directory: generated by" not in by_name(
        run_dir_findings(layout.run_dir, checkpoint_dir=tmp_path / "c", settings=SETTINGS)
    )  # asked only when the caller says what generate will use
