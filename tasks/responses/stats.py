"""Per-dataset statistics of a run directory, from Parquet footers only.

`collect_stats` never reads a response row: every figure comes from the summary that
`tasks.responses.checkpoints.write_part` puts in each part's footer (rows, token sums, finish reasons, the
completion length of every response, first and last `finished_at`), and the rejects, by cause, from
the counts in each rejects part's footer (tasks.responses.rejects).

A dataset with a damaged part (one that is not a readable Parquet file) is reported as damaged,
with the file and what is wrong, and the other datasets are reported as usual: `eagle3 stats` is
safe to run on any run directory, also while a run writes it. That is what keeps `eagle3 stats` well under
a second on a run with hundreds of thousands of responses, where parsing the same responses as JSONL takes
many seconds.

Percentiles use the nearest-rank method (see `nearest_rank`): the reported p50/p95 is always a
length some response actually had.

`tokens_per_s` is completion tokens over the span between the first and the last `finished_at` of
the dataset's responses: the rate at which finished tokens arrived. It is None when that span is
unknown or zero (one response, or responses without timestamps).
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
from rich.console import JustifyMethod
from rich.table import Table
from rich.text import Text

from settings.layout import RunLayout
from tasks.responses.checkpoints import META, PartSummary
from tasks.responses.parquet_io import DamagedPart, list_parts, reading
from tasks.responses.rejects import reject_counts


@dataclass
class DatasetStats:
    """What the footers of one dataset's responses and rejects say."""

    dataset: str
    responses: int
    rejects: int
    completion_tokens: int
    prompt_tokens: int
    mean_length: float | None  # completion tokens per response; None without responses
    p50_length: int | None  # nearest-rank percentiles of completion tokens per response
    p95_length: int | None
    finish_reasons: dict[str, int]
    tokens_per_s: float | None  # completion_tokens / wall_s; None when wall_s is unknown or 0
    wall_s: float | None  # last_finished_at - first_finished_at
    parts: int  # live response parts (replaced parts of a compaction not counted)
    first_finished_at: float | None = None
    last_finished_at: float | None = None
    # Every response's completion length, ascending (an int64 array from collect_stats), kept so
    # that totals over datasets can take percentiles; not part of stats_rows.
    lengths: Sequence[int] | np.ndarray = field(default_factory=list, repr=False, compare=False)
    reject_causes: dict[str, int] = field(default_factory=dict)  # rejects by cause (tasks.responses.rejects.CAUSES)
    damaged: str | None = None  # "<file> is damaged (...)": the figures above then count nothing
    conversations: int = (
        0  # responses less those of a conversation's later turns (turns: all; tasks.responses.turn_ids)
    )

    @property
    def truncated(self) -> int:
        """Responses cut by the length limit (finish_reason `length`: sampling.max_new_tokens or the context)."""
        return self.finish_reasons.get("length", 0)

    @property
    def truncated_share(self) -> float | None:
        """`truncated` as a share of the responses; None without responses."""
        return self.truncated / self.responses if self.responses else None


# A share of cut answers at or above this is flagged by `eagle3 stats`: the records stage leaves them out
# (records.keep_truncated), so their tokens are spent for nothing, and a reasoning set cut this often has
# a max_new_tokens too small for it.
TRUNCATED_WARN_SHARE = 0.05


