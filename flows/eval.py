"""Flow `eval`: acceptance length of the exported draft, by chain speculative decoding with the target."""

from __future__ import annotations

from pathlib import Path

from prefect import flow, get_run_logger

from flows.config import RunConfig, load_config, save_run_config
from tasks.eval_tasks import EvalSettings, evaluate_draft
from tasks.run_lock import run_lock


@flow(name="eval", flow_run_name="eval {config_path}")
def evaluate(config_path: str) -> dict:
    """Stage 5: decode held-out prompts with the greedy target and the draft; report the acceptance length."""
    config = load_config(config_path)
    with run_lock(config.run_dir, "eval"):
        save_run_config(config)
        records = [(d.name, config.run_dir / "records" / d.name) for d in config.datasets]
        report = evaluate_draft(config.target.path, config.target.trust_remote_code, config.draft_dir, records,
                                eval_settings(config), config.run_dir / "jobs" / "eval.json", Path(config_path).stem)
    get_run_logger().info("serve it with SGLang:\n%s", report["sglang_command"])
    return report


def eval_settings(config: RunConfig) -> EvalSettings:
    e = config.eval
    return EvalSettings(prompts=e.prompts, max_new_tokens=e.max_new_tokens, num_steps=e.num_steps, device=e.device,
                        eval_fraction=config.train.eval_fraction, seed=config.train.seed, compare_untrained=e.compare_untrained)
