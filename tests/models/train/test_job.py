"""Draft training: data order and split, schedule, checkpoints, and real 2-rank ZeRO-2 launches on CPU.

The launches run `models.train` under `torch.distributed.run` with 2 gloo ranks on hidden states
captured from the tiny target's own greedy continuations. A launch SIGKILLed right after a
checkpoint resumes from it and ends with exactly the weights and metrics of an uninterrupted run
(same optimizer, scheduler, data position and RNG), which a resume that lost any of them would not.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from models.capture.job import run as run_capture
from models.common.job_files import CaptureJobFile, DatasetRecords, TrainJobFile
from models.export.eagle3 import load_exported_draft
from models.export.sglang import validate_export
from models.ranks.harness import Dist
from models.target.tiny import SAMPLES_DIR
from models.target.weights import find_tensor_name, load_target_tensors
from models.train.checkpoint import complete_checkpoints
from models.train.data import (
    TrainSample,
    epoch_batches,
    held_out,
    held_out_prompts,
    rank_micro_batches,
    split_samples,
    steps_per_epoch,
)
from models.train.metrics import MetricsWriter
from models.train.optimizer import ds_train_config, lr_lambda
from settings.target import Target
from settings.train import TrainSettings
from tests.models.torchrun import cpu_env, launch_cmd

REPO = Path(__file__).resolve().parents[3]
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
        texts += [
            json.loads(line)["prompt"] for line in f.read_text(encoding="utf-8").splitlines() if '"prompt"' in line
        ]
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
    pq.write_table(
        pa.table({"token_id": np.flatnonzero(counts), "count": counts[counts > 0]}),
        root / "records" / "token_counts.parquet",
    )
    hidden = root / "hidden"
    run_capture(
        CaptureJobFile(
            target=Target(path=str(tiny_target_dir)),
            datasets=[{"name": "G1", "records_dir": str(records)}],
            out_dir=str(hidden),
            device="cpu",
            shard_tokens=1024,
            launch_tokens=None,
        ),
        Dist(),
    )
    return {"root": root, "records": records, "hidden": hidden, "rows": rows}


def _job(tiny_target_dir: Path, data: dict, out_dir: Path, **over) -> Path:
    job = {
        "target": {"path": str(tiny_target_dir)},
        "out_dir": str(out_dir),
        "token_counts": str(data["root"] / "records" / "token_counts.parquet"),
        "hidden_dir": str(data["hidden"]),
        "device": "cpu",
        "draft_vocab_size": 512,
        "max_batch_tokens": 512,
        "max_steps": 6,
        "checkpoint_every": 2,
        "eval_every": 3,
        "log_every": 1,
        "eval_fraction": 0.1,
        "lr": 2e-3,
        "ttt_steps": 3,
        "grad_accum": 2,
        **over,
    }
    path = out_dir.parent / f"{out_dir.name}.job.json"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job))
    return path


def _launch_cmd(job: Path) -> list[str]:
    return launch_cmd(job, ["-m", "models.train"])


def _torchrun(job: Path) -> str:
    proc = subprocess.run(
        _launch_cmd(job), env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


def _final_state(out_dir: Path, export: str = "final") -> dict[str, torch.Tensor]:
    return load_exported_draft(out_dir / export, dtype=torch.float32).state_dict()


def _checkpoint_state(out_dir: Path, step: int) -> dict[str, torch.Tensor]:
    """The draft's weights in the DeepSpeed checkpoint of `step` (the engine's module is the TTT wrapper: `draft.`)."""
    saved = torch.load(out_dir / "checkpoints" / f"step-{step:08d}" / "mp_rank_00_model_states.pt", weights_only=False)
    return {name.removeprefix("draft."): t for name, t in saved["module"].items()}


def _assert_same_weights(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], atol: float = 0.0) -> None:
    for name in got:  # an export leaves out nothing the draft trains (d2t/t2d only at a full vocabulary)
        torch.testing.assert_close(got[name], want[name].to(got[name].dtype), rtol=0, atol=atol, msg=name)


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
    seen = [
        id(b) for step in range(per_epoch) for rank in range(2) for b in rank_micro_batches(batches, step, rank, 2, 2)
    ]
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
    settings = TrainSettings(grad_accum=4, lr=1e-4, weight_decay=0.01, grad_clip=0.5)
    c = ds_train_config(settings, world_size=8, bf16=True)
    assert c["zero_optimization"]["stage"] == 2 and c["gradient_clipping"] == 0.5
    assert c["train_batch_size"] == 32 and c["bf16"] == {"enabled": True}
    assert c["optimizer"]["type"] == "AdamW" and c["optimizer"]["params"]["torch_adam"] is True
    assert c["optimizer"]["params"]["betas"] == [0.9, 0.95] and c["optimizer"]["params"]["weight_decay"] == 0.01
    assert "bf16" not in ds_train_config(TrainSettings(grad_clip=1), world_size=1, bf16=False)


def test_ds_config_muon_runs_the_matrices_at_adamw_s_update_size():
    """lr 0.002 and a draft of hidden size 128: Muon's lr 0.002 * 0.2 * sqrt(128) = 0.00452548 (by hand), AdamW's 0.002
    for the rest, both in DeepSpeed's Muon config (runtime/engine.py `_muon_param_groups`: muon_lr, adam_lr)."""
    muon = TrainSettings(optimizer="muon", lr=0.002, zero_stage=0)
    c = ds_train_config(muon, world_size=1, bf16=False, hidden_size=128)
    params = c["optimizer"]["params"]
    assert c["optimizer"]["type"] == "Muon" and params["momentum"] == 0.95
    assert params["muon_lr"] == pytest.approx(0.00452548, rel=1e-6) and params["adam_lr"] == 0.002
    assert params["betas"] == [0.9, 0.95] and params["weight_decay"] == 0.0
    with pytest.raises(ValueError, match="needs the draft's hidden size"):
        ds_train_config(TrainSettings(optimizer="muon", zero_stage=0), world_size=1, bf16=False)
    with pytest.raises(ValueError, match="optimizer muon needs zero_stage: 0"):
        TrainSettings(optimizer="muon")


