"""How a failed training job reaches the pipeline: the rank's own exception, and whether a retry can help."""

from __future__ import annotations

import errno
import pickle

from prefect.states import Failed

from models.common.file_errors import WriteFailed
from models.common.rank_protocol import error_report
from models.train.checkpoint import RESUME, CheckpointMismatch
from tasks.runtime.launch_ranks import RankFailure
from tasks.train.tasks import TrainFailed, error_line, job_failure, retry_train_job

KILLED = RankFailure("job exited with code 1: python -m torch.distributed.run ...\n--- last output ---\nTraceback ...")


def _retried(error: Exception) -> bool:
    return retry_train_job(None, None, Failed(data=error))


def test_a_failed_write_is_raised_with_the_ranks_words_and_not_retried(tmp_path):
    written = WriteFailed(
        tmp_path / "checkpoints" / "step-00000004",
        OSError(errno.ENOSPC, "No space left on device"),
        kept="checkpoint step-00000002 (complete, step 2)",
        resume=RESUME,
    )
    # The rank saw "0 bytes free"; the pipeline must say what the rank saw, not what the disk says later.
    report = {**error_report(written, 1), "message": str(written).replace("bytes free", "bytes free (at the failure)")}
    other = error_report(RuntimeError("Connection closed by peer"), 0)  # a rank that lost its peer
    error = job_failure([other, report], KILLED)
    assert isinstance(error, WriteFailed) and str(error) == report["message"]
    assert "\n" not in str(error) and "Traceback" not in str(error)  # `eagle3 run` prints it in one line
    assert error.errno == errno.ENOSPC and error.kept == "checkpoint step-00000002 (complete, step 2)"
    assert not _retried(error)


def test_a_checkpoint_of_another_run_and_bad_input_are_not_retried():
    refused = job_failure(
        [error_report(CheckpointMismatch("cannot resume X: ... (settings: lr 0.002 -> 0.001) ..."), 0)], KILLED
    )
    assert (
        isinstance(refused, CheckpointMismatch)
        and str(refused) == "cannot resume X: ... (settings: lr 0.002 -> 0.001) ..."
    )
    assert not _retried(refused)
    invalid = job_failure([error_report(ValueError("no training samples (all held out or none captured)"), 0)], KILLED)
    assert isinstance(invalid, TrainFailed) and not invalid.retryable
    assert str(invalid) == "train rank 0: no training samples (all held out or none captured)"
    assert not _retried(invalid)
    assert not _retried(ValueError("a bug in the task itself"))


def test_a_crashed_or_killed_rank_is_retried():
    crashed = job_failure([error_report(RuntimeError("NCCL watchdog timeout"), 3)], KILLED)
    assert isinstance(crashed, TrainFailed) and crashed.retryable
    assert str(crashed).startswith("train rank 3 failed: RuntimeError: NCCL watchdog timeout\njob exited with code 1")
    assert _retried(crashed)
    killed = job_failure([], KILLED)  # SIGKILL (out of memory, a lost node): no report at all
    assert killed.retryable and str(killed).startswith("the training job died without reporting an error")
    assert _retried(killed)
    again = pickle.loads(pickle.dumps(killed))  # Prefect may persist the exception
    assert isinstance(again, TrainFailed) and again.retryable and str(again) == str(killed)


def test_error_lines_are_read_even_when_prefixed():
    assert error_line('TRAIN_ERROR {"rank": 1, "kind": "invalid"}') == {"rank": 1, "kind": "invalid"}
    assert error_line('[default1]:TRAIN_ERROR {"rank": 1}') == {"rank": 1}  # torchrun --tee style prefix
    assert error_line('TRAIN_ERROR {"rank": 0') is None  # cut short by a kill
    assert error_line("TRAIN_PROGRESS step=1 total=6 tokens=10") is None


def test_the_report_takes_the_measured_value_of_an_eval_of_this_training_only(tmp_path):
    import json
    import os

    from tasks.train.tasks import measured_acceptance

    assert measured_acceptance(tmp_path, 3) is None
    (tmp_path / "train_summary.json").write_text("{}")
    (tmp_path / "eval.json").write_text(json.dumps({"num_steps": 3, "trained": {"acceptance_length": 1.81}}))
    os.utime(tmp_path / "train_summary.json", (1000, 1000))
    assert measured_acceptance(tmp_path, 3) == 1.81
    assert measured_acceptance(tmp_path, 4) is None  # measured at another chain length
    os.utime(tmp_path / "eval.json", (500, 500))  # an eval of the draft before this training
    assert measured_acceptance(tmp_path, 3) is None


def test_the_report_reads_the_best_from_the_summary_when_it_has_one(tmp_path):
    import json

    from tasks.train.tasks import trained_best

    assert trained_best(tmp_path) is False  # no summary yet
    (tmp_path / "train_summary.json").write_text(json.dumps({"steps": 4}))
    assert trained_best(tmp_path) is False  # written before best/ existed
    (tmp_path / "train_summary.json").write_text(json.dumps({"steps": 4, "best": None}))
    assert trained_best(tmp_path) is None  # no held-out evals
    best = {"step": 2, "epoch": 0, "acceptance_length": 1.5, "loss": 1.0, "dir": str(tmp_path / "best"), "last": False}
    (tmp_path / "train_summary.json").write_text(json.dumps({"steps": 4, "best": best}))
    assert trained_best(tmp_path) == best
