"""Draft training: data order and split, schedule, checkpoints, and real 2-rank ZeRO-2 launches on CPU.

The launches run `models.train` under `torch.distributed.run` with 2 gloo ranks on hidden states
captured from the tiny target's own greedy continuations. A launch SIGKILLed right after a
checkpoint resumes from it and ends with exactly the weights and metrics of an uninterrupted run
(same optimizer, scheduler, data position and RNG), which a resume that lost any of them would not.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from models.capture import CaptureJob, DatasetRecords, Dist, run as run_capture
from models.eagle3_export import load_exported_draft, validate_export
from models.target_weights import find_tensor_name, load_target_tensors
from models.tiny_target import SAMPLES_DIR
from models.train import TrainJob, _MetricsWriter, complete_checkpoints, ds_train_config, lr_lambda
from models.train_data import (TrainSample, epoch_batches, held_out, held_out_prompts, rank_micro_batches,
                               split_samples, steps_per_epoch)

REPO = Path(__file__).resolve().parents[2]
LAUNCH_TIMEOUT_S = 300


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def train_data(tiny_target_dir, tmp_path_factory) -> dict:
    """Records of the tiny target's greedy continuations, their captured hidden states and token counts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    texts = []
    for f in sorted(SAMPLES_DIR.glob("gen_*.jsonl")):
        texts += [json.loads(line)["prompt"] for line in f.read_text(encoding="utf-8").splitlines() if '"prompt"' in line]
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("train_data")
    rows = []
    for i, text in enumerate(rng.sample(texts, 40)):
        prompt = tok(text)["input_ids"][:40]
        with torch.no_grad():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=32, do_sample=False, pad_token_id=0)[0].tolist()
        rows.append({"id": f"r{i}", "input_ids": out, "loss_mask": [0] * len(prompt) + [1] * (len(out) - len(prompt))})
    records = root / "records" / "G1"
    records.mkdir(parents=True)
    pq.write_table(pa.Table.from_pylist(rows), records / "part-00000.parquet")
    counts = np.zeros(len(tok), dtype=np.int64)
    for r in rows:
        np.add.at(counts, [t for t, m in zip(r["input_ids"], r["loss_mask"]) if m], 1)
    pq.write_table(pa.table({"token_id": np.flatnonzero(counts), "count": counts[counts > 0]}),
                   root / "records" / "token_counts.parquet")
    hidden = root / "hidden"
    run_capture(CaptureJob.from_dict({"target_path": str(tiny_target_dir), "datasets": [{"name": "G1", "records_dir": str(records)}],
                                      "out_dir": str(hidden), "device": "cpu", "shard_tokens": 1024}), Dist())
    return {"root": root, "records": records, "hidden": hidden, "rows": rows}


def _job(tiny_target_dir: Path, data: dict, out_dir: Path, **over) -> Path:
    job = {
        "target_path": str(tiny_target_dir), "out_dir": str(out_dir),
        "token_counts": str(data["root"] / "records" / "token_counts.parquet"),
        "hidden_dir": str(data["hidden"]), "device": "cpu", "draft_vocab_size": 512,
        "max_batch_tokens": 512, "max_steps": 6, "checkpoint_every": 2, "eval_every": 3, "log_every": 1,
        "eval_fraction": 0.1, "lr": 2e-3, "ttt_steps": 3,
        "ds_config": ds_train_config(world_size=2, grad_accum=2, lr=2e-3, weight_decay=0.0, betas=(0.9, 0.95),
                                     grad_clip=0.5, bf16=False, torch_adam=True),
        **over,
    }
    path = out_dir.parent / f"{out_dir.name}.job.json"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job))
    return path


def _launch_cmd(job: Path) -> list[str]:
    from tasks.processes import free_port

    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
            "-m", "models.train", "--job", str(job)]