def test_norm_before_fc_and_eagle3_1_are_refused_together():
    with pytest.raises(ValueError, match="norm_before_fc and draft_variant eagle3.1 are exclusive"):
        TrainSettings(norm_before_fc=True, draft_variant="eagle3.1")


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
    w = MetricsWriter(tmp_path, resumed_step=2, enabled=True)
    w.write({"kind": "train", "step": 3, "loss": 1.0})
    w.close()
    assert [(x["step"], x.get("loss")) for x in _metric_lines(tmp_path)] == [(1, None), (2, None), (3, 1.0)]


def test_target_tensors_are_read_without_the_model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    embed, head = load_target_tensors(tiny_target_dir)
    assert torch.equal(embed, model.get_input_embeddings().weight)
    assert torch.equal(head, model.get_output_embeddings().weight)
    names = [
        "language_model.model.embed_tokens.weight",
        "vision_tower.embed_tokens.weight",
        "language_model.lm_head.weight",
    ]
    assert find_tensor_name(names, "embed_tokens.weight") == "language_model.model.embed_tokens.weight"
    assert find_tensor_name(names, "lm_head.weight") == "language_model.lm_head.weight"
    assert find_tensor_name(names, "norm.weight") is None


def test_held_out_prompts_stop_before_the_first_loss_token(train_data):
    prompts = held_out_prompts([DatasetRecords(name="G1", records_dir=str(train_data["records"]))], 0.2, 3)
    rows = {r["id"]: r for r in train_data["rows"]}
    assert 1 <= len(prompts) <= 3
    for dataset, sample_id, ids in prompts:
        assert dataset == "G1" and held_out("G1", sample_id, 0.2)
        row = rows[sample_id]
        assert ids == row["input_ids"][: row["loss_mask"].index(1)]


