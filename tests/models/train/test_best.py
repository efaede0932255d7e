"""The best held-out eval: which eval is the best, what a relaunch keeps of best/, and what the summary says.

Plain functions on files; tests/models/train/test_job.py runs the real ranks (best/ against the checkpoint of its step,
a relaunch before and after the best's checkpoint, a run without held-out evals).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from models.ranks.harness import Dist
from models.train.best import Best, BestDraft, beats, best_eval, describe, read_marker, resume_best


def _eval(step: int, acceptance_length: float, loss: float = 1.0) -> dict:
    return {
        "kind": "eval",
        "step": step,
        "epoch": step // 4,
        "time": 0.0,
        "acceptance_length": acceptance_length,
        "loss": loss,
    }


def _metrics(out: Path, rows: list[dict]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    train = [{"kind": "train", "step": r["step"], "loss": 2.0} for r in rows]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in train + rows) + '{"kind": "ev')


def _export(directory: Path) -> None:
    """Stands in for export_draft: replaces the directory whole, as it does."""
    import shutil

    if directory.exists():
        shutil.rmtree(directory)
    directory.mkdir()
    (directory / "config.json").write_text("{}")


def _best_dir(out: Path, step: int, acceptance_length: float) -> Path:
    _export(out / "best")
    (out / "best" / "best.json").write_text(
        json.dumps({"step": step, "epoch": step // 4, "acceptance_length": acceptance_length, "loss": 1.0})
    )
    return out / "best"


def test_the_best_is_strictly_greater_the_first_of_equals_and_never_nan():
    rows = [_eval(1, 1.5), _eval(2, 2.25), _eval(3, 2.25), _eval(4, float("nan")), _eval(5, 2.0)]
    assert best_eval(rows) == Best(step=2, epoch=0, acceptance_length=2.25, loss=1.0)
    assert best_eval([]) is None
    assert beats(1.0, None) and not beats(float("nan"), None)
    assert beats(2.5, best_eval(rows)) and not beats(2.25, best_eval(rows))


def test_a_relaunch_keeps_best_when_it_holds_the_best_eval_up_to_the_resumed_step(tmp_path, capsys):
    _metrics(tmp_path, [_eval(2, 1.5), _eval(4, 2.0), _eval(6, 1.75), _eval(8, 2.5)])
    _best_dir(tmp_path, 4, 2.0)
    # resumed at 6: the eval at 8 is dropped (and will be made again); the best up to 6 is step 4's, in best/
    assert resume_best(tmp_path, resumed_step=6) == (Best(4, 1, 2.0, 1.0), True)
    assert (tmp_path / "best" / "config.json").is_file() and capsys.readouterr().err == ""


def test_a_relaunch_removes_a_best_from_the_steps_it_rolls_back(tmp_path, capsys):
    # best/ was exported at step 8, past the checkpoint the relaunch resumes (6): that future is trained again
    _metrics(tmp_path, [_eval(2, 1.5), _eval(4, 2.0), _eval(6, 1.75), _eval(8, 2.5)])
    _best_dir(tmp_path, 8, 2.5)
    assert resume_best(tmp_path, resumed_step=6) == (Best(4, 1, 2.0, 1.0), False)
    assert not (tmp_path / "best").exists()
    err = capsys.readouterr().err
    assert (
        f"train: removing {tmp_path / 'best'}: its eval at step 8 is past the resumed step 6: those steps are trained "
        "and evaluated again"
    ) in err
    # step 4's export was replaced by step 8's: step 4 stays the one to beat, without a draft
    assert "the best held-out eval so far (step 4, acceptance length 2.000) has no export left" in err

    # A fresh start (step 0) keeps nothing of a best/ left in the directory.
    _best_dir(tmp_path, 2, 1.5)
    assert resume_best(tmp_path, resumed_step=0) == (None, False)
    assert not (tmp_path / "best").exists()


def test_a_relaunch_removes_a_best_without_its_record_or_not_the_best(tmp_path, capsys):
    _metrics(tmp_path, [_eval(2, 1.5), _eval(4, 2.0)])
    _export(tmp_path / "best")  # a kill between the export and best.json
    assert read_marker(tmp_path / "best") is None
    assert resume_best(tmp_path, resumed_step=4) == (Best(4, 1, 2.0, 1.0), False)
    assert not (tmp_path / "best").exists() and "it has no best.json" in capsys.readouterr().err
    _best_dir(tmp_path, 2, 1.5)
    assert resume_best(tmp_path, resumed_step=4) == (Best(4, 1, 2.0, 1.0), False)
    assert not (tmp_path / "best").exists()
    assert "its eval at step 2 is not the best one up to step 4" in capsys.readouterr().err


def test_the_keeper_exports_only_a_better_eval_and_summarises_it(tmp_path):
    exports: list[Path] = []

    def export(directory: Path) -> None:
        exports.append(directory)
        _export(directory)

    keeper = BestDraft(tmp_path, resumed_step=0, dist=Dist(), export=export)
    assert keeper.summary(last_step=0) is None
    assert describe(None) == "no held-out eval (train.eval_fraction 0): no best/, the draft is final/"
    assert keeper.offer(1, 0, {"acceptance_length": 1.5, "loss": 3.0}) == Best(1, 0, 1.5, 3.0)
    assert keeper.offer(2, 0, {"acceptance_length": 1.5, "loss": 2.0}) is None  # equal: the first stays
    assert keeper.offer(3, 0, {"acceptance_length": 1.75, "loss": 2.5}) == Best(3, 0, 1.75, 2.5)
    assert keeper.offer(4, 1, {"acceptance_length": 1.25, "loss": 2.0}) is None
    assert exports == [tmp_path / "best"] * 2
    assert read_marker(tmp_path / "best") == Best(3, 0, 1.75, 2.5)
    summary = keeper.summary(last_step=4)
    assert summary == {
        "step": 3,
        "epoch": 0,
        "acceptance_length": 1.75,
        "loss": 2.5,
        "dir": str(tmp_path / "best"),
        "last": False,
    }
    assert (
        describe(summary)
        == f"the best held-out eval is at step 3, acceptance length 1.750: its draft is in {tmp_path / 'best'}"
    )
    assert describe(keeper.summary(last_step=3)).startswith(
        "the best held-out eval is the last step's (step 3, acceptance length 1.750): "
    )
    assert describe({**summary, "dir": None}) == (
        "the best held-out eval (step 3, acceptance length 1.750) has no export: a relaunch rolled it back, no later "
        "eval beat it"
    )


def test_only_rank_0_exports(tmp_path, monkeypatch):
    monkeypatch.setattr(Dist, "barrier", lambda self: None)
    keeper = BestDraft(tmp_path, resumed_step=0, dist=Dist(rank=1, world_size=2), export=pytest.fail)
    assert keeper.offer(1, 0, {"acceptance_length": 2.0, "loss": 1.0}) is None
    assert not (tmp_path / "best").exists()
