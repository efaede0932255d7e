"""The train flow's Prefect retries: a killed job is relaunched (it resumes), a failed write stops the run in one line.

The ranks are replaced by a stand-in for `run_job` that prints what real ranks print (their
protocol lines and the TRAIN_ERROR report) and fails the way the launcher fails: the flow, its task
options from the config and the retry condition are the real ones. tests/models/train/test_job.py
shows the real ranks producing those reports (a full tmpfs, a changed fingerprint).
"""

from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import yaml

from models.common.file_errors import WriteFailed
from models.common.rank_protocol import error_report
from models.train.checkpoint import RESUME
from models.train.job import ERROR_MARK
from tasks.runtime.launch_ranks import RankFailure

REPO = Path(__file__).resolve().parents[2]


def _config(tmp_path: Path, **train) -> Path:
    data = yaml.safe_load((REPO / "configs/demo.yaml").read_text())
    data["run_dir"] = str(tmp_path / "run")
    data["target"] = {"path": str(tmp_path / "target")}
    data["datasets"] = [{**d, "path": str(REPO / d["path"])} for d in data["datasets"]]
    data["train"] = {**data["train"], "retry_delay_s": 0, **train}
    path = tmp_path / "train.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


class Ranks:
    """Stand-in for tasks.runtime.launch_ranks.run_job: each launch plays the next scripted outcome."""

    def __init__(self, draft_dir: Path, outcomes: list[str]):
        self.draft_dir, self.outcomes, self.launches = draft_dir, outcomes, []

    def __call__(self, command, *, env=None, on_line):
        self.launches.append(command)
        outcome = self.outcomes[len(self.launches) - 1]
        on_line("TRAIN_PROGRESS step=2 total=4 tokens=100")
        if outcome == "killed":  # SIGKILL: no report, the launcher says the rank died
            raise RankFailure("job exited with code 1: torchrun ...\n--- last output ---\nexitcode: -9 (SIGKILL)")
        if outcome == "disk full":
            failed = WriteFailed(
                self.draft_dir / "checkpoints" / "step-00000004",
                OSError(errno.ENOSPC, "No space left on device"),
                kept="checkpoint step-00000002 (complete, step 2)",
                resume=RESUME,
            )
            on_line(f"{ERROR_MARK} {json.dumps(error_report(failed, 0))}")
            on_line(f"train rank 0 failed: {failed}")
            raise RankFailure(
                "job exited with code 1: torchrun ...\n--- last output ---\nTraceback (most recent call last): ..."
            )
        assert outcome == "done"
        self.draft_dir.mkdir(parents=True, exist_ok=True)
        common = {"epoch": 0, "per_step_loss": [0.5], "per_step_acc": [0.5], "acceptance_length": 1.8}
        rows = [
            {"kind": "train", "step": s, "time": 1.0 + s, "loss": 1.0 / s, "lr": 1e-3, "tokens": 50 * s, **common}
            for s in (3, 4)
        ]
        rows.append({"kind": "eval", "step": 4, "time": 9.0, "loss": 0.5, "tokens": 20, **common})
        (self.draft_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        best = {"step": 4, "epoch": 0, "acceptance_length": 1.8, "loss": 0.5, "dir": str(self.draft_dir / "best")}
        on_line(f"TRAIN_BEST step=4 acceptance_length=1.800 dir={best['dir']}")
        (self.draft_dir / "train_summary.json").write_text(
            json.dumps({"final": str(self.draft_dir / "final"), "best": {**best, "last": True}, "steps": 4})
        )
        on_line("TRAIN_DONE final=...")


def test_a_killed_training_job_is_retried_and_resumes(tmp_path, monkeypatch):
    from flows.train import train

    config = _config(tmp_path, retries=2)
    ranks = Ranks(tmp_path / "run" / "draft", ["killed", "killed", "done"])
    monkeypatch.setattr("tasks.train.tasks.run_job", ranks)
    result = train(str(config))
    assert result["steps"] == 4 and len(ranks.launches) == 3
    assert result["best"]["step"] == 4 and result["best"]["dir"] == str(tmp_path / "run" / "draft" / "best")
    assert all("models.train" in command for command in ranks.launches)


def test_retries_come_from_the_config(tmp_path, monkeypatch):
    from flows.train import train
    from tasks.train.tasks import TrainFailed

    ranks = Ranks(tmp_path / "run" / "draft", ["killed", "killed", "done"])
    monkeypatch.setattr("tasks.train.tasks.run_job", ranks)
    with pytest.raises(TrainFailed, match="died without reporting an error"):
        train(str(_config(tmp_path, retries=1)))
    assert len(ranks.launches) == 2


def test_a_full_disk_stops_the_train_flow_at_once_with_the_ranks_message(tmp_path, monkeypatch):
    from flows.train import train

    ranks = Ranks(tmp_path / "run" / "draft", ["disk full", "done"])
    monkeypatch.setattr("tasks.train.tasks.run_job", ranks)
    with pytest.raises(WriteFailed) as info:
        train(str(_config(tmp_path, retries=2)))
    assert len(ranks.launches) == 1  # a retry would fill the same disk again
    assert str(info.value).startswith(
        f"cannot write {tmp_path / 'run' / 'draft' / 'checkpoints' / 'step-00000004'}: disk full: "
    )
    assert str(info.value).endswith(". kept: checkpoint step-00000002 (complete, step 2). to resume: " + RESUME)
    assert "\n" not in str(info.value)