def nearest_rank(sorted_values: Sequence[Any] | np.ndarray, p: float) -> Any:
    """The p-th percentile (0 < p <= 100) of ascending `sorted_values` by the nearest-rank method.

    The value at 1-based rank ceil(p/100 * n): the smallest value with at least p% of the values
    at or below it. Equals numpy.percentile(..., method="inverted_cdf"); p=50 is
    statistics.median_low. None for no values.
    """
    if not 0 < p <= 100:
        raise ValueError(f"percentile must be in (0, 100], got {p}")
    n = len(sorted_values)
    if n == 0:
        return None
    # Integer arithmetic for integer p: float rounding must not push an exact rank up by one.
    rank = -(-p * n // 100) if isinstance(p, int) else math.ceil(p * n / 100)
    return sorted_values[max(rank, 1) - 1]


def collect_stats(run_dir: Path) -> list[DatasetStats]:
    """Stats of every dataset under RUN_DIR/responses and RUN_DIR/rejects, sorted by name."""
    layout = RunLayout(run_dir)
    names = _dataset_names(layout.responses_root) | _dataset_names(layout.rejects_root)
    return [_dataset_stats(layout, name) for name in sorted(names)]


def total_stats(stats: Sequence[DatasetStats]) -> DatasetStats:
    """All datasets together, as one DatasetStats named "TOTAL"."""
    summary = PartSummary()
    for s in stats:
        summary.add(
            PartSummary(
                rows=s.responses,
                completion_tokens=s.completion_tokens,
                prompt_tokens=s.prompt_tokens,
                finish_reasons=dict(s.finish_reasons),
                first_finished_at=s.first_finished_at,
                last_finished_at=s.last_finished_at,
                later_turns=s.responses - s.conversations,
            )
        )
    lengths = _sorted([np.asarray(s.lengths, dtype=np.int64) for s in stats])
    causes: dict[str, int] = {}
    for s in stats:
        for cause, n in s.reject_causes.items():
            causes[cause] = causes.get(cause, 0) + n
    damaged = [s.dataset for s in stats if s.damaged]
    return _from_summary(
        "TOTAL",
        summary,
        lengths,
        rejects=causes,
        parts=sum(s.parts for s in stats),
        damaged=f"damaged: {', '.join(damaged)}" if damaged else None,
    )


STATS_COLUMNS = (
    "dataset",
    "responses",
    "conversations",
    "rejects",
    "reject_causes",
    "completion_tokens",
    "prompt_tokens",
    "mean_length",
    "p50_length",
    "p95_length",
    "finish_reasons",
    "truncated",
    "truncated_share",
    "tokens_per_s",
    "wall_s",
    "parts",
    "damaged",
)


def stats_rows(stats: Sequence[DatasetStats], *, total: bool = False) -> list[dict[str, Any]]:
    """JSON-ready rows (STATS_COLUMNS), one per dataset, plus a "TOTAL" row when `total`."""
    items = list(stats) + ([total_stats(stats)] if total else [])
    return [{c: _plain(getattr(s, c)) for c in STATS_COLUMNS} for s in items]


def render_stats_table(stats: Sequence[DatasetStats]) -> Table:
    """A rich table of `stats` with a TOTAL row."""
    table = Table(title="responses per dataset", show_footer=False)
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("dataset", "left"),
        ("responses", "right"),
        ("conversations", "right"),
        ("rejects", "right"),
        ("completion tok", "right"),
        ("prompt tok", "right"),
        ("mean len", "right"),
        ("p50", "right"),
        ("p95", "right"),
        ("finish reasons", "left"),
        ("cut by length", "right"),
        ("tok/s", "right"),
        ("wall", "right"),
        ("parts", "right"),
        ("reject causes", "left"),
    )
    for header, justify in columns:
        table.add_column(header, justify=justify, no_wrap=True)
    rows = list(stats)
    for i, s in enumerate(rows + [total_stats(rows)]):
        is_total = i == len(rows)
        table.add_row(
            s.dataset,
            f"{s.responses:,}",
            f"{s.conversations:,}",
            f"{s.rejects:,}",
            f"{s.completion_tokens:,}",
            f"{s.prompt_tokens:,}",
            "-" if s.mean_length is None else f"{s.mean_length:,.0f}",
            "-" if s.p50_length is None else f"{s.p50_length:,}",
            "-" if s.p95_length is None else f"{s.p95_length:,}",
            " ".join(f"{k}={v:,}" for k, v in sorted(s.finish_reasons.items())) or "-",
            _cut(s),
            "-" if s.tokens_per_s is None else f"{s.tokens_per_s:,.0f}",
            "-" if s.wall_s is None else _duration(s.wall_s),
            f"{s.parts:,}",
            " ".join(f"{k}={v:,}" for k, v in s.reject_causes.items()) or "-",
            style="bold red" if s.damaged else "bold" if is_total else None,
            end_section=i == len(rows) - 1,
        )
    cut = [s for s in rows if (s.truncated_share or 0) >= TRUNCATED_WARN_SHARE]
    damaged = [s.damaged for s in rows if s.damaged]
    if damaged:
        table.caption = "DAMAGED (figures of these datasets are not shown):\n" + "\n".join(damaged)
        table.caption_style = "red"
    elif cut:
        table.caption = (
            f"CUT: {', '.join(f'{s.dataset} {s.truncated_share:.0%}' for s in cut)} of the answers ended at the "
            "length limit; the records stage leaves them out (records.keep_truncated): raise sampling.max_new_tokens"
        )
        table.caption_style = "yellow"
    return table


def _cut(s: DatasetStats) -> Text | str:
    """`12 (3.4%)`, in yellow at TRUNCATED_WARN_SHARE or more; "-" without responses."""
    if s.truncated_share is None:
        return "-"
    text = f"{s.truncated:,} ({s.truncated_share:.1%})"
    return Text(text, style="yellow") if s.truncated_share >= TRUNCATED_WARN_SHARE else text


# ---------------------------------------------------------------------------------------------


