"""`eagle3 validate`: check a run config's datasets before any GPU hour is spent."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from settings.hub_paths import is_hub_path
from settings.run import RunConfig
from tasks.datasets import DatasetError, EmptyDatasetError, LoadedDataset, PromptRow, load_dataset
from tasks.datasets.hub import dataset_source
from tasks.generate.conversations import conversation


def validate_datasets(config: RunConfig, *, config_path: Path, console: Console) -> bool:
    """Parse every dataset of `config` and print one table row each; True if all are usable."""
    table = Table(title=f"{config_path}: datasets", title_justify="left")
    for column in ("#", "dataset", "kind", "rows", "bad rows", "duplicates", "token budget", "max prompts", "status"):
        table.add_column(
            column,
            justify="right"
            if column in {"#", "rows", "bad rows", "duplicates", "token budget", "max prompts"}
            else "left",
        )
    problems: list[str] = []
    missing: list[str] = []
    formats: list[str] = []  # one line per dataset read: its row format, configured or detected
    for i, dataset in enumerate(config.datasets):
        budget = f"{dataset.token_budget:,}" if dataset.token_budget else "-"
        cap = f"{dataset.max_prompts:,}" if dataset.max_prompts else "-"
        if not is_hub_path(dataset.path) and not dataset.path.exists():
            missing.append(f"datasets[{i}] {dataset.name}: {dataset.path}")
            table.add_row(
                str(i), escape(dataset.name), dataset.kind, "-", "-", "-", budget, cap, "[red]missing file[/red]"
            )
            continue
        empty: EmptyDatasetError | None = None
        try:
            loaded = load_dataset(
                dataset_source(dataset, config.layout), dataset.kind, row_format=dataset.row_format, on_bad_row="skip"
            )
        except EmptyDatasetError as exc:  # no rows, or none left after the bad ones: still list those
            empty = exc
            loaded = LoadedDataset(rows=[], rejects=list(exc.rejects), duplicates=0, path=dataset.path, shape=exc.shape)
        except DatasetError as exc:  # unreadable as a whole (unknown format, corrupt Parquet, ...)
            problems.append(f"datasets[{i}] {dataset.name}: {exc}")
            table.add_row(
                str(i), escape(dataset.name), dataset.kind, "-", "-", "-", budget, cap, "[red]unreadable[/red]"
            )
            continue
        shape = loaded.shape.describe() if loaded.shape else "auto, not detected from any row"
        turns = ""
        if dataset.kind == "generate" and dataset.turns == "all":  # what turn-by-turn regeneration will send
            prompts = [row for row in loaded.rows[: dataset.max_prompts] if isinstance(row, PromptRow)]
            users = sum(len(conversation(row).users) for row in prompts)
            turns = f"; turns: all, {users:,} user turns to answer (up to each conversation's first tool call)"
        formats.append(f"{dataset.name}: format {shape}{turns}")
        bad = len(loaded.rejects)
        status = "[green]ok[/green]"
        shown = "\n    ".join(f"{r.location}: {r.reason}" for r in loaded.rejects[:5])
        more = f"\n    ... and {bad - 5} more" if bad > 5 else ""
        if bad and dataset.on_bad_row == "fail":
            status = "[red]bad rows[/red]"
            problems.append(
                f"datasets[{i}] {dataset.name}: {bad} bad row(s) (on_bad_row: fail):\n    {shown}{more}\n"
                f"  Fix the rows, or set datasets[{i}].on_bad_row: skip to send them to the run's rejects."
            )
        elif bad:
            status = f"[yellow]ok, {bad} to rejects[/yellow]"
        if empty is not None:
            status = "[red]no usable rows[/red]" if bad else "[red]empty[/red]"
            if not (bad and dataset.on_bad_row == "fail"):  # else the bad rows above are the problem
                listed = f":\n    {shown}{more}" if bad else ""
                problems.append(f"datasets[{i}] {dataset.name}: {empty}{listed}")
        table.add_row(
            str(i),
            escape(dataset.name),
            dataset.kind,
            f"{len(loaded.rows):,}",
            str(bad),
            str(loaded.duplicates),
            budget,
            cap,
            status,
        )
    console.print(table)
    for line in formats:
        console.print(escape(line), highlight=False)
    console.print(
        escape(f"target: {config.target.path}    server: {config.server.url}    run_dir: {config.run_dir}"),
        highlight=False,
    )
    if missing:
        console.print(
            f"[red]{len(missing)} data file(s) missing[/red] (the data is yours to provide: put each file "
            + escape(f"there, or edit its datasets[i].path in {config_path}):"),
            highlight=False,
        )
        for line in missing:
            console.print(f"  - {escape(line)}", highlight=False)
    for line in problems:
        console.print(f"[red]problem:[/red] {escape(line)}", highlight=False)
    ok = not missing and not problems
    if ok:
        console.print(
            f"[green]{config_path} is valid:[/green] {len(config.datasets)} dataset(s) ready.", highlight=False
        )
    return ok
