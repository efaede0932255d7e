"""Turn a training run's `metrics.jsonl` into a plot, an eval table and a markdown report.

Plain functions, no Prefect: a Prefect task elsewhere calls them and publishes the markdown as an
artifact.

`metrics.jsonl` holds one JSON object per line, written by the training job:

    {"kind": "train", "step", "epoch", "time", "loss", "per_step_loss", "per_step_acc",
     "acceptance_length", "lr", "grad_norm", "tokens", "tokens_per_s"}
    {"kind": "eval", "step", "epoch", "time", "loss", "per_step_loss", "per_step_acc",
     "per_step_cond_acc", "acceptance_length", "tokens"}

Reading rules (`load_metrics`):

* A run that was killed and resumed may log the same (kind, step) more than once: the LAST line
  for a (kind, step) wins. Rows come back sorted by step.
* The last non-blank line may be a partial write from a kill: if it is not valid JSON (or not
  valid UTF-8) it is ignored, and its line number is kept in `TrainMetrics.ignored_last_line`.
* Any other line that is not a JSON object, and any train/eval line that lacks a field this
  module uses (step, epoch, loss, acceptance_length, per_step_acc, tokens) or has one of the wrong
  type, raises ValueError naming the file and the 1-based line number.
* Unknown kinds, lines without a "kind", and unknown extra keys are ignored (extra keys are kept
  in the row dicts).

The plot is drawn on a bare `matplotlib.figure.Figure` (Agg canvas): pyplot is never imported,
so there is no global figure state, no backend switch for the rest of the process, and no GUI.
"""

from __future__ import annotations

import base64
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from models.common.atomic import atomic_path
from models.eval.estimates import MEASURED_LABEL, TRAINING_LABEL, chain_acceptance_length
from models.train.best import describe

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
KINDS = ("train", "eval")


@dataclass
class TrainMetrics:
    """The train and eval rows of one metrics.jsonl, each sorted by step and deduplicated."""

    train: list[dict]
    eval: list[dict]
    # 1-based number of a partial (unparsable) last line that was skipped; None if there was none.
    ignored_last_line: int | None = None


# ---------------------------------------------------------------------------------------------
# loading


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _check_row(rec: dict, where: str) -> None:
    """Raise ValueError if `rec` lacks a field this module reads, or has one of the wrong type."""
    for key in ("step", "epoch", "tokens"):
        if not _is_int(rec.get(key)):
            raise ValueError(f"{where}: {rec['kind']} row needs an integer {key!r}, got {rec.get(key)!r}")
    for key in ("loss", "acceptance_length"):
        if not _is_number(rec.get(key)):
            raise ValueError(f"{where}: {rec['kind']} row needs a number {key!r}, got {rec.get(key)!r}")
    acc = rec.get("per_step_acc")
    if not isinstance(acc, list) or not all(_is_number(a) for a in acc):
        raise ValueError(f"{where}: {rec['kind']} row needs 'per_step_acc' as a list of numbers, got {acc!r}")


def load_metrics(path: str | os.PathLike) -> TrainMetrics:
    """Read `path` (a metrics.jsonl) into deduplicated, step-sorted train and eval rows.

    See the module docstring for the rules: last line per (kind, step) wins, a partial last line
    is ignored, any other malformed line raises ValueError("<path>:<line>: ...").
    """
    path = Path(path)
    lines = path.read_bytes().split(b"\n")
    numbered = [(i, raw) for i, raw in enumerate(lines, start=1) if raw.strip()]
    last_lineno = numbered[-1][0] if numbered else None

    rows: dict[str, dict[int, dict]] = {kind: {} for kind in KINDS}
    ignored: int | None = None
    for lineno, raw in numbered:
        where = f"{path}:{lineno}"
        try:
            rec = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            if lineno == last_lineno:
                ignored = lineno  # partial write from a killed run
                continue
            raise ValueError(f"{where}: not valid JSON ({e})") from e
        if not isinstance(rec, dict):
            raise ValueError(f"{where}: expected a JSON object, got {type(rec).__name__}")
        kind = rec.get("kind")
        if kind not in rows:
            continue
        _check_row(rec, where)
        rows[kind][rec["step"]] = rec  # later lines replace earlier ones

    return TrainMetrics(
        train=[rows["train"][s] for s in sorted(rows["train"])],
        eval=[rows["eval"][s] for s in sorted(rows["eval"])],
        ignored_last_line=ignored,
    )


# ---------------------------------------------------------------------------------------------
# plot


