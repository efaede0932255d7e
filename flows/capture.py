"""Flow `capture`: the target's aux and final hidden states for every record, by a DeepSpeed job or a vLLM server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import flow

from flows.stage_run import stage_run
from models.capture.shards import NATIVE
from models.common.job_files import CaptureJobFile, dataset_records
from settings.capture import CaptureSettings, VllmCaptureSettings
from settings.run import RunConfig
from tasks.capture.plan import ExtractionWindow, capture_layers, target_shape
from tasks.capture.tasks import (
    capture_retryable,
    index_hidden_states,
    plan_capture_task,
    run_capture_job,
    run_vllm_capture,
)
from tasks.runtime.launch_ranks import rank_device
from tasks.serving.capture_server import CaptureServer


@flow(name="capture", flow_run_name="capture {config_path}")
def capture(config_path: str) -> dict:
    """Stage 3: plan the disk, run the ranks (or the vLLM server), index the shards."""
    with stage_run(config_path, "capture") as config:
        shape = target_shape(config.target.path, config.target.trust_remote_code)
        layout = config.layout
        c = config.capture
        plan = plan_capture_task(
            records_dirs=[layout.records(d.name) for d in config.datasets],
            out_dir=layout.hidden_dir,
            shape=shape,
            dtype=c.dtype,
            storage=c.storage,
            margin=c.disk_margin,
            max_tokens=c.max_tokens,
            engine=ExtractionWindow(layout.engine_dir, c.engine.max_concurrency, c.shard_tokens)
            if c.backend == "vllm"
            else None,
        )
        aux_layers = capture_layers(shape.num_layers, c.aux_layers)
        speed = 0.0
        # a crashed or killed rank (or a vLLM outage) is retried (the retry resumes);
        # capture_retryable says which failures
        retried: dict[str, Any] = dict(
            retries=c.retries, retry_delay_seconds=c.retry_delay_s, retry_condition_fn=capture_retryable
        )
        if c.backend == "vllm" and plan.tokens_todo:
            e = c.engine
            server = CaptureServer(
                launch=e.launch,
                url=e.url,
                target=config.target.path,
                aux_layers=aux_layers,
                num_layers=shape.num_layers,
                shared_dir=layout.engine_dir,
                command=e.command,
                trust_remote_code=config.target.trust_remote_code,
            )
            speed = run_vllm_capture.with_options(**retried)(
                job=capture_job(config, aux_layers),
                engine=VllmCaptureSettings(**e.pick(VllmCaptureSettings)),
                server=server,  # started by each attempt, so a retry gets a fresh one
                config_name=Path(config_path).stem,
                token_cap=c.max_tokens,
                log_dir=layout.logs,
                health_timeout_s=e.health_timeout_s,
            )
        # Several nodes: always launched, since the other nodes' `eagle3 node` joins every launch
        # (ranks with nothing to do exit at once).
        elif c.backend == "deepspeed" and (plan.tokens_todo or config.distributed.multinode):
            speed = run_capture_job.with_options(**retried)(
                job=capture_job(config, aux_layers),
                job_path=layout.job("capture"),
                num_ranks=c.num_gpus,
                launcher=c.launcher,
                config_name=Path(config_path).stem,
                token_cap=c.max_tokens,
                nodes=config.distributed,
            )
        metadata = {
            "target": config.target.path,
            "hidden_size": shape.hidden_size,
            "num_layers": shape.num_layers,
            "aux_layers": aux_layers,
            "dtype": plan.dtype,
            **({"storage": c.storage} if c.storage != NATIVE else {}),  # absent: native, as before fp8 existed
        }
        return index_hidden_states(
            out_dir=layout.hidden_dir, metadata=metadata, tokens_per_s=speed, config_name=Path(config_path).stem
        )


def capture_job(config: RunConfig, aux_layers: list[int]) -> CaptureJobFile:
    """The job every rank reads (models/capture/job.py), and the vLLM capture's; the job task states its
    launch_tokens per attempt."""
    c = config.capture
    return CaptureJobFile(
        **{**c.pick(CaptureSettings), "aux_layers": aux_layers},
        target=config.target,
        datasets=dataset_records(config),
        out_dir=str(config.layout.hidden_dir),
        launch_tokens=None,
        device=rank_device(c.launcher),
    )
