import base64
import json
import re

import pytest

from tasks.train.report import (
    PNG_SIGNATURE,
    TrainMetrics,
    eval_table,
    load_metrics,
    plot_training,
    report_markdown,
)

K = 3


def train_row(step, *, loss=None, acc_len=None, tokens=None, epoch=0, **extra):
    row = {
        "kind": "train",
        "step": step,
        "epoch": epoch,
        "time": 1000.0 + step,
        "loss": 2.0 / (1 + step) if loss is None else loss,
        "per_step_loss": [0.5] * K,
        "per_step_acc": [0.6, 0.5, 0.4],
        "acceptance_length": 1.5 + step / 100 if acc_len is None else acc_len,
        "lr": 1e-4,
        "grad_norm": None if step % 2 else 1.25,
        "tokens": 1000 * step if tokens is None else tokens,
        "tokens_per_s": 5000.0,
    }
    row.update(extra)
    return row


def eval_row(step, *, loss=1.0, acc_len=2.0, acc=(0.7, 0.55, 0.4), tokens=4096, epoch=0):
    return {
        "kind": "eval",
        "step": step,
        "epoch": epoch,
        "time": 2000.0 + step,
        "loss": loss,
        "per_step_loss": [0.4] * len(acc),
        "per_step_acc": list(acc),
        "per_step_cond_acc": list(acc),
        "acceptance_length": acc_len,
        "tokens": tokens,
    }


def write_lines(path, lines, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in lines) + tail)
    return path


# ---------------------------------------------------------------------------------------------
# load_metrics


def test_load_dedups_last_line_wins_and_sorts(tmp_path):
    # A run killed after step 30 and resumed from step 10: steps 20 and 30 are logged twice.
    lines = [
        train_row(10, loss=3.0),
        train_row(20, loss=2.5),
        eval_row(20, loss=9.0),
        train_row(30, loss=2.4),
        # resumed
        train_row(20, loss=2.2),
        eval_row(20, loss=1.5),
        train_row(30, loss=2.1),
        train_row(40, loss=2.0),
        eval_row(5, loss=4.0),  # out of order on purpose
        {"kind": "heartbeat", "step": 1},  # unknown kind
        {"kind": "config", "lr": 1e-4},  # unknown kind, no step
    ]
    m = load_metrics(write_lines(tmp_path / "metrics.jsonl", lines))
    assert [r["step"] for r in m.train] == [10, 20, 30, 40]
    assert [r["loss"] for r in m.train] == [3.0, 2.2, 2.1, 2.0]
    assert [r["step"] for r in m.eval] == [5, 20]
    assert [r["loss"] for r in m.eval] == [4.0, 1.5]
    assert m.ignored_last_line is None
    # extra keys are kept, unknown ones are harmless
    assert m.train[1]["lr"] == 1e-4


def test_load_ignores_unknown_extra_keys(tmp_path):
    m = load_metrics(write_lines(tmp_path / "m.jsonl", [train_row(1, mystery={"a": 1})]))
    assert len(m.train) == 1 and m.train[0]["mystery"] == {"a": 1}


