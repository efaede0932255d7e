"""Flow `eval`: acceptance length of the exported draft, by chain speculative decoding with the target,
measured in-process (HF), through the serving engine, or both."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from flows.stage_run import stage_run
from models.common.job_files import EvalJobFile, dataset_records
from settings.eval import EvalSettings
from settings.layout import RUN_DRAFTS
from settings.run import RunConfig
from settings.server import ServerSettings
from settings.train import HeldOut
from tasks.eval.benchmarks import benchmark_rows, benchmark_table_text, probe_benchmark, resolve_benchmarks
from tasks.eval.tasks import evaluate_draft, evaluate_on_server, publish_eval
from tasks.serving.eval_server import EvalServer
from tasks.train.tasks import report_training


@flow(name="eval", flow_run_name="eval {config_path}")
def evaluate(config_path: str, draft: str | None = None) -> dict:
    """Stage 5: decode the eval prompts with the greedy target and the draft; report the acceptance length.

    `draft`: instead of eval.draft, this one (final, best, or the directory of any EAGLE-3 draft).
    """
    with stage_run(config_path, "eval") as config:
        name = Path(config_path).stem
        chosen = draft or config.eval.draft
        ours = chosen in RUN_DRAFTS  # the train stage's: its held-out metrics belong to it
        draft_dir, report_path, raw_path = config.layout.eval_of(chosen)
        job = eval_job(config, draft_dir, raw_path)
        backend = config.eval.backend
        hf = (
            evaluate_draft(job=job, job_path=config.layout.job("eval"), config_name=name)
            if backend in ("hf", "both")
            else None
        )
        engine = (
            evaluate_on_server(job=job, engine=config.eval, server=eval_server(config), config_name=name)
            if backend in ("engine", "both")
            else None
        )
        report = publish_eval(
            job=job,
            hf=hf,
            engine=engine,
            config_name=name,
            report_path=report_path,
            train_dir=config.layout.draft_dir if ours else None,
        )
        if report.get("benchmarks"):
            get_run_logger().info("benchmarks:\n%s", benchmark_table_text(benchmark_rows(report["benchmarks"])))
        if ours and config.layout.metrics.is_file():  # the training report again, the measured value by its estimate
            report_training(draft_dir=config.layout.draft_dir, config_name=name, eval_steps=config.eval.num_steps)
    get_run_logger().info(
        "serve it with SGLang:\n%s\nor with vLLM:\n%s", report["sglang_command"], report["vllm_command"]
    )
    return report


def eval_job(config: RunConfig, draft_dir: Path, raw_path: Path) -> EvalJobFile:
    """The eval job of this run: the `eval` section, the held-out split of `train`, the exported draft; each benchmark
    read and checked, a Hub one's rows written beside the job (tasks/eval/benchmarks.py)."""
    layout = config.layout
    settings = config.eval.pick(EvalSettings)
    settings["benchmarks"] = resolve_benchmarks(config.eval.benchmarks, layout.benchmark_rows())
    if config.eval.context_probes:
        settings["benchmarks"] += probe_benchmark(
            dataset_records(config),
            config.train.eval_fraction,
            config.eval.context_buckets,
            config.eval.context_probes,
            config.eval.context_probe_tokens,
            layout.benchmark_rows(),
        )
    return EvalJobFile(
        **settings,
        **config.train.pick(HeldOut),
        target=config.target,
        draft_dir=str(draft_dir),
        out=str(raw_path),
        datasets=dataset_records(config),
    )


def eval_server(config: RunConfig) -> EvalServer:
    """The engine eval's server: `server` as the generate stage starts it, one server at server.url
    (or the running one)."""
    s = config.server
    return EvalServer(
        settings=ServerSettings(**{**s.pick(ServerSettings), "url": config.eval_server_url, "urls": None}),
        launch=s.launch,
        target=config.target.path,
        log_dir=config.layout.logs,
        command=s.command,
        gpus_per_replica=s.gpus_per_replica,
        trust_remote_code=config.target.trust_remote_code,
    )