def test_train_job_rejects_unknown_keys(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(
        json.dumps({"target": {"path": "x"}, "out_dir": "y", "token_counts": "z", "hidden_dir": "h", "bogus": 1})
    )
    with pytest.raises(ValueError, match=f"{path}: not a valid TrainJobFile: bogus: Extra inputs are not permitted"):
        TrainJobFile.load(path)


# --- real launches ------------------------------------------------------------------------------


def _run_single(job: Path, **env_over: str) -> subprocess.CompletedProcess:
    """One rank without a launcher (WORLD_SIZE unset): the job makes its own 1-rank group; `env_over` added to its
    environment."""
    env = {k: v for k, v in cpu_env().items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")} | env_over
    return subprocess.run(
        [sys.executable, "-m", "models.train", "--job", str(job)],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )


def _single_process(job: Path, **env_over: str) -> str:
    """`_run_single`, which must succeed; its output."""
    proc = _run_single(job, **env_over)
    assert proc.returncode == 0, f"train failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc.stdout + proc.stderr


ONE_RANK = {"max_steps": 3, "checkpoint_every": 100, "eval_every": 100}  # one checkpoint: the final step's


@pytest.fixture(scope="module")
def one_rank_run(tiny_target_dir, train_data, tmp_path_factory) -> Path:
    """A finished offline run of one rank without a launcher (ONE_RANK), shared: tests that change it work on a copy."""
    out = tmp_path_factory.mktemp("one_rank") / "offline" / "draft"
    _single_process(_job(tiny_target_dir, train_data, out, **ONE_RANK))
    return out


@pytest.mark.multiprocess
def test_online_mode_trains_like_offline_on_the_same_records(tiny_target_dir, train_data, one_rank_run, tmp_path):
    """Online computes the hidden states in the job: same batches, same losses as from the captured shards."""
    common = ONE_RANK
    offline = one_rank_run
    online = tmp_path / "online" / "draft"
    online_job = _job(
        tiny_target_dir,
        train_data,
        online,
        mode="online",
        hidden_dir=None,
        datasets=[{"name": "G1", "records_dir": str(train_data["records"])}],
        **common,
    )
    log = _single_process(online_job)
    assert "mode online" in log
    a, b = _metric_lines(offline), _metric_lines(online)
    assert [(x["kind"], x["step"], x["tokens"]) for x in a] == [(x["kind"], x["step"], x["tokens"]) for x in b]
    for x, y in zip(a, b):
        assert x["loss"] == pytest.approx(y["loss"], rel=1e-4), (x, y)
    assert validate_export(online / "final") == []
    # A relaunch of a finished run trains nothing, re-exports, and keeps the last eval in the summary.
    before = json.loads((online / "train_summary.json").read_text())
    log = _single_process(online_job)
    assert "resuming from checkpoint step-00000003" in log
    after = json.loads((online / "train_summary.json").read_text())
    assert after["steps"] == 3 and after["eval"] == before["eval"] is not None
    assert len(_metric_lines(online)) == len(b)


@pytest.mark.multiprocess
def test_killed_training_resumes_with_the_same_state(tiny_target_dir, train_data, tmp_path, procs):
    # The uninterrupted reference run: 2 ranks, ZeRO-2, learns, evaluates, checkpoints, exports.
    reference = tmp_path / "ref" / "draft"
    log = _torchrun(_job(tiny_target_dir, train_data, reference))
    assert "ZeRO-2" in log and "2 rank(s)" in log
    assert validate_export(reference / "final") == []
    lines = _metric_lines(reference)
    train = [x for x in lines if x["kind"] == "train"]
    evals = [x for x in lines if x["kind"] == "eval"]
    assert [x["step"] for x in train] == list(range(1, 7))
    # it learns: 6 steps take the loss down steadily (the trained target's varied text falls ~18% here,
    # the old random target's loops fell faster)
    losses = [x["loss"] for x in train]
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.88 * losses[0], losses
    assert [x["step"] for x in evals] == [3, 6] and all(1.0 <= x["acceptance_length"] <= 4.0 for x in evals)
    summary = json.loads((reference / "train_summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["acceptance_length"] == evals[-1]["acceptance_length"]
    assert summary["draft_vocab_size"] == 512
    assert any((reference / "tensorboard").iterdir())
    assert [s for s, _ in complete_checkpoints(reference / "checkpoints")] == [4, 6]  # keep_checkpoints=2
    assert (reference / "checkpoints" / "latest").read_text() == "step-00000006"
    best = max(evals, key=lambda x: x["acceptance_length"])  # the first of equals
    assert summary["best"]["step"] == best["step"] and summary["best"]["dir"] == str(reference / "best")
    assert f"TRAIN_BEST step={evals[0]['step']} " in log  # the first eval is the best so far: exported

    out = tmp_path / "killed" / "draft"
    job = _job(tiny_target_dir, train_data, out)
    proc = subprocess.Popen(
        _launch_cmd(job),
        env=cpu_env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        start_new_session=True,
        text=True,
    )
    seen = []
    try:
        for line in proc.stdout:  # the kill follows the line, not a timer
            seen.append(line)
            if "TRAIN_CHECKPOINT step=4" in line:
                break
    finally:
        procs.kill(proc)
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
    # The best eval (step 3's export survived the kill: its step is before the resumed checkpoint) is the reference's.
    assert "removing" not in log.replace("removing incomplete checkpoint", "")
    resumed, want_best = (json.loads((d / "train_summary.json").read_text())["best"] for d in (out, reference))
    assert (resumed["step"], resumed["acceptance_length"]) == (want_best["step"], want_best["acceptance_length"])
    assert resumed["dir"] == str(out / "best")
    _assert_same_weights(_final_state(out, "best"), _final_state(reference, "best"), atol=1e-6)
    ref_lines, lines = _metric_lines(reference), _metric_lines(out)
    assert [(x["kind"], x["step"]) for x in lines] == [(x["kind"], x["step"]) for x in ref_lines]
    for a, b in zip(lines, ref_lines):
        assert a["loss"] == pytest.approx(b["loss"], abs=1e-6), (a, b)


# --- the best held-out eval: best/ beside final/ ---------------------------------------------------------------

# An eval every step and a checkpoint every step, all kept: the held-out acceptance of this tiny run peaks early and
# never comes back above it, so the best draft is not the last; the checkpoints hold each step's weights to compare.
BEST_RUN = {
    "max_steps": 10,
    "eval_every": 1,
    "checkpoint_every": 1,
    "keep_checkpoints": 10,
    "lr": 1e-2,
    "eval_fraction": 0.3,
    "grad_accum": 1,
}


@pytest.fixture(scope="module")
def best_run(tiny_target_dir, train_data, tmp_path_factory) -> tuple[Path, str]:
    """A finished BEST_RUN of one rank and its log, shared: tests that relaunch it work on a copy."""
    out = tmp_path_factory.mktemp("best_run") / "draft"
    return out, _single_process(_job(tiny_target_dir, train_data, out, **BEST_RUN))


def _rolled_back_to(run: Path, to: Path, step: int) -> Path:
    """A copy of a finished run as a kill after `step`'s checkpoint leaves it: no checkpoint past it (the metrics and
    best/ past it stay, as a kill leaves them: the relaunch must deal with them)."""
    import shutil

    shutil.copytree(run, to)
    for later, tag in complete_checkpoints(to / "checkpoints"):
        if later > step:
            shutil.rmtree(to / "checkpoints" / tag)
    (to / "checkpoints" / "latest").write_text(f"step-{step:08d}")
    (to / "final").rename(to.parent / "final-of-the-finished-run")  # a killed run has no final/
    return to


@pytest.mark.multiprocess
def test_the_best_held_out_eval_is_exported_to_best_and_the_last_step_to_final(best_run):
    out, log = best_run
    evals = [x for x in _metric_lines(out) if x["kind"] == "eval"]
    assert [x["step"] for x in evals] == list(range(1, 11))
    # The best, recomputed from the eval lines: the greatest acceptance, the first of equals; exported each time the
    # best so far rose strictly.
    rises, top = [], None
    for x in evals:
        if top is None or x["acceptance_length"] > top["acceptance_length"]:
            rises.append(x["step"])
            top = x
    assert top is not None and top["step"] < 10, f"the run's acceptance no longer peaks before its end: {evals}"
    assert [int(line.split()[1].removeprefix("step=")) for line in log.splitlines() if "TRAIN_BEST " in line] == rises
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["final"] == str(out / "final") and summary["steps"] == 10
    assert summary["best"] == {
        "step": top["step"],
        "epoch": top["epoch"],
        "acceptance_length": top["acceptance_length"],
        "loss": top["loss"],
        "dir": str(out / "best"),
        "last": False,
    }
    assert json.loads((out / "best" / "best.json").read_text()) == {
        k: top[k] for k in ("step", "epoch", "acceptance_length", "loss")
    }
    assert f"the best held-out eval is at step {top['step']}, acceptance length " in log
    # best/ is that step's draft, final/ the last step's: each compared with the checkpoint of its step.
    assert validate_export(out / "best") == []
    best, final = _final_state(out, "best"), _final_state(out)
    _assert_same_weights(best, _checkpoint_state(out, top["step"]))
    _assert_same_weights(final, _checkpoint_state(out, 10))
    assert not torch.equal(best["fc.weight"], final["fc.weight"])


@pytest.mark.multiprocess
def test_a_relaunch_keeps_the_best_of_the_steps_it_keeps_and_drops_a_best_it_rolls_back(
    tiny_target_dir, train_data, best_run, tmp_path
):
    """A kill after the best's checkpoint keeps best/ as the best to beat; a kill before it (best/ is from steps the
    relaunch trains again) removes best/, and the retrained run exports the same best again."""
    run, _ = best_run
    reference = json.loads((run / "train_summary.json").read_text())["best"]
    b = reference["step"]
    job = {**BEST_RUN}

    # Killed after checkpoint b + 1: best/ (step b) is kept, and no later eval replaces it (none beats it).
    after = _rolled_back_to(run, tmp_path / "after" / "draft", b + 1)
    before = _tree(after / "best")
    log = _single_process(_job(tiny_target_dir, train_data, after, **job))
    assert f"resuming from checkpoint step-{b + 1:08d}" in log
    assert "TRAIN_BEST" not in log and f"removing {after / 'best'}" not in log
    assert _tree(after / "best") == before  # not exported again
    assert json.loads((after / "train_summary.json").read_text())["best"] == {**reference, "dir": str(after / "best")}

    # Killed after checkpoint b - 1 (b = 1: before any checkpoint): best/ is from a rolled-back future. It is removed
    # before training, then step b is trained, evaluated and exported again: the same draft as the finished run's.
    rolled = _rolled_back_to(run, tmp_path / "rolled" / "draft", b - 1)
    if b == 1:
        import shutil

        shutil.rmtree(rolled / "checkpoints")
    log = _single_process(_job(tiny_target_dir, train_data, rolled, **job))
    assert (
        f"train: removing {rolled / 'best'}: its eval at step {b} is past the resumed step {b - 1}: those steps are "
        "trained and evaluated again"
    ) in log
    assert f"TRAIN_BEST step={b} " in log
    if b > 1:  # the best eval up to the resumed step lost its export to the rolled-back one: still the one to beat
        assert "has no export left; the next eval that beats it is exported" in log
    got = json.loads((rolled / "train_summary.json").read_text())["best"]
    assert (got["step"], got["acceptance_length"]) == (b, reference["acceptance_length"])
    assert got["dir"] == str(rolled / "best")
    _assert_same_weights(_final_state(rolled, "best"), _final_state(run, "best"), atol=1e-6)


@pytest.mark.multiprocess
def test_without_held_out_evals_there_is_no_best_and_final_is_the_draft(
    tiny_target_dir, train_data, best_run, tmp_path
):
    import shutil

    out = tmp_path / "no-eval" / "draft"
    out.mkdir(parents=True)
    shutil.copytree(best_run[0] / "best", out / "best")  # left by another run: a fresh start is not its future
    log = _single_process(_job(tiny_target_dir, train_data, out, **{**ONE_RANK, "eval_fraction": 0.0}))
    assert f"train: removing {out / 'best'}: its eval at step " in log
    assert not (out / "best").exists() and "TRAIN_BEST" not in log and "TRAIN_EVAL" not in log
    summary = json.loads((out / "train_summary.json").read_text())
    assert summary["best"] is None and summary["eval"] is None
    assert "no held-out eval (train.eval_fraction 0): no best/, the draft is final/" in log
    assert validate_export(out / "final") == []


@pytest.mark.multiprocess
def test_lm_head_init_target_starts_the_head_at_the_target_s_rows_of_the_draft_tokens(
    tiny_target_dir, train_data, tmp_path
):
    """One step at a vanishing learning rate: the exported head is still its start, the target lm_head's rows of
    the exported d2t's tokens, read here from the target's own safetensors file."""
    from safetensors.torch import load_file

    out = tmp_path / "target-head" / "draft"
    job = {**ONE_RANK, "max_steps": 1, "lr": 1e-12, "warmup_ratio": 0.0, "lm_head_init": "target"}
    _single_process(_job(tiny_target_dir, train_data, out, **job))
    state = _final_state(out)
    head = load_file(str(tiny_target_dir / "model.safetensors"))["lm_head.weight"]
    ids = torch.arange(state["d2t"].shape[0]) + state["d2t"]
    torch.testing.assert_close(state["lm_head.weight"], head[ids].float(), rtol=0, atol=1e-6)
    fingerprint = json.loads(next((out / "checkpoints").glob("step-*/fingerprint.json")).read_text())
    assert fingerprint["settings"]["lm_head_init"] == "target"  # another start: another run


@pytest.mark.multiprocess
def test_speculators_recipe_trains_muon_updates_and_exports_its_norms(tiny_target_dir, train_data, tmp_path):
    """speculators' choices in our trainer: Muon, norm_before_fc/_residual, every TTT step weighted alike. Muon's update
    of a matrix is orthogonalized: fc's change from step 1 to step 2 has a flat spectrum, its top half of singular
    values within a few-fold (Newton-Schulz's five steps leave the smallest ones short), where AdamW's step on the same
    run spreads its top half 38-fold."""
    out = tmp_path / "speculators-recipe" / "draft"
    recipe = {"optimizer": "muon", "zero_stage": 0, "norm_before_fc": True, "norm_before_residual": True}
    recipe["ttt_step_weight"] = 1.0
    job = {**ONE_RANK, "max_steps": 2, "checkpoint_every": 1, "warmup_ratio": 0.0, **recipe}
    # DeepSpeed's Muon compiles its Newton-Schulz steps with torch.compile (deepspeed/runtime/zero/muon/
    # original_muon.py): on a CPU, inductor's C++ kernels, about 25 s of a core where its cache is empty (a CI machine).
    # The same update runs eagerly here; what is asserted is its result.
    _single_process(_job(tiny_target_dir, train_data, out, **job), TORCH_COMPILE_DISABLE="1")
    step = [_checkpoint_state(out, n)["fc.weight"].double() for n in (1, 2)]
    singular = torch.linalg.svdvals(step[1] - step[0])
    assert singular[0] / singular[len(singular) // 2] < 4, singular  # measured 1.8 here; AdamW's step: 38
    # whole: ZeRO-2's DeepSpeed clips the update itself to grad_clip, about 50-fold smaller (2 ranks: 0.0335 -> 0.0006)
    assert (step[1] - step[0]).norm() > 0.01
    assert json.loads((out / "ds_config.json").read_text())["optimizer"]["type"] == "Muon"
    config = json.loads((out / "final" / "config.json").read_text())
    assert config["norm_before_fc"] is True and config["norm_before_residual"] is True
    assert "input_norm.weight" in _final_state(out)
    settings = json.loads(next((out / "checkpoints").glob("step-*/fingerprint.json")).read_text())["settings"]
    assert (settings["optimizer"], settings["ttt_step_weight"], settings["draft.norm_before_fc"]) == ("muon", 1.0, True)
    from models.export.vllm import validate_export_vllm

    assert validate_export_vllm(out / "final") == []  # served by vLLM; SGLang's check names its one limit
    assert [p.split(":")[0] for p in validate_export(out / "final")] == ["norm_before_residual"]


# --- fingerprints: a relaunch resumes only its own run --------------------------------------------


def _fingerprint(rows=(("D", "a", 5), ("D", "b", 7)), d2t=(0, 0, 1), **over):
    from models.draft.config import Eagle3Config
    from models.train.checkpoint import run_fingerprint
    from models.train.data import data_fingerprint

    fields = {
        "target": {"path": "t"},
        "out_dir": "o",
        "token_counts": "tc.parquet",
        "hidden_dir": "h",
        "lr": 2e-3,
        "grad_accum": 2,
        "device": "cpu",
    }
    total_steps = over.pop("total_steps", 6)
    world_size = over.pop("world_size", 2)
    job = TrainJobFile(**{**fields, **over})
    layer = dict(hidden_size=8, intermediate_size=16, num_attention_heads=2, num_key_value_heads=1)
    config = Eagle3Config(**layer, vocab_size=10, draft_vocab_size=3, aux_layers=[0, 1, 2])
    data = data_fingerprint(rows, {"mode": "offline", "aux_layers": [0, 1, 2]})
    return run_fingerprint(job, data, torch.tensor(d2t), config, world_size, total_steps)


def test_fingerprint_names_what_differs_and_ignores_how_the_run_is_watched():
    from models.train.checkpoint import fingerprint_differences

    base = _fingerprint()
    assert fingerprint_differences(base, _fingerprint()) == []
    # How often to log, save and evaluate may change between launches.
    assert (
        fingerprint_differences(base, _fingerprint(log_every=1, checkpoint_every=7, keep_checkpoints=9, eval_every=3))
        == []
    )
    assert fingerprint_differences(base, _fingerprint(lr=1e-3)) == ["settings: lr 0.002 -> 0.001"]
    assert fingerprint_differences(base, _fingerprint(ttt_steps=5, world_size=4)) == [
        "settings: ttt_steps 7 -> 5, world size (train.num_gpus) 2 -> 4"
    ]
    assert fingerprint_differences(base, _fingerprint(total_steps=12)) == [
        "settings: total steps (epochs/max_steps; the cosine schedule spans them) 6 -> 12"
    ]
    assert fingerprint_differences(base, _fingerprint(rows=[("D", "a", 5)])) == ["data: samples 2 -> 1, tokens 12 -> 5"]
    # Same counts, another sample: the digest still tells.
    assert fingerprint_differences(base, _fingerprint(rows=[("D", "a", 5), ("D", "c", 7)])) == [
        "data: same number of samples and tokens, other ids or lengths"
    ]
    assert fingerprint_differences(base, _fingerprint(d2t=(0, 1, 1))) == [
        "draft vocabulary: other tokens (from tc.parquet)"
    ]
    # The order of the index does not matter: a resumed capture may have sharded differently.
    assert fingerprint_differences(base, _fingerprint(rows=[("D", "b", 7), ("D", "a", 5)])) == []


def test_check_fingerprint_refuses_another_run_and_warns_for_old_checkpoints(tmp_path, capsys):
    from models.train.checkpoint import FINGERPRINT, CheckpointMismatch, check_fingerprint

    ckpts = tmp_path / "checkpoints"
    check_fingerprint(ckpts, _fingerprint(), warn=True)  # nothing to resume: nothing to check
    tag = ckpts / "step-00000004"
    tag.mkdir(parents=True)
    (tag / "COMPLETE").write_text("{}")
    check_fingerprint(ckpts, _fingerprint(), warn=True)  # written before fingerprints: resumed, with a warning
    assert f"checkpoint step-00000004 has no {FINGERPRINT}" in capsys.readouterr().err
    (tag / FINGERPRINT).write_text(json.dumps(_fingerprint()))
    check_fingerprint(ckpts, _fingerprint(), warn=True)
    with pytest.raises(CheckpointMismatch) as info:
        check_fingerprint(ckpts, _fingerprint(lr=1e-3, rows=[("D", "a", 5)]), warn=True)
    message = str(info.value)
    assert message.startswith(
        f"cannot resume {tag}: it was trained on other data or settings than this launch's "
        "(data: samples 2 -> 1, tokens 12 -> 5; settings: lr 0.002 -> 0.001)"
    )
    assert f"set train.out_dir to a new directory or move {ckpts} aside" in message
    assert sorted(p.name for p in tag.iterdir()) == ["COMPLETE", FINGERPRINT]  # nothing touched


def _error_reports(output: str) -> list[dict]:
    from models.train.job import ERROR_MARK

    return [
        json.loads(line.removeprefix(ERROR_MARK + " "))
        for line in output.splitlines()
        if line.startswith(ERROR_MARK + " ")
    ]


def _error_report(stderr: str) -> dict:
    reports = _error_reports(stderr)
    assert len(reports) == 1, stderr[-4000:]
    return reports[0]


def _tree(directory: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(directory)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in directory.rglob("*")
        if p.is_file()
    }


@pytest.mark.multiprocess
def test_relaunch_on_other_data_or_settings_is_refused_before_training(
    tiny_target_dir, train_data, one_rank_run, tmp_path
):
    """Changed lr, data or length: exit 1 naming the change, checkpoints untouched.

    Watch settings and old checkpoints resume.
    """
    import shutil

    from models.capture.shards import list_shards

    one_rank = ONE_RANK
    out = tmp_path / "run" / "draft"
    shutil.copytree(one_rank_run, out)  # the finished run (3 steps, its checkpoint at step 3), relaunched below
    fingerprint = json.loads((out / "checkpoints" / "step-00000003" / "fingerprint.json").read_text())
    samples, tokens = fingerprint["data"]["samples"], fingerprint["data"]["tokens"]
    before = _tree(out)

    lower_lr = {**one_rank, "lr": 1e-3}
    proc = _run_single(_job(tiny_target_dir, train_data, out, **lower_lr))
    assert proc.returncode == 1
    report = _error_report(proc.stderr)
    assert report["type"] == "CheckpointMismatch" and report["kind"] == "invalid"
    assert report["message"].startswith(
        f"cannot resume {out / 'checkpoints' / 'step-00000003'}: it was trained on other "
        "data or settings than this launch's (settings: lr 0.002 -> 0.001)"
    )
    assert f"set train.out_dir to a new directory or move {out / 'checkpoints'} aside" in report["message"]
    assert "Traceback" not in proc.stderr and "resuming" not in proc.stderr
    assert _tree(out) == before  # nothing trained, written or removed

    fewer = tmp_path / "fewer_hidden"
    shutil.copytree(train_data["hidden"], fewer)
    dropped = list_shards(fewer)[-1]
    from models.capture.shards import shard_metadata

    gone = shard_metadata(dropped)["samples"]
    dropped.unlink()
    proc = _run_single(_job(tiny_target_dir, {**train_data, "hidden": fewer}, out, **one_rank))
    assert proc.returncode == 1
    message = _error_report(proc.stderr)["message"]
    assert (
        f"(data: samples {samples:,} -> {samples - len(gone):,}, "
        f"tokens {tokens:,} -> {tokens - sum(s['length'] for s in gone):,})"
    ) in message
    assert _tree(out) == before

    proc = _run_single(_job(tiny_target_dir, train_data, out, **{**one_rank, "max_steps": 4}))
    assert proc.returncode == 1
    assert (
        "settings: total steps (epochs/max_steps; the cosine schedule spans them) 3 -> 4)"
        in _error_report(proc.stderr)["message"]
    )
    assert _tree(out) == before

    # How the run is watched may change: the finished run resumes (and trains nothing).
    log = _single_process(
        _job(
            tiny_target_dir,
            train_data,
            out,
            **{**one_rank, "eval_every": 1, "log_every": 5, "checkpoint_every": 1, "keep_checkpoints": 5},
        )
    )
    assert "resuming from checkpoint step-00000003" in log
    # A checkpoint from before fingerprints resumes with a warning.
    (out / "checkpoints" / "step-00000003" / "fingerprint.json").unlink()
    log = _single_process(_job(tiny_target_dir, train_data, out, **one_rank))
    assert "checkpoint step-00000003 has no fingerprint.json (written before fingerprints)" in log
    assert "resuming from checkpoint step-00000003" in log


@pytest.fixture
def small_disk(tmp_path, tmpfs):
    """A 10 MiB tmpfs (root only): room for one checkpoint of the tiny draft on 2 ranks (6.4 MB), not two."""
    with tmpfs(tmp_path / "disk", "10m") as disk:
        yield disk


@pytest.mark.multiprocess
def test_full_disk_stops_training_at_once_and_keeps_the_last_checkpoint(tiny_target_dir, train_data, small_disk, tmpfs):
    """A real ENOSPC in the step-4 save: exit 1 with one clear report, step 2 kept intact.

    After the disk grows, a rerun finishes.
    """
    import re

    out = small_disk / "draft"
    ckpts = out / "checkpoints"
    job = _job(tiny_target_dir, train_data, out)  # 2 ranks, checkpoints at 2, 4, 6
    proc = subprocess.run(
        _launch_cmd(job), env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0, output[-4000:]
    written = [r for r in _error_reports(proc.stderr) if r["kind"] == "write_failed"]
    assert written, output[-6000:]
    for report in written:  # the rank(s) whose write failed, each in one line
        assert re.fullmatch(
            rf"cannot write {re.escape(str(ckpts / 'step-00000004'))}\S*: disk full: [\d,]+ bytes free on "
            rf"{re.escape(str(small_disk))}\. "
            rf"kept: checkpoint step-00000002 \(complete, step 2\) in {re.escape(str(ckpts))}\. "
            r"to resume: make room there \(or set train.out_dir to a disk with room\), then run the train stage again: "
            r"it resumes from the kept checkpoint",
            report["message"],
        ), report["message"]
        assert f"train rank {report['rank']} failed: {report['message']}" in proc.stderr
    # Stopped at once: nothing after the failed save, which never became a checkpoint.
    assert "TRAIN_CHECKPOINT step=2" in proc.stdout and "TRAIN_CHECKPOINT step=4" not in proc.stdout
    assert "step=5" not in proc.stdout
    assert complete_checkpoints(ckpts) == [(2, "step-00000002")]
    assert (ckpts / "latest").read_text() == "step-00000002"
    assert not (ckpts / "step-00000004" / "COMPLETE").exists()
    kept = torch.load(ckpts / "step-00000002" / "mp_rank_00_model_states.pt", weights_only=False)  # readable, whole
    assert kept["position"]["step"] == 2
    assert not (out / "final").exists()

    # Read-only now (a remount after an I/O error does that): refused at the first write, before training.
    before = _tree(out)
    tmpfs.remount(small_disk, "ro")
    proc = subprocess.run(
        _launch_cmd(job), env=cpu_env(), cwd=REPO, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S
    )
    assert proc.returncode != 0
    assert [r["message"] for r in _error_reports(proc.stderr)] == [
        f"cannot write {out / 'ds_config.json'}: read-only file system. kept: checkpoint step-00000002 "
        f"(complete, step 2) in {ckpts}. to resume: make room there (or set train.out_dir to a disk with room), "
        "then run the train stage again: it resumes from the kept checkpoint"
    ], proc.stderr[-4000:]
    assert _tree(out) == before

    tmpfs.remount(small_disk, "rw,size=64m")
    log = _torchrun(job)
    assert "removing incomplete checkpoint step-00000004" in log
    assert "resuming from checkpoint step-00000002 (step 2" in log
    assert json.loads((out / "train_summary.json").read_text())["steps"] == 6
    assert [x["step"] for x in _metric_lines(out) if x["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # each step once
    assert validate_export(out / "final") == []


def _fill(disk: Path) -> None:
    """Write zeros until the filesystem refuses."""
    with open(disk / "filler", "wb") as f:
        try:
            while True:
                f.write(bytes(1 << 20))
                f.flush()
        except OSError:
            pass


def test_a_full_disk_under_metrics_or_torch_save_is_a_write_failure_naming_the_file(small_disk):
    from models.common.file_errors import WriteFailed
    from models.train.checkpoint import writing

    writer = MetricsWriter(small_disk, resumed_step=0, enabled=True)
    writer.write({"kind": "train", "step": 1, "loss": 1.0})
    _fill(small_disk)
    with pytest.raises(WriteFailed) as info:
        for step in range(2, 10_000):  # the page cache takes a few lines before the disk refuses
            writer.write({"kind": "train", "step": step, "loss": 1.0, "pad": "x" * 4096})
    assert str(info.value).startswith(f"cannot write {small_disk / 'metrics.jsonl'}: disk full: ")
    assert f"kept: no complete checkpoint in {small_disk / 'checkpoints'} yet" in str(info.value)
    # torch.save says only "unexpected pos ..." on a full disk: the probe write finds the reason.
    with pytest.raises(WriteFailed, match=r"^cannot write .*/ckpt: disk full: [\d,]+ bytes free on "):
        with writing(small_disk / "ckpt", small_disk / "checkpoints"):
            torch.save(torch.zeros(1 << 20), small_disk / "ckpt")
    # Any other error in a guarded write is not disguised as a storage problem.
    (small_disk / "filler").unlink()
    with pytest.raises(RuntimeError, match="^not storage$"):
        with writing(small_disk / "ckpt", small_disk / "checkpoints"):
            raise RuntimeError("not storage")
    assert not list(small_disk.glob(".write-probe-*"))


def test_the_deepspeed_config_is_derived_on_the_rank_for_the_launch_s_world_size():
    # the job holds settings, not a DeepSpeed config for some world size: a launch of any size is consistent
    assert "ds_config" not in TrainJobFile.model_fields
    job = TrainJobFile(
        target=Target(path="t"), out_dir="o", token_counts="c", hidden_dir="h", device="cpu", grad_accum=3
    )
    assert ds_train_config(job, world_size=2, bf16=job.bf16)["train_batch_size"] == 6
    assert ds_train_config(job, world_size=4, bf16=job.bf16)["train_batch_size"] == 12
    assert not job.bf16 and TrainJobFile(**{**job.model_dump(), "device": "cuda"}).bf16  # precision auto: bf16 on GPUs
    assert not TrainJobFile(**{**job.model_dump(), "device": "cuda", "precision": "fp32"}).bf16