def _env() -> dict[str, str]:
    return {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _torchrun(job: Path) -> str:
    proc = subprocess.run(_launch_cmd(job), env=_env(), cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _final_state(out_dir: Path) -> dict[str, torch.Tensor]:
    return load_exported_draft(out_dir / "final", dtype=torch.float32).state_dict()


def _metric_lines(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


# --- plain functions ----------------------------------------------------------------------------


def _samples(n: int) -> list[TrainSample]:
    rng = random.Random(1)
    return [TrainSample("D", f"s{i}", rng.randint(5, 200), ("x", 0)) for i in range(n)]


def test_epoch_batches_are_deterministic_bounded_and_complete():
    samples = _samples(300)
    a = epoch_batches(samples, 1000, seed=3, epoch=0)
    assert a == epoch_batches(list(reversed(samples)), 1000, seed=3, epoch=0)  # input order does not matter
    assert a != epoch_batches(samples, 1000, seed=3, epoch=1)  # every epoch reshuffles
    assert all(max(s.length for s in b) * len(b) <= 1000 for b in a)
    flat = [s for b in a for s in b]
    assert sorted(flat, key=lambda s: s.id) == sorted(samples, key=lambda s: s.id)


def test_rank_deal_covers_each_batch_once_per_epoch():
    batches = [[s] for s in _samples(17)]
    per_epoch = steps_per_epoch(len(batches), world_size=2, grad_accum=2)
    assert per_epoch == 4  # 17 // 4; the last incomplete round is dropped
    seen = [id(b) for step in range(per_epoch) for rank in range(2) for b in rank_micro_batches(batches, step, rank, 2, 2)]
    assert len(seen) == len(set(seen)) == 16
    assert steps_per_epoch(3, world_size=2, grad_accum=2) == 1  # too few: one step with repeats
    assert len(rank_micro_batches(batches[:3], 0, 1, 2, 2)) == 2


def test_held_out_split_is_stable_and_never_trained():
    samples = _samples(400)
    train, held = split_samples(samples, 0.1)
    assert 20 < len(held) < 60 and len(train) + len(held) == 400
    assert {s.id for s in held} == {s.id for s in samples if held_out("D", s.id, 0.1)}
    assert not {s.id for s in train} & {s.id for s in held}
    assert split_samples(samples[:2], 0.001)[1]  # at least one held out when a fraction is asked for
    assert split_samples(samples, 0.0)[1] == []


def test_lr_schedule_warms_up_then_decays_to_the_floor():
    f = lr_lambda(total_steps=100, warmup_steps=10, min_ratio=0.1)
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(55) == pytest.approx(0.55)
    assert f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)


def test_ds_config_is_zero2_adamw_with_clipping():
    c = ds_train_config(world_size=8, grad_accum=4, lr=1e-4, weight_decay=0.01, betas=(0.9, 0.95), grad_clip=0.5,
                        bf16=True, torch_adam=True)
    assert c["zero_optimization"]["stage"] == 2 and c["gradient_clipping"] == 0.5
    assert c["train_batch_size"] == 32 and c["bf16"] == {"enabled": True}
    assert c["optimizer"]["type"] == "AdamW" and c["optimizer"]["params"]["torch_adam"] is True
    assert "bf16" not in ds_train_config(world_size=1, grad_accum=1, lr=1e-4, weight_decay=0, betas=(0.9, 0.95),
                                         grad_clip=1, bf16=False, torch_adam=True)


def test_only_complete_checkpoints_count(tmp_path):
    for step, complete in ((2, True), (4, True), (6, False)):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        if complete:
            (d / "COMPLETE").write_text("{}")
    assert complete_checkpoints(tmp_path) == [(2, "step-00000002"), (4, "step-00000004")]


def test_metrics_writer_drops_lines_past_the_resumed_step(tmp_path):
    lines = [{"kind": "train", "step": s} for s in (1, 2, 3, 4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines) + '{"kind": "tr')
    w = _MetricsWriter(tmp_path, resumed_step=2, enabled=True)
    w.write({"kind": "train", "step": 3, "loss": 1.0})
    w.close()
    assert [(x["step"], x.get("loss")) for x in _metric_lines(tmp_path)] == [(1, None), (2, None), (3, 1.0)]


def test_target_tensors_are_read_without_the_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    embed, head = load_target_tensors(tiny_target_dir)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    names = ["language_model.model.embed_tokens.weight", "vision_tower.embed_tokens.weight", "language_model.lm_head.weight"]
    assert find_tensor_name(names, "embed_tokens.weight") == "language_model.model.embed_tokens.weight"
    assert find_tensor_name(names, "lm_head.weight") == "language_model.lm_head.weight"
    assert find_tensor_name(names, "norm.weight") is None


def test_held_out_prompts_stop_before_the_first_loss_token(train_data):
    prompts = held_out_prompts([DatasetRecords("G1", str(train_data["records"]))], 0.2, 3)
    rows = {r["id"]: r for r in train_data["rows"]}
    assert 1 <= len(prompts) <= 3
    for dataset, sample_id, ids in prompts:
        assert dataset == "G1" and held_out("G1", sample_id, 0.2)
        row = rows[sample_id]
        assert ids == row["input_ids"][: row["loss_mask"].index(1)]


def test_train_job_rejects_unknown_keys(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"target_path": "x", "out_dir": "y", "token_counts": "z", "ds_config": {}, "hidden_dir": "h", "bogus": 1}))
    with pytest.raises(ValueError, match="unknown keys \\['bogus'\\]"):
        TrainJob.load(path)


# --- real launches ------------------------------------------------------------------------------