def test_load_ignores_truncated_last_line(tmp_path):
    full = json.dumps(train_row(30))
    path = write_lines(tmp_path / "m.jsonl", [train_row(10), train_row(20)], tail=full[: len(full) // 2])
    m = load_metrics(path)
    assert [r["step"] for r in m.train] == [10, 20]
    assert m.ignored_last_line == 3


def test_load_ignores_truncated_last_line_cut_mid_utf8(tmp_path):
    path = tmp_path / "m.jsonl"
    full = (json.dumps(train_row(30, note="é"), ensure_ascii=False)).encode()
    cut = full[: full.index("é".encode()) + 1]  # half of a two-byte character
    path.write_bytes(json.dumps(train_row(10)).encode() + b"\n" + cut)
    m = load_metrics(path)
    assert [r["step"] for r in m.train] == [10]


def test_load_truncated_line_followed_by_blank_lines_is_still_last(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [train_row(10)], tail='{"kind": "tra\n\n  \n')
    assert [r["step"] for r in load_metrics(path).train] == [10]


def test_load_malformed_middle_line_raises_with_line_number(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text(
        json.dumps(train_row(10)) + "\n" + '{"kind": "train", "step": 2\n' + json.dumps(train_row(20)) + "\n"
    )
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not valid JSON"):
        load_metrics(path)


def test_load_non_object_line_raises(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text(json.dumps(train_row(10)) + "\n[1, 2]\n" + json.dumps(train_row(20)) + "\n")
    with pytest.raises(ValueError, match=r"m\.jsonl:2: expected a JSON object"):
        load_metrics(path)


@pytest.mark.parametrize(
    "bad",
    [
        {"step": "7"},
        {"step": True},
        {"loss": None},
        {"tokens": 1.5},
        {"per_step_acc": "0.5"},
    ],
)
def test_load_bad_field_raises_with_line_number(tmp_path, bad):
    rows = [train_row(1), eval_row(1), train_row(2), {**train_row(3), **bad}, train_row(4)]
    with pytest.raises(ValueError, match=r"m\.jsonl:4: train row needs"):
        load_metrics(write_lines(tmp_path / "m.jsonl", rows))


def test_load_empty_file(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_text("")
    m = load_metrics(path)
    assert m.train == [] and m.eval == [] and m.ignored_last_line is None


# ---------------------------------------------------------------------------------------------
# eval_table


def test_eval_table_rounds_values(tmp_path):
    lines = [
        train_row(10),
        eval_row(20, loss=1.234567, acc_len=2.71828, acc=(0.81234, 0.66666, 0.5), tokens=12345, epoch=1),
        eval_row(10, loss=2.0, acc_len=1.5, acc=(0.5, 0.25, 0.125), tokens=100),
    ]
    m = load_metrics(write_lines(tmp_path / "m.jsonl", lines))
    assert eval_table(m) == [
        {
            "step": 10,
            "epoch": 0,
            "loss": 2.0,
            "acceptance_length": 1.5,
            "acc_0": 0.5,
            "acc_1": 0.25,
            "acc_2": 0.125,
            "tokens": 100,
        },
        {
            "step": 20,
            "epoch": 1,
            "loss": 1.2346,
            "acceptance_length": 2.718,
            "acc_0": 0.812,
            "acc_1": 0.667,
            "acc_2": 0.5,
            "tokens": 12345,
        },
    ]
    assert list(eval_table(m)[0]) == ["step", "epoch", "loss", "acceptance_length", "acc_0", "acc_1", "acc_2", "tokens"]


def test_eval_table_empty():
    assert eval_table(TrainMetrics(train=[train_row(1)], eval=[])) == []


# ---------------------------------------------------------------------------------------------
# plot_training


def assert_png(path):
    data = path.read_bytes()
    assert len(data) > 0
    assert data.startswith(PNG_SIGNATURE) and PNG_SIGNATURE == b"\x89PNG\r\n\x1a\n"
    return data


def test_plot_writes_png_atomically(tmp_path):
    m = TrainMetrics(
        train=[train_row(s) for s in range(0, 200, 10)],
        eval=[eval_row(s, loss=1.0 - s / 1000, acc_len=2 + s / 100) for s in (50, 100, 150)],
    )
    out = plot_training(m, tmp_path / "sub" / "curves.png")
    assert out == tmp_path / "sub" / "curves.png"
    assert_png(out)
    # no temp file left behind
    assert sorted(p.name for p in out.parent.iterdir()) == ["curves.png"]
    # overwriting an existing plot works
    plot_training(m, out)
    assert_png(out)
    assert sorted(p.name for p in out.parent.iterdir()) == ["curves.png"]


def test_plot_one_train_row_no_eval(tmp_path):
    out = plot_training(TrainMetrics(train=[train_row(1)], eval=[]), str(tmp_path / "one.png"))
    assert_png(out)


def test_plot_no_train_rows_raises(tmp_path):
    with pytest.raises(ValueError, match="no train rows"):
        plot_training(TrainMetrics(train=[], eval=[eval_row(1)]), tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()


# ---------------------------------------------------------------------------------------------
# report_markdown


def test_report_markdown_numbers_and_embedded_png(tmp_path):
    lines = [
        train_row(100, loss=1.5, tokens=1_000_000),
        eval_row(100, loss=1.4, acc_len=2.5, acc=(0.7, 0.5, 0.3)),
        train_row(200, loss=1.23456, tokens=2_345_678, acc_len=2.9, epoch=1),
        eval_row(200, loss=1.111111, acc_len=3.14159, acc=(0.8123, 0.6, 0.45), tokens=8192, epoch=1),
    ]
    m = load_metrics(write_lines(tmp_path / "metrics.jsonl", lines))
    png = plot_training(m, tmp_path / "curves.png")
    png_bytes = assert_png(png)
    md = report_markdown(m, png, draft_dir=tmp_path / "draft", title="My run")

    assert md.startswith("# My run\n")
    assert "Last step: **200** (epoch 1)" in md
    assert "Tokens trained: **2,345,678**" in md
    assert "Final train loss: **1.2346**" in md
    assert "acceptance length **3.142**" in md
    assert "per-step accuracy 0.812 / 0.600 / 0.450" in md
    assert f"Exported draft: `{tmp_path / 'draft'}`" in md
    assert f"`{png}`" in md

    # eval table: header, separator, one line per eval in step order
    assert "| step | epoch | loss | acceptance_length | acc_0 | acc_1 | acc_2 | eval tokens |" in md
    assert "| 100 | 0 | 1.4000 | 2.500 | 0.700 | 0.500 | 0.300 | 4,096 |" in md
    assert "| 200 | 1 | 1.1111 | 3.142 | 0.812 | 0.600 | 0.450 | 8,192 |" in md
    assert md.index("| 100 |") < md.index("| 200 |")

    found = re.findall(r"!\[training curves\]\(data:image/png;base64,([A-Za-z0-9+/=]+)\)", md)
    assert len(found) == 1
    assert base64.b64decode(found[0], validate=True) == png_bytes


def test_report_markdown_without_embed_or_evals(tmp_path):
    m = TrainMetrics(train=[train_row(5, loss=0.5, tokens=42)], eval=[])
    png = tmp_path / "never_written.png"
    md = report_markdown(m, png, embed_png=False)
    assert md.startswith("# EAGLE-3 draft training\n")
    assert "data:image/png" not in md
    assert f"`{png}`" in md
    assert "Tokens trained: **42**" in md and "Final train loss: **0.5000**" in md
    assert "No eval rows" in md
    assert "Exported draft" not in md
    # embedding needs the PNG on disk
    with pytest.raises(FileNotFoundError):
        report_markdown(m, png)


def test_report_markdown_no_train_rows(tmp_path):
    m = TrainMetrics(train=[], eval=[eval_row(3, acc_len=1.75)])
    md = report_markdown(m, tmp_path / "p.png", embed_png=False)
    assert "No train rows" in md and "acceptance length **1.750**" in md


def test_report_table_rows_with_different_k_and_nan_loss(tmp_path):
    # K changed between evals (e.g. a config change on resume); a diverged eval logs NaN.
    path = tmp_path / "m.jsonl"
    write_lines(path, [train_row(1), eval_row(1, acc=(0.5, 0.25)), eval_row(2, loss=float("nan"))])
    m = load_metrics(path)
    assert list(eval_table(m)[0]) == ["step", "epoch", "loss", "acceptance_length", "acc_0", "acc_1", "tokens"]
    md = report_markdown(m, tmp_path / "p.png", embed_png=False)
    assert "| step | epoch | loss | acceptance_length | acc_0 | acc_1 | acc_2 | eval tokens |" in md
    assert "| 1 | 0 | 1.0000 | 2.000 | 0.500 | 0.250 |  | 4,096 |" in md
    assert "| 2 | 0 | nan | 2.000 | 0.700 | 0.550 | 0.400 | 4,096 |" in md


def test_report_shows_the_estimate_at_the_evals_steps_beside_the_measurement(tmp_path):
    """7 TTT steps trained, the eval drafts 3 per round: the report's figure at 3 steps is the chain formula
    over the first 3 held-out rates (not the 7-step one), next to the measured value, each labelled."""
    rates = (0.8, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9)
    m = TrainMetrics(train=[train_row(5)], eval=[eval_row(5, acc_len=3.019, acc=rates)])
    md = report_markdown(m, tmp_path / "p.png", embed_png=False, eval_steps=3, measured=1.8)
    assert "training-time estimate at 7 TTT steps, teacher-forced on held-out records" in md
    assert (
        "- Training-time estimate at 3 steps (teacher-forced on held-out training records, chain formula): **2.400**"
        in md
    )
    assert "- Measured (speculative decoding, 3 steps, on the eval prompts): **1.800**" in md
    pending = report_markdown(m, tmp_path / "p.png", embed_png=False, eval_steps=3)
    assert "on the eval prompts): not measured yet" in pending
    too_many = report_markdown(m, tmp_path / "p.png", embed_png=False, eval_steps=8)
    assert "not known (training unrolled 7 TTT steps, fewer than 8)" in too_many
    assert "Acceptance length: estimate and measurement" not in report_markdown(m, tmp_path / "p.png", embed_png=False)


def test_report_says_which_eval_was_best_and_where_each_export_is(tmp_path):
    m = TrainMetrics(train=[train_row(6)], eval=[eval_row(3, acc_len=2.5), eval_row(6, acc_len=2.25)])
    best = {"step": 3, "epoch": 0, "acceptance_length": 2.5, "loss": 1.0, "dir": "/r/draft/best", "last": False}
    md = report_markdown(m, tmp_path / "p.png", embed_png=False, draft_dir="/r/draft/final", best=best)
    assert "- Exported draft: `/r/draft/final` (the last step's)" in md
    assert "- The best held-out eval is at step 3, acceptance length 2.500: its draft is in /r/draft/best" in md
    last = report_markdown(
        m, tmp_path / "p.png", embed_png=False, best={**best, "step": 6, "acceptance_length": 2.25, "last": True}
    )
    assert (
        "- The best held-out eval is the last step's (step 6, acceptance length 2.250): "
        "/r/draft/best holds the same draft as final/" in last
    )
    lost = report_markdown(m, tmp_path / "p.png", embed_png=False, best={**best, "dir": None})
    assert "has no export: a relaunch rolled it back, no later eval beat it" in lost
    none = report_markdown(m, tmp_path / "p.png", embed_png=False, draft_dir="/r/draft/final", best=None)
    assert "- No held-out eval (train.eval_fraction 0): no best/, the draft is final/" in none
    # A summary from before best/ existed says nothing about it: neither does the report.
    unknown = report_markdown(m, tmp_path / "p.png", embed_png=False, draft_dir="/r/draft/final")
    assert "best held-out eval" not in unknown.lower() and "(the last step's)" not in unknown
