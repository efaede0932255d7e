"""`eagle3 plan`: what every stage of a config still has to do, in tokens, bytes and time."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from flows.config.schema import RunConfig
from tasks.capture.plan import (
    CapturePlan,
    DiskTooSmall,
    ExtractionWindow,
    check_fits,
    human_bytes,
    plan_capture,
    target_shape,
)
from tasks.capture.tasks import captured_tokens, last_throughput
from tasks.checkpoints import summarize
from tasks.records.build import summarize_records


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
        plan = capture_plan(config)
    except Exception as exc:  # e.g. a Hub id on an offline machine
        console.print(
            "[yellow]capture: no disk plan: cannot read the target's config.json "
            f"({escape(str(exc).splitlines()[0])[:160]}). "
            "Point target.path at a local copy of the checkpoint (config.json is all the plan needs).[/yellow]",
            highlight=False,
        )
        return True
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
    try:
        check_fits(plan)
    except DiskTooSmall as exc:
        console.print(f"[red]capture would not fit:[/red] {escape(str(exc))}", highlight=False)
        return False
    return True


def capture_plan(config: RunConfig) -> CapturePlan:
    """The capture's bytes still to write against the free space
    (reads the target's config.json; raises if it cannot)."""
    shape = target_shape(config.target.path, config.target.trust_remote_code)
    c, layout = config.capture, config.layout
    engine = (
        ExtractionWindow(layout.engine_dir, c.engine.max_concurrency, c.shard_tokens) if c.backend == "vllm" else None
    )
    return plan_capture(
        [layout.records(d.name) for d in config.datasets],
        layout.hidden_dir,
        shape,
        c.dtype,
        margin=c.disk_margin,
        storage=c.storage,
        max_tokens=c.max_tokens,
        tokens_done=captured_tokens(layout.hidden_dir),
        tokens_per_s=last_throughput(layout.hidden_dir),
        engine=engine,
    )
