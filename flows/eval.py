"""Flow `eval`: acceptance length of the exported draft, by chain speculative decoding with the target."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from flows.config import RunConfig, load_config, save_run_config
from models.jobs import EvalJob, EvalSettings, HeldOut
from tasks.eval.tasks import evaluate_draft
from tasks.run_lock import run_lock
from tasks.train.tasks import report_training


@flow(name="eval", flow_run_name="eval {config_path}")
def evaluate(config_path: str) -> dict:
    """Stage 5: decode held-out prompts with the greedy target and the draft; report the acceptance length."""
    config = load_config(config_path)
    with run_lock(config.run_dir, "eval"):
        save_run_config(config)
        report = evaluate_draft(eval_job(config), config.run_dir / "jobs" / "eval.json", Path(config_path).stem)
        if (config.draft_dir / "metrics.jsonl").is_file():  # the training report again, now with the measured value beside its estimate
            report_training(config.draft_dir, Path(config_path).stem, eval_steps=config.eval.num_steps)
    get_run_logger().info("serve it with SGLang:\n%s", report["sglang_command"])
    return report


def eval_job(config: RunConfig) -> EvalJob:
    """The eval job of this run: the `eval` section, the held-out split of `train`, the exported draft."""
    return EvalJob(
        **config.eval.pick(EvalSettings), **config.train.pick(HeldOut), target_path=config.target.path,
        trust_remote_code=config.target.trust_remote_code, draft_dir=str(config.draft_dir / "final"),
        out=str(config.draft_dir / ".eval-raw.json"), datasets=config.dataset_records(),
    )
