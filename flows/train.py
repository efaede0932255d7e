"""Flow `train`: the EAGLE-3 draft, trained by a DeepSpeed ZeRO-2 job, exported for SGLang, reported."""

from __future__ import annotations

from pathlib import Path

from prefect import flow

from flows.stage_run import stage_run
from models.common.job_files import TrainJobFile, dataset_records
from settings.run import RunConfig
from settings.train import TrainSettings
from tasks.runtime.launch_ranks import rank_device
from tasks.train.tasks import report_training, retry_train_job, run_train_job


@flow(name="train", flow_run_name="train {config_path}")
def train(config_path: str) -> dict:
    """Stage 4: run (or resume) the training ranks, then plot and publish the metrics."""
    with stage_run(config_path, "train") as config:
        name = Path(config_path).stem
        t = config.train
        # A retry relaunches the ranks, which resume from the last checkpoint; only a crash is retried.
        job = run_train_job.with_options(
            retries=t.retries, retry_delay_seconds=t.retry_delay_s, retry_condition_fn=retry_train_job
        )
        summary = job(
            job=train_job(config),
            job_path=config.layout.job("train"),
            num_ranks=t.num_gpus,
            launcher=t.launcher,
            config_name=name,
            nodes=config.distributed,
        )
        report = report_training(draft_dir=config.layout.draft_dir, config_name=name, eval_steps=config.eval.num_steps)
        return {**summary, "plot": report["plot"]}


def train_job(config: RunConfig) -> TrainJobFile:
    """The job every rank reads (models/train/job.py); each rank derives its DeepSpeed config from the settings in
    it."""
    t, layout = config.train, config.layout
    return TrainJobFile(
        **t.pick(TrainSettings),
        target=config.target,
        device=rank_device(t.launcher),
        out_dir=str(layout.draft_dir),
        token_counts=str(layout.token_counts),
        hidden_dir=str(layout.hidden_dir),
        datasets=dataset_records(config),
        aux_layers=config.capture.aux_layers,
    )