def _single_process(job: Path) -> str:
    """One rank without a launcher (WORLD_SIZE unset): the job makes its own 1-rank group."""
    env = {k: v for k, v in _env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    proc = subprocess.run([sys.executable, "-m", "models.train", "--job", str(job)], env=env, cwd=REPO,
                          capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def test_online_mode_trains_like_offline_on_the_same_records(tiny_target_dir, train_data, tmp_path):
    """Online computes the hidden states in the job: same batches, same losses as from the captured shards."""
    one_rank = ds_train_config(world_size=1, grad_accum=1, lr=2e-3, weight_decay=0.0, betas=(0.9, 0.95), grad_clip=0.5,
                               bf16=False, torch_adam=True)
    common = {"max_steps": 3, "checkpoint_every": 100, "eval_every": 100, "ds_config": one_rank}
    offline = tmp_path / "offline" / "draft"
    online = tmp_path / "online" / "draft"
    _single_process(_job(tiny_target_dir, train_data, offline, **common))
    log = _single_process(_job(tiny_target_dir, train_data, online, mode="online", hidden_dir=None,
                               datasets=[{"name": "G1", "records_dir": str(train_data["records"])}], **common))
    assert "mode online" in log
    a, b = _metric_lines(offline), _metric_lines(online)
    assert [(x["kind"], x["step"], x["tokens"]) for x in a] == [(x["kind"], x["step"], x["tokens"]) for x in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4), (x, y)
    assert validate_export(online / "final") == []
    # A relaunch of a finished run trains nothing, re-exports, and keeps the last eval in the summary.
    before = json.loads((online / "train_summary.json").read_text())
    log = _single_process(_job(tiny_target_dir, train_data, online, mode="online", hidden_dir=None,
                               datasets=[{"name": "G1", "records_dir": str(train_data["records"])}], **common))
    assert "resuming from checkpoint step-00000003" in log
    after = json.loads((online / "train_summary.json").read_text())
    assert after["steps"] == 3 and after["eval"] == before["eval"] is not None
    assert len(_metric_lines(online)) == len(b)


def test_killed_training_resumes_with_the_same_state(tiny_target_dir, train_data, tmp_path):
    # The uninterrupted reference run: 2 ranks, ZeRO-2, learns, evaluates, checkpoints, exports.
    reference = tmp_path / "ref" / "draft"
    log = _torchrun(_job(tiny_target_dir, train_data, reference))
    assert "ZeRO-2" in log and "2 rank(s)" in log
    assert validate_export(reference / "final") == []
    lines = _metric_lines(reference)
    train = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [x["step"] for x in train] == list(range(1, 7))
    assert train[-1]["loss"] < 0.8 * train[0]["loss"], [x["loss"] for x in train]
    assert [x["step"] for x in evals] == [3, 6] and all(1.0 <= x["acceptance_length"] <= 4.0 for x in evals)
    summary = json.loads((reference / "train_summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["acceptance_length"] == evals[-1]["acceptance_length"]
    assert summary["draft_vocab_size"] == 512
    assert any((reference / "tensorboard").iterdir())
    assert [s for s, _ in complete_checkpoints(reference / "checkpoints")] == [4, 6]  # keep_checkpoints=2
    assert (reference / "checkpoints" / "latest").read_text() == "step-00000006"

    out = tmp_path / "killed" / "draft"
    job = _job(tiny_target_dir, train_data, out)
    proc = subprocess.Popen(_launch_cmd(job), env=_env(), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            start_new_session=True, text=True)
    seen = []
    try:
        for line in proc.stdout:  # the kill follows the line, not a timer
            seen.append(line)
            if "TRAIN_CHECKPOINT step=4" in line:
                break
    finally:
        victims = [proc.pid, *_descendants(proc.pid)]
        for pid in victims:
            try:
                os.killpg(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        proc.wait(timeout=30)
        deadline = time.monotonic() + 30
        while any(_alive(p) for p in victims[1:]) and time.monotonic() < deadline:
            time.sleep(0.1)
    assert "TRAIN_CHECKPOINT step=4" in "".join(seen), "".join(seen)[-4000:]
    assert not (out / "final").exists()
    # A save cut short by a kill leaves a tag without COMPLETE: it must be ignored and removed.
    (out / "checkpoints" / "step-00000005").mkdir()

    log = _torchrun(job)
    assert "resuming from checkpoint step-00000004 (step 4" in log
    assert not (out / "checkpoints" / "step-00000005").exists()
    want, got = _final_state(reference), _final_state(out)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=1e-6, msg=name)
    ref_lines, lines = _metric_lines(reference), _metric_lines(out)
    assert [(x["kind"], x["step"]) for x in lines] == [(x["kind"], x["step"]) for x in ref_lines]
    for a, b in zip(lines, ref_lines):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a, b)


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
