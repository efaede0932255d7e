"""Flow `records`: responses and passthrough rows -> training records, token counts, data report."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.stage_run import stage_run
from models.common.jobs import RecordsJob
from settings.records import RecordSettings
from settings.run import RunConfig
from tasks.records.tasks import build_dataset_records, count_record_tokens, publish_records_report, target_vocab


@flow(name="records", flow_run_name="records {config_path}")
def records(config_path: str) -> list[dict]:
    """Stage 2: one task per dataset, then the token counts for the draft vocabulary and the report."""
    with stage_run(config_path, "records") as config:
        target = config.target
        vocab_size, stop_ids = target_vocab(
            target_path=target.path,
            trust_remote_code=target.trust_remote_code,
            stop_token_ids=config.sampling.stop_token_ids,
        )
        settings = record_settings(config, vocab_size, stop_ids)
        reports = [
            build_dataset_records(
                dataset=d.name,
                kind=d.kind,
                layout=config.layout,
                target_path=target.path,
                trust_remote_code=target.trust_remote_code,
                settings=settings,
            )
            for d in config.datasets
        ]
        tokens = count_record_tokens(
            layout=config.layout,
            datasets=[d.name for d in config.datasets],
            vocab_size=vocab_size,
            draft_vocab_size=config.train.draft_vocab_size,
        )
        return publish_records_report(reports=reports, tokens=tokens, config_name=Path(config_path).stem)


def record_settings(config: RunConfig, vocab_size: int, stop_token_ids: list[int]) -> RecordsJob:
    """The records job of this run: the `records` section, the target's vocabulary size and generate's stop ids."""
    return RecordsJob(**config.records.pick(RecordSettings), vocab_size=vocab_size, stop_token_ids=stop_token_ids)
