"""`eagle3 plan`: what every stage of a config still has to do, in tokens, bytes and time, and the capture's memory."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.plan import capture_plan, memory_plans
from settings.run import RunConfig
from tasks.capture.memory import MemoryTooSmall, check_memory, gib
from tasks.capture.plan import DiskTooSmall, TargetConfigMissing, check_fits, human_bytes, read_target_config
from tasks.records.build import summarize_records
from tasks.responses.checkpoints import summarize


def print_plan(config: RunConfig, console: Console) -> bool:
    """Print the plan; False when a stage cannot run as configured (e.g. the disk is too small)."""
    table = Table(title="generate", title_justify="left")
    for column in ("dataset", "kind", "budget", "spent", "left", "responses"):
        table.add_column(column, justify="left" if column in ("dataset", "kind") else "right")
    layout = config.layout
    for d in config.datasets:
        done = summarize(layout.responses(d.name))
        left = f"{max(0, d.token_budget - done.completion_tokens):,}" if d.token_budget else "all prompts"
        table.add_row(
            escape(d.name),
            d.kind,
            f"{d.token_budget:,}" if d.token_budget else "-",
            f"{done.completion_tokens:,}",
            left,
            f"{done.rows:,}",
        )
    console.print(table)

    records = {d.name: summarize_records(layout.records(d.name)) for d in config.datasets}
    console.print(
        f"records: {sum(r.records for r in records.values()):,} records, "
        f"{sum(r.tokens for r in records.values()):,} tokens, "
        f"{sum(r.loss_tokens for r in records.values()):,} loss tokens so far"
    )
    try:
        data = read_target_config(config.target.path, download=False)
    except TargetConfigMissing as exc:  # e.g. a Hub id on an offline machine: said at once, no network retries
        console.print(f"[yellow]capture: no disk or memory plan: {escape(str(exc))}[/yellow]", highlight=False)
        return True
    plan = capture_plan(config, data)
    eta = (
        f"about {plan.est_seconds / 3600:.2f} h at the last measured speed"
        if plan.est_seconds
        else "time unknown until a capture has run"
    )
    console.print(
        f"capture: {plan.tokens_todo:,} tokens to go ({plan.tokens_done:,} done) x {plan.bytes_per_token:,} B "
        f"(hidden {plan.hidden_size}, {'fp8 e4m3 with scales' if plan.storage == 'fp8' else plan.dtype}) = "
        f"{human_bytes(plan.bytes_needed)}; "
        f"{human_bytes(plan.free_bytes)} free in {escape(plan.out_dir)}; {eta}",
        highlight=False,
    )
    if plan.temp_dir is not None:
        where = (
            "counted above: the shards' filesystem"
            if plan.temp_usable_bytes is None
            else f"{human_bytes(plan.temp_usable_bytes)} usable there"
        )
        console.print(
            f"capture (vllm): the connector's files take up to {human_bytes(plan.temp_bytes)} at once in "
            f"{escape(plan.temp_dir)} ({where})",
            highlight=False,
        )
    ok = True
    try:
        check_fits(plan)
    except DiskTooSmall as exc:
        console.print(f"[red]capture would not fit:[/red] {escape(str(exc))}", highlight=False)
        ok = False
    return print_memory(config, data, console) and ok


def print_memory(config: RunConfig, data: dict, console: Console) -> bool:
    """The capture's memory per GPU and per node for each backend (the configured one checked); False when the
    configured one does not fit."""
    try:
        setups = memory_plans(config, data)
    except ValueError as exc:  # a config.json whose parameters are not counted here
        console.print(f"[yellow]capture: no memory plan: {escape(str(exc))}[/yellow]", highlight=False)
        return True
    table = Table(title="capture memory (arithmetic from config.json, not measured)", title_justify="left")
    for column in ("setup", "per GPU", "GPU has", "per node (host)", "node has", "fits"):
        table.add_column(column, justify="left" if column == "setup" else "right")
    for s in setups:
        p = s.plan
        table.add_row(
            escape(p.setup) + (" (configured)" if s.configured else ""),
            gib(p.gpu_bytes),
            gib(p.gpu_limit),
            gib(p.host_bytes),
            gib(p.host_limit),
            ("yes" if p.fits else "[red]no[/red]") + ("" if s.enforced or not s.configured else " (not checked)"),
        )
    console.print(table)
    for s in setups:
        console.print(f"  {escape(s.plan.summary())}", highlight=False)
    chosen = next(s for s in setups if s.configured)
    if not chosen.enforced:
        return True
    try:
        check_memory(chosen.plan)
    except MemoryTooSmall as exc:
        console.print(f"[red]capture would not fit in memory:[/red] {escape(str(exc))}", highlight=False)
        return False
    return True
