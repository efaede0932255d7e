"""Flow `pipeline`: generate -> records -> capture -> train -> eval, as one flow run with a subflow per stage."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.utilities.asyncutils import run_coro_as_sync

from flows.capture import capture
from flows.eval import evaluate
from flows.generate import generate
from flows.preflight import engine_checks, preflight, report
from flows.records import records
from flows.stage_run import held_run
from flows.train import train
from settings.run import RunConfig
from settings.stages import STAGES, Stage, parse_stages
from tasks.runtime.artifacts import publish_pipeline_summary, stage_headline
from tasks.runtime.dead_runs import end_dead_runs
from tasks.serving.launch import launched_servers

ALL_STAGES = ",".join(STAGES)


def _run_name() -> str:
    params = flow_run.parameters
    return f"pipeline {Path(params['config_path']).stem} [{params.get('stages') or ALL_STAGES}]"


@flow(name="pipeline", flow_run_name=_run_name)
def pipeline(
    config_path: str,
    stages: str = ALL_STAGES,
    retry_rejects: bool = False,
    skip_checks: bool = False,
    eval_draft: str | None = None,
) -> dict:
    """The whole run, or the chosen stages; every stage resumes where it stopped.

    `retry_rejects`: also send again the prompts the server refused (HTTP 400) in earlier runs.
    `skip_checks`: do not run the preflight checks (flows/preflight.py) before the first stage.
    `eval_draft`: the draft the eval stage measures instead of eval.draft (final, best or a draft directory).
    """
    chosen = parse_stages(stages)
    # one writer per run dir and per output dir outside it, for every stage: held by `eagle3 run` already, or taken here
    with held_run(config_path, chosen, f"pipeline [{','.join(chosen)}]") as config:
        return run_stages(config_path, config, chosen, retry_rejects, skip_checks, eval_draft)


def run_stages(
    config_path: str,
    config: RunConfig,
    chosen: list[Stage],
    retry_rejects: bool,
    skip_checks: bool = False,
    eval_draft: str | None = None,
) -> dict:
    """The chosen stages in order, each as a subflow, after the preflight checks."""
    if config.target.build_tiny_target:  # demo and tests: the deterministic tiny target, built once
        # imported here: it imports transformers (~2 s), which a stage command's own process needs only for a
        # tokenizer (generate, records), the ranks and servers importing their own
        from models.target.tiny import build_target

        build_target(config.target.path, config.target.tiny_shape, quantize=config.target.tiny_quantize)
    log = get_run_logger()
    end_dead_runs(config.run_dir, log)  # a killed run's flow runs, still Running in the UI
    if skip_checks:
        log.warning(
            "preflight checks skipped (skip_checks / --skip-checks): a problem they find shows up later, "
            "in the stage it breaks"
        )
    else:
        preflight(config, chosen, log, eval_draft)  # the draft `eagle3 eval --draft DIR` serves, checked too
    results: dict = {}
    try:  # after each stage, and when one fails: the pipeline run's own summary artifact
        if "generate" in chosen:
            with serving(config):
                if config.server.launch != "none" and not skip_checks:  # the servers just launched: are they right?
                    report([("engine", f) for f in engine_checks(config)], log, title="engine checks")
                results["generate"] = run_coro_as_sync(generate(config_path, retry_rejects))
            summarize(config_path, chosen, results)
        if "records" in chosen:
            results["records"] = records(config_path)
            summarize(config_path, chosen, results)
        if "capture" in chosen:
            results["capture"] = capture(config_path)
            summarize(config_path, chosen, results)
        if "train" in chosen:
            results["train"] = train(config_path)
            summarize(config_path, chosen, results)
        if "eval" in chosen:
            results["eval"] = evaluate(config_path, eval_draft)
            summarize(config_path, chosen, results)
    except Exception:  # a stage failed: its row says so (not on Ctrl-C or SIGTERM, which stop at once)
        summarize(config_path, chosen, results)
        raise
    return results


def summarize(config_path: str, chosen: list[Stage], results: dict) -> None:
    """The pipeline-summary artifact on this flow run: each stage's subflow run, its state, what it made and its
    artifacts' keys (those are on the subflow runs, not here)."""
    headlines = {stage: stage_headline(stage, result) for stage, result in results.items()}
    publish_pipeline_summary(Path(config_path).stem, chosen, headlines)


def serving(config: RunConfig):
    """The servers of the generate stage: started here when `server.launch` says so, stopped after."""
    s = config.server
    if s.launch != "none":
        what = f"{s.replicas} {s.launch} {s.engine} servers" if s.replicas > 1 else f"the {s.launch} {s.engine} server"
        where = f"{s.url} (router)" if s.router else ", ".join(s.endpoints)
        get_run_logger().info("starting %s at %s (logs in %s)", what, where, config.layout.logs)
    return launched_servers(
        s.launch,
        s.url,
        replicas=s.replicas,
        router=s.router,
        router_args=s.router_args,
        gpus_per_replica=s.gpus_per_replica,
        target=Path(config.target.path),
        command=s.command,
        log_dir=config.layout.logs,
        health_timeout_s=s.health_timeout_s,
        engine=s.engine,
        trust_remote_code=config.target.trust_remote_code,
    )
