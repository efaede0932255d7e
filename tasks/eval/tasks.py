"""Prefect task of the eval stage: speculative decoding with the target and the exported draft, measured."""

from __future__ import annotations

import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from models.estimates import chain_acceptance_length, estimates_block
from models.jobs import EvalJob
from models.atomic import write_atomic
from models.rank_protocol import EVAL, Message
from tasks.artifacts import artifact_key
from tasks.launch import follow_job, write_job

EVAL_FILE = "eval.json"


@task(name="spec-eval", cache_policy=NO_CACHE)
def evaluate_draft(job: EvalJob, job_path: Path, config_name: str) -> dict[str, Any]:
    """Chain speculative decoding (greedy target, top-1 draft) on held-out prompts; write eval.json beside the export."""
    logger = get_run_logger()
    final = Path(job.draft_dir)
    draft_dir, raw_path = final.parent, Path(job.out)
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"{final}: no exported draft; run the train stage first (eagle3 run CONFIG --stages train)")
    write_job(job, job_path, kept=lambda: f"the exported draft in {final} (nothing was evaluated yet)",
              resume="make room there, then run the eval stage again")
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("eval", config_name), description="eval: starting")
    drafts = 2 if job.compare_untrained else 1
    seen: list[str] = []

    def on_progress(message: Message) -> None:
        name, done, total = (message.values[k] for k in ("draft", "done", "total"))
        if name not in seen:
            seen.append(name)
        progress = 100.0 * (len(seen) - 1 + done / total) / drafts
        update_progress_artifact(artifact, progress=round(progress, 1), description=f"eval: {name} draft, {done}/{total} prompts")

    raw_path.unlink(missing_ok=True)
    # Batch-1 decoding is many tiny ops: one CPU thread beats two that spin-wait for each other
    # (measured 20x on 2 busy cores); on GPUs it does not matter.
    follow_job([sys.executable, "-m", "models.eval_job", "--job", str(job_path)], protocol=EVAL, log=logger.info,
               on_message=on_progress, env={"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")})
    results = json.loads(raw_path.read_text())
    raw_path.unlink()
    report = {"num_steps": job.num_steps, "max_new_tokens": job.max_new_tokens, "draft": str(final),
              **results, "ttt_estimate": ttt_estimate(draft_dir, job.num_steps),
              "estimates": estimates(draft_dir, job.num_steps, results["trained"]),
              "sglang_command": sglang_command(job.target_path, final, job.num_steps, job.trust_remote_code)}
    write_atomic(draft_dir / EVAL_FILE, json.dumps(report, indent=2))
    create_table_artifact(table=eval_rows(report), key=artifact_key("eval-summary", config_name),
                          description=f"Acceptance length at {job.num_steps} draft tokens per round (SGLang topk 1), greedy "
                                      f"target, {report['prompts']} held-out prompts. 'measured' rows: speculative decoding "
                                      "on the eval prompts; 'training-time estimate': the chain formula over the held-out "
                                      "TTT accept rates at the same number of steps, teacher-forced on training records "
                                      "(a different text and weighting; README, 'Two acceptance numbers')")
    update_progress_artifact(artifact, progress=100.0, description=f"eval: acceptance length {results['trained']['acceptance_length']:.3f}")
    return report


def _training_cond_acc(draft_dir: Path) -> list[float] | None:
    """The held-out TTT eval's per-step conditional accept rates at the end of training, or None."""
    summary = draft_dir / "train_summary.json"
    if not summary.is_file():
        return None
    last = json.loads(summary.read_text()).get("eval")
    return list(last["per_step_cond_acc"]) if last else None


def ttt_estimate(draft_dir: Path, num_steps: int) -> dict[str, Any] | None:
    """The training-time estimate at the eval's chain length: the chain formula over the first num_steps
    held-out TTT rates (models/estimates.py); None without a held-out eval or with fewer TTT steps."""
    cond = _training_cond_acc(draft_dir)
    if cond is None or len(cond) < num_steps:
        return None
    return {"acceptance_length": round(chain_acceptance_length(cond, num_steps), 4),
            "per_position_acceptance": cond[:num_steps],
            "note": f"training-time estimate at {num_steps} steps: held-out TTT metrics at the end of training "
                    "(teacher-forced on held-out training records, every position a chain root), not a measurement"}


def estimates(draft_dir: Path, num_steps: int, trained: dict[str, Any]) -> dict[str, Any]:
    """eval.json's labelled figures at the eval's num_steps: the training-time estimate, the measured value, the replay."""
    return estimates_block(num_steps, training_cond_acc=_training_cond_acc(draft_dir), measured=trained["acceptance_length"],
                           replay=trained.get("replay"))


MEASURED_ROW = "{name}: measured (speculative decoding)"
ESTIMATE_ROW = "trained: training-time estimate (teacher-forced, held-out records)"


def eval_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The eval-summary table: measured rows per draft, then the trained draft's training-time estimate at the same num_steps."""
    rows = []
    for name in ("untrained", "trained"):
        if name in report:
            r = report[name]
            rows.append({"draft": MEASURED_ROW.format(name=name), "acceptance_length": r["acceptance_length"],
                         **{f"pos_{i + 1}": a for i, a in enumerate(r["per_position_acceptance"])},
                         "rounds": r["rounds"], "tokens": r["new_tokens"]})
    if report.get("ttt_estimate"):
        e = report["ttt_estimate"]
        rows.append({"draft": ESTIMATE_ROW, "acceptance_length": e["acceptance_length"],
                     **{f"pos_{i + 1}": round(a, 4) for i, a in enumerate(e["per_position_acceptance"])}, "rounds": None, "tokens": None})
    return rows


def sglang_command(target_path: str, draft_dir: Path, num_steps: int, trust_remote_code: bool, tp: int = 8) -> str:
    """The SGLang launch that serves the target with this draft (REFERENCE: EAGLE3, top-k 1)."""
    args = ["python", "-m", "sglang.launch_server", "--model-path", target_path, "--tp", str(tp),
            "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft_dir),
            "--speculative-num-steps", str(num_steps), "--speculative-eagle-topk", "1",
            "--speculative-num-draft-tokens", str(num_steps + 1)]
    if trust_remote_code:
        args.append("--trust-remote-code")
    return shlex.join(args)