def plot_training(metrics: TrainMetrics, png_path: str | os.PathLike) -> Path:
    """Write a two-panel PNG (loss vs step; acceptance length vs step) to `png_path`, atomically.

    Train rows are lines (points when there is a single row), eval rows are markers. Raises
    ValueError when there are no train rows. Returns `png_path` as a Path.
    """
    if not metrics.train:
        raise ValueError("no train rows to plot")
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    png_path = Path(png_path)
    png_path.parent.mkdir(parents=True, exist_ok=True)

    t_steps = [r["step"] for r in metrics.train]
    e_steps = [r["step"] for r in metrics.eval]
    line = dict(marker="o", markersize=4) if len(metrics.train) == 1 else dict(linewidth=1.2)
    evalm = dict(linestyle="none", marker="o", markersize=5, color="tab:orange")

    fig = Figure(figsize=(9, 7), dpi=100, layout="constrained")
    FigureCanvasAgg(fig)
    ax_loss, ax_acc = fig.subplots(2, 1, sharex=True)

    ax_loss.plot(t_steps, [r["loss"] for r in metrics.train], label="train", color="tab:blue", **line)
    if metrics.eval:
        ax_loss.plot(e_steps, [r["loss"] for r in metrics.eval], label="eval", **evalm)
    ax_loss.set_ylabel("loss")
    ax_loss.set_title("loss")

    ax_acc.plot(
        t_steps,
        [r["acceptance_length"] for r in metrics.train],
        label="train (TTT estimate)",
        color="tab:blue",
        **line,
    )
    if metrics.eval:
        ax_acc.plot(e_steps, [r["acceptance_length"] for r in metrics.eval], label="eval", **evalm)
    ax_acc.set_ylabel("tokens / target forward")
    ax_acc.set_title("acceptance length")
    ax_acc.set_xlabel("step")

    for ax in (ax_loss, ax_acc):
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best")

    with atomic_path(png_path) as tmp:
        fig.savefig(tmp, format="png")
    return png_path


# ---------------------------------------------------------------------------------------------
# table and markdown


def acceptance_lines(metrics: TrainMetrics, eval_steps: int, measured: float | None) -> list[str]:
    """Markdown lines: the last held-out eval's chain formula at `eval_steps` steps and the measured value, labelled.

    The training-time number is the chain formula 1 + sum_k prod_{j<=k} p_j over the first
    eval_steps per-step conditional accept rates (models/eval/estimates.py), so it compares with a
    measurement at the same number of draft tokens per round; it still differs in kind.
    """
    training, measured_label = TRAINING_LABEL.format(steps=eval_steps), MEASURED_LABEL.format(steps=eval_steps)
    rates = metrics.eval[-1].get("per_step_cond_acc") if metrics.eval else None
    if not isinstance(rates, list):
        value = "not known (no held-out eval with per-step accept rates logged)"
    elif len(rates) < eval_steps:
        value = f"not known (training unrolled {len(rates)} TTT steps, fewer than {eval_steps})"
    else:
        value = f"**{chain_acceptance_length(rates, eval_steps):.3f}**"
    shown = (
        f"**{measured:.3f}**"
        if measured is not None
        else "not measured yet (the eval stage writes it to draft/eval.json)"
    )
    return [
        f"- {training[0].upper()}{training[1:]}: {value}",
        f"- {measured_label[0].upper()}{measured_label[1:]}: {shown}",
        "",
        "The first is a simulation: the draft is fed the true tokens of held-out training records and every "
        "position counts as a chain root. The second decodes the eval prompts: the draft runs on the target's "
        "own greedy text, and only the positions where a verify round starts count. Different text and different "
        "weighting, so they need not agree; eval.json's `estimates` holds both, and the round-weighted replay "
        "that reproduces the measured value.",
    ]


def eval_table(metrics: TrainMetrics) -> list[dict]:
    """One row per eval: step, epoch, loss (4 dp), acceptance_length (3 dp), acc_0.. (3 dp), tokens.

    acc_k is the eval's per_step_acc[k]; a row has as many acc_ columns as its per_step_acc has
    entries. `tokens` is the eval row's own field (models/train/job.py logs the number of held-out
    positions scored there, not cumulative training tokens).
    """
    out = []
    for r in metrics.eval:
        row: dict[str, Any] = {
            "step": r["step"],
            "epoch": r["epoch"],
            "loss": round(float(r["loss"]), 4),
            "acceptance_length": round(float(r["acceptance_length"]), 3),
        }
        for k, a in enumerate(r["per_step_acc"]):
            row[f"acc_{k}"] = round(float(a), 3)
        row["tokens"] = r["tokens"]
        out.append(row)
    return out


