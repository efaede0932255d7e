"""Flow `records`: responses and passthrough rows -> training records, token counts, data report."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.config import RunConfig
from flows.config_file import load_config, save_run_config
from models.jobs import RecordSettings, RecordsJob
from tasks.records.tasks import build_dataset_records, count_record_tokens, publish_records_report, target_vocab
from tasks.run_lock import run_lock


@flow(name="records", flow_run_name="records {config_path}")
def records(config_path: str) -> list[dict]:
    """Stage 2: one task per dataset, then the token counts for the draft vocabulary and the report."""
    config = load_config(config_path)
    with run_lock(config.run_dir, "records"):  # one writer per run directory
        save_run_config(config)
        vocab_size, stop_ids = target_vocab(
            config.target.path, config.target.trust_remote_code, config.sampling.stop_token_ids
        )
        settings = record_settings(config, vocab_size, stop_ids)
        reports = [
            build_dataset_records(
                d.name, d.kind, config.layout, config.target.path, config.target.trust_remote_code, settings
            )
            for d in config.datasets
        ]
        tokens = count_record_tokens(
            config.layout, [d.name for d in config.datasets], vocab_size, config.train.draft_vocab_size
        )
        return publish_records_report(reports, tokens, Path(config_path).stem)


def record_settings(config: RunConfig, vocab_size: int, stop_token_ids: list[int]) -> RecordsJob:
    """The records job of this run: the `records` section, the target's vocabulary size and generate's stop ids."""
    return RecordsJob(**config.records.pick(RecordSettings), vocab_size=vocab_size, stop_token_ids=stop_token_ids)
