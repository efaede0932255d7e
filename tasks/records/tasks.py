"""Prefect tasks of the records stage: one per dataset, the token counts, the data report."""

from __future__ import annotations

from typing import Any, Literal

from prefect import get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE

from models.common.jobs import RecordsJob
from settings.layout import RunLayout
from tasks.generate.prompts import default_stop_ids
from tasks.records.build import RecordsReport, build_records, count_tokens, coverage
from tasks.runtime.artifacts import artifact_key


@task(name="target-vocab", cache_policy=NO_CACHE)
def target_vocab(target_path: str, trust_remote_code: bool, stop_token_ids: list[int] | None) -> tuple[int, list[int]]:
    """The target tokenizer's vocabulary size (what every token id must be below) and the stop ids generate sent
    (`stop_token_ids`, else the tokenizer's eos, as the generate stage chooses them)."""
    from models.target.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(target_path, trust_remote_code)
    return len(tokenizer), list(stop_token_ids or default_stop_ids(tokenizer))


@task(name="build-records", task_run_name="records {dataset}", cache_policy=NO_CACHE)
def build_dataset_records(
    dataset: str,
    kind: Literal["generate", "passthrough"],
    layout: RunLayout,
    target_path: str,
    trust_remote_code: bool,
    settings: RecordsJob,
) -> RecordsReport:
    """Bring one dataset's records up to date with its responses or passthrough rows."""
    tokenizer = None
    if kind == "passthrough":  # only conversations need the chat template
        from models.target.tokenizer import load_tokenizer

        tokenizer = load_tokenizer(target_path, trust_remote_code)
    source = layout.responses(dataset) if kind == "generate" else layout.passthrough(dataset)
    report = build_records(dataset, kind, source, layout.records(dataset), layout.rejects(dataset), settings, tokenizer)
    dropped = ", ".join(f"{k}={v}" for k, v in sorted(report.dropped.items())) or "none"
    get_run_logger().info(
        "%s: %d records (%d parts built now), %d tokens, %d loss tokens, %d truncated; left out: %s",
        dataset,
        report.records,
        report.parts_built,
        report.tokens,
        report.loss_tokens,
        report.truncated,
        dropped,
    )
    return report


@task(name="token-counts", cache_policy=NO_CACHE)
def count_record_tokens(
    layout: RunLayout, datasets: list[str], vocab_size: int, draft_vocab_size: int
) -> dict[str, Any]:
    """records/token_counts.parquet over loss-masked tokens, and the draft vocabulary's coverage."""
    total, counts = count_tokens([layout.records(d) for d in datasets], layout.token_counts, vocab_size)
    k = min(draft_vocab_size, vocab_size)
    share = coverage(counts, k)
    get_run_logger().info(
        "token counts: %d loss tokens over %d distinct ids; the top %d cover %.2f%%",
        total,
        int((counts > 0).sum()),
        k,
        100 * share,
    )
    return {"loss_tokens": total, "distinct_tokens": int((counts > 0).sum()), "draft_vocab_size": k, "coverage": share}


@task(name="records-report", cache_policy=NO_CACHE)
def publish_records_report(
    reports: list[RecordsReport], tokens: dict[str, Any], config_name: str
) -> list[dict[str, Any]]:
    """The data report as a Prefect table artifact plus a markdown note on vocabulary coverage."""
    rows = [r.row() for r in reports]
    create_table_artifact(
        table=rows, key=artifact_key("records-report", config_name), description="Training records per dataset"
    )
    create_markdown_artifact(
        markdown=(
            f"**Loss tokens:** {tokens['loss_tokens']:,} over {tokens['distinct_tokens']:,} distinct token ids.\n\n"
            f"**Draft vocabulary:** the top {tokens['draft_vocab_size']:,} tokens cover "
            f"{100 * tokens['coverage']:.2f}% of the loss tokens."
        ),
        key=artifact_key("records-vocab", config_name),
    )
    return rows