def _dataset_names(directory: Path) -> set[str]:
    if not directory.is_dir():
        return set()
    return {p.name for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")}


def _dataset_stats(layout: RunLayout, name: str) -> DatasetStats:
    try:
        return _read_dataset_stats(layout, name)
    except DamagedPart as exc:
        empty = _from_summary(name, PartSummary(), _sorted([]), rejects={}, parts=0)
        empty.damaged = str(exc)
        return empty


# How often a dataset's parts are listed again when one of them vanished between the listing and its read.
RELIST_TRIES = 5


def _footers(directory: Path) -> dict[Path, dict[str, str]]:
    """Every part's footer. A running generate's compaction deletes the parts it merged once the merged part is
    durable (tasks/responses/checkpoints.py `compact`), so a part listed a moment ago may be gone: that listing is
    stale, and the parts are listed again (the merged part then holds those rows)."""
    for _ in range(RELIST_TRIES - 1):
        try:
            return {part: _footer(part) for part in list_parts(directory)}
        except FileNotFoundError:
            continue
    return {part: _footer(part) for part in list_parts(directory)}


def _read_dataset_stats(layout: RunLayout, name: str) -> DatasetStats:
    # One footer read per part: the `replaces` lists and the summaries come from the same read
    # (checkpoints.summarize would read every footer twice).
    footers = _footers(layout.responses(name))
    replaced: set[str] = set()
    for meta in footers.values():
        listed = meta.get(f"{META}replaces")
        if listed:
            replaced.update(json.loads(listed))
    summary = PartSummary()
    lengths: list[np.ndarray] = []
    live = 0
    for part, meta in footers.items():
        if part.name in replaced:
            continue
        try:
            part_summary, part_lengths = _part_summary(meta)
        except (KeyError, ValueError, TypeError) as e:
            raise DamagedPart(
                part, f"its footer has no valid eagle3 summary ({e!r}); response parts are written by eagle3 only"
            ) from None
        summary.add(part_summary)
        lengths.append(part_lengths)
        live += 1
    rejects = reject_counts(layout.rejects(name))
    return _from_summary(name, summary, _sorted(lengths), rejects=rejects, parts=live)


def _footer(part: Path) -> dict[str, str]:
    # The Parquet key-value metadata as stored: unlike pq.read_schema this does not decode the
    # embedded Arrow schema, which repeats all of it.
    with reading(part):
        raw = pq.read_metadata(part).metadata or {}
    return {k.decode(): v.decode() for k, v in raw.items() if k.startswith(META.encode())}


def _part_summary(meta: dict[str, str]) -> tuple[PartSummary, np.ndarray]:
    """A part's summary without its lengths, and the lengths as an array."""
    text = meta[f"{META}lengths"]
    summary = PartSummary.from_metadata({**meta, f"{META}lengths": "[]"})
    # The lengths are a compact JSON list of ints (10k+ per part); numpy parses that list ~5x
    # faster than json.loads. Anything it does not read to the end goes the json way.
    body = text.strip()[1:-1]
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            lengths = np.fromstring(body, dtype=np.int64, sep=",") if body.strip() else np.empty(0, np.int64)
    except ValueError:
        lengths = None
    if lengths is None or len(lengths) != body.count(",") + bool(body.strip()):
        lengths = np.asarray(json.loads(text), dtype=np.int64)
    if len(lengths) != summary.rows:
        raise ValueError(f"{len(lengths)} lengths for {summary.rows} rows")
    return summary, lengths


def _sorted(arrays: list[np.ndarray]) -> np.ndarray:
    return np.sort(np.concatenate(arrays)) if arrays else np.empty(0, np.int64)


def _from_summary(
    name: str,
    summary: PartSummary,
    lengths: np.ndarray,
    *,
    rejects: dict[str, int],
    parts: int,
    damaged: str | None = None,
) -> DatasetStats:
    first, last = summary.first_finished_at, summary.last_finished_at
    wall = last - first if first is not None and last is not None else None
    p50, p95 = nearest_rank(lengths, 50), nearest_rank(lengths, 95)
    return DatasetStats(
        dataset=name,
        responses=summary.rows,
        rejects=sum(rejects.values()),
        completion_tokens=summary.completion_tokens,
        prompt_tokens=summary.prompt_tokens,
        mean_length=summary.completion_tokens / summary.rows if summary.rows else None,
        p50_length=None if p50 is None else int(p50),
        p95_length=None if p95 is None else int(p95),
        finish_reasons=dict(sorted(summary.finish_reasons.items())),
        tokens_per_s=summary.completion_tokens / wall if wall else None,
        wall_s=wall,
        parts=parts,
        first_finished_at=first,
        last_finished_at=last,
        lengths=lengths,
        reject_causes=dict(sorted(rejects.items())),
        damaged=damaged,
        conversations=summary.conversations,
    )


def _plain(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def render_rows_table(title: str, rows: list[dict[str, Any]]) -> Table:
    """A rich table of uniform dict rows (integers right-aligned with thousands separators)."""
    from rich.markup import escape

    table = Table(title=title)
    if not rows:
        return table
    for key, value in rows[0].items():
        table.add_column(
            key.replace("_", " "), justify="right" if isinstance(value, (int, float)) else "left", no_wrap=True
        )
    for row in rows:
        table.add_row(
            *(f"{v:,}" if isinstance(v, int) and not isinstance(v, bool) else escape(str(v)) for v in row.values())
        )
    return table
