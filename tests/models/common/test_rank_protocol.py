"""The rank protocol: every line parses back to what was formatted, and a failed rank's report to its own exception."""

from __future__ import annotations

import errno

import pytest

from models.common.file_errors import DamagedFile, DamagedShard, WriteFailed
from models.common.rank_protocol import (
    CAPTURE,
    CAPTURE_PROGRESS,
    EVAL,
    EVAL_PROGRESS,
    TRAIN,
    TRAIN_BEST,
    TRAIN_CHECKPOINT,
    TRAIN_DONE,
    TRAIN_EVAL,
    TRAIN_PROGRESS,
    error_report,
    most_telling,
    reported_error,
)
from tests.rank_failures import shard_write_failed


@pytest.mark.parametrize(
    "protocol, kind, values, text",
    [
        (
            CAPTURE,
            CAPTURE_PROGRESS,
            {"rank": 1, "done": 3, "total": 7, "tokens": 1200},
            "CAPTURE_PROGRESS rank=1 done=3 total=7 tokens=1200",
        ),
        (TRAIN, TRAIN_PROGRESS, {"step": 0, "total": 6, "tokens": 0}, "TRAIN_PROGRESS step=0 total=6 tokens=0"),
        (
            TRAIN,
            TRAIN_PROGRESS,
            {"step": 2, "total": 6, "tokens": 90, "loss": 1.25, "lr": 0.0002},
            "TRAIN_PROGRESS step=2 total=6 tokens=90 loss=1.2500 lr=0.0002",
        ),
        (
            TRAIN,
            TRAIN_EVAL,
            {"step": 4, "acceptance_length": 1.875, "loss": 0.5},
            "TRAIN_EVAL step=4 acceptance_length=1.875 loss=0.5000",
        ),
        (TRAIN, TRAIN_CHECKPOINT, {"step": 4}, "TRAIN_CHECKPOINT step=4"),
        (
            TRAIN,
            TRAIN_BEST,
            {"step": 4, "acceptance_length": 1.875, "dir": "/runs/my run/draft/best"},
            "TRAIN_BEST step=4 acceptance_length=1.875 dir=/runs/my run/draft/best",
        ),
        (TRAIN, TRAIN_DONE, {"final": "/runs/my run/draft/final"}, "TRAIN_DONE final=/runs/my run/draft/final"),
        (
            EVAL,
            EVAL_PROGRESS,
            {"draft": "untrained", "done": 1, "total": 32},
            "EVAL_PROGRESS draft=untrained done=1 total=32",
        ),
    ],
)
def test_lines_parse_back_to_what_was_formatted(protocol, kind, values, text):
    assert kind.format(**values) == text
    for printed in (text, f"[default1]:{text}"):  # torchrun --tee puts a prefix before it
        message = protocol.parse(printed)
        assert message is not None and message.kind is kind and message.values == values and message.line == printed


def test_other_output_and_lines_cut_short_are_not_protocol_lines():
    assert CAPTURE.parse("capture: 12 records with loss tokens") is None
    assert CAPTURE.parse("CAPTURE_PROGRESS rank=1 done=3 total=7") is None  # cut by a dying process
    assert TRAIN.parse("TRAIN_PROGRESS step=2 total=six tokens=9") is None
    assert TRAIN.parse('TRAIN_ERROR {"rank": 0') is None
    assert CAPTURE.parse(TRAIN_CHECKPOINT.format(step=4)) is None  # another job's line
    with pytest.raises(TypeError, match="missing field 'tokens'"):
        CAPTURE_PROGRESS.format(rank=0, done=0, total=0)
    with pytest.raises(TypeError, match="unknown fields"):
        TRAIN_CHECKPOINT.format(step=1, tag="x")


def test_error_lines_carry_the_report():
    report = error_report(ValueError("no training samples"), 3)
    message = TRAIN.parse("[default3]:" + TRAIN.error.format(report))
    assert message.kind is TRAIN.error and message.values == report
    assert report == {"rank": 3, "type": "ValueError", "message": "no training samples", "kind": "invalid"}
    assert error_report(RuntimeError("NCCL timeout"), 0)["kind"] == "error"


def test_a_report_comes_back_as_the_ranks_own_exception(tmp_path):
    written = shard_write_failed(tmp_path)
    report = {**error_report(written, 1), "message": str(written).replace("bytes free", "bytes free (then)")}
    again = reported_error(report)
    assert isinstance(again, WriteFailed) and str(again) == report["message"]  # the rank's words
    assert (again.path, again.errno, again.kept, again.resume) == (
        written.path,
        errno.ENOSPC,
        written.kept,
        written.resume,
    )

    shard = DamagedShard(tmp_path / "s.safetensors", "7 bytes, not a complete safetensors file")
    assert type(reported_error(error_report(shard, 0))) is DamagedShard
    assert str(reported_error(error_report(shard, 0))) == str(shard)
    part = DamagedFile(tmp_path / "part-000001.parquet", "not Parquet", "Delete it")
    assert type(reported_error(error_report(part, 0))) is DamagedFile

    class Refusal(ValueError):
        pass

    assert str(reported_error(error_report(Refusal("other settings"), 0), known=(Refusal,))) == "other settings"
    assert reported_error(error_report(ValueError("bad job"), 0)) is None  # the caller decides what bad input is


def test_the_most_telling_report_wins():
    peer = error_report(RuntimeError("Connection closed by peer"), 0)
    invalid = error_report(ValueError("bad"), 1)
    damaged = error_report(DamagedFile("/x", "broken", "fix it"), 2)
    assert most_telling([peer, invalid, damaged]) is damaged
    assert most_telling([peer, invalid]) is invalid
    assert most_telling([{"rank": 0}, peer]) is peer  # a report without a kind explains least
    assert most_telling([]) is None