def best_line(best: dict | None) -> str:
    """The report's line on the best held-out eval (train_summary.json's "best") and where its draft is."""
    words = describe(best)
    return f"- {words[0].upper()}{words[1:]}"


def _cell(column: str, v: Any) -> str:
    """Markdown cell text: ints with thousands separators, loss to 4 decimals, other floats to 3."""
    if v is None:
        return ""
    if _is_int(v):
        return f"{v:,}"
    if isinstance(v, float):
        return f"{v:.4f}" if column == "loss" else f"{v:.3f}"
    return str(v)


def _markdown_table(rows: list[dict]) -> str:
    columns: list[str] = []
    for row in rows:  # union of columns in first-seen order (rows may differ in K)
        for key in row:
            if key not in columns:
                columns.append(key)
    # keep "tokens" last even when a later row adds acc_ columns
    if "tokens" in columns:
        columns.remove("tokens")
        columns.append("tokens")
    # eval rows' "tokens" is the number of held-out positions scored, not training tokens
    header = ["eval tokens" if c == "tokens" else c for c in columns]
    right = "|".join("---:" for _ in columns)
    lines = ["| " + " | ".join(header) + " |", "|" + right + "|"]
    for row in rows:
        lines.append("| " + " | ".join(_cell(c, row.get(c)) for c in columns) + " |")
    return "\n".join(lines)


def report_markdown(
    metrics: TrainMetrics,
    png_path: str | os.PathLike,
    *,
    draft_dir: str | os.PathLike | None = None,
    title: str = "EAGLE-3 draft training",
    embed_png: bool = True,
    eval_steps: int | None = None,
    measured: float | None = None,
    best: dict | None | Literal[False] = False,
) -> str:
    """A markdown report: headline figures, the eval table, the plot and the exported draft path.

    `best`: train_summary.json's "best" (models/train/best.py: the best held-out eval, its export in best/ or null when
    a relaunch rolled it back, and whether it is the last step's; None without held-out evals): the report then says
    which step was best and where each export is. False (the default): not known, not shown.

    With `eval_steps` (the eval stage's num_steps) it adds the training-time estimate at that many
    steps next to `measured` (the eval stage's acceptance length at those steps; None: not yet
    measured), each labelled (`acceptance_lines`).

    `png_path` is the PNG `plot_training` wrote; with `embed_png` it is read and inlined as a
    base64 data URI (Prefect markdown artifacts cannot read local files), so it must exist
    (FileNotFoundError otherwise). Its path is always given as text too.
    """
    png_path = Path(png_path)
    parts = [f"# {title}", ""]

    if metrics.train:
        last = metrics.train[-1]
        parts.append(f"- Last step: **{last['step']:,}** (epoch {last['epoch']})")
        parts.append(f"- Tokens trained: **{last['tokens']:,}**")
        parts.append(f"- Final train loss: **{float(last['loss']):.4f}**")
        parts.append(
            f"- Train acceptance length (training-time estimate, teacher-forced on training batches, "
            f"{len(last['per_step_acc'])} TTT steps): {float(last['acceptance_length']):.3f}"
        )
    else:
        parts.append("- No train rows logged yet.")
    if metrics.eval:
        ev = metrics.eval[-1]
        acc = " / ".join(f"{float(a):.3f}" for a in ev["per_step_acc"])
        parts.append(
            f"- Last eval (step {ev['step']:,}): acceptance length **{float(ev['acceptance_length']):.3f}** "
            f"(training-time estimate at {len(ev['per_step_acc'])} TTT steps, teacher-forced on held-out records), "
            f"per-step accuracy {acc}"
        )
    else:
        parts.append("- No eval rows logged yet.")
    if draft_dir is not None:
        parts.append(f"- Exported draft: `{draft_dir}`" + (" (the last step's)" if best is not False else ""))
    if best is not False:
        parts.append(best_line(best))
    if eval_steps is not None:
        parts += ["", "## Acceptance length: estimate and measurement", ""]
        parts += acceptance_lines(metrics, eval_steps, measured)

    parts += ["", "## Eval", ""]
    rows = eval_table(metrics)
    parts.append(_markdown_table(rows) if rows else "_No eval rows._")

    parts += ["", "## Training curves", ""]
    if embed_png:
        data = base64.b64encode(png_path.read_bytes()).decode("ascii")
        parts += [f"![training curves](data:image/png;base64,{data})", ""]
    parts.append(f"Plot file: `{png_path}`")
    return "\n".join(parts) + "\n"
