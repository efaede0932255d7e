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
              "sglang_command": sglang_command(job.target_path, final, job.num_steps, job.trust_remote_code)}
    write_atomic(draft_dir / EVAL_FILE, json.dumps(report, indent=2))
    create_table_artifact(table=eval_rows(report), key=artifact_key("eval-summary", config_name),
                          description=f"Acceptance length, chain speculative decoding, {job.num_steps} draft tokens per round "
                                      f"(SGLang topk 1), greedy target, {report['prompts']} held-out prompts")
    update_progress_artifact(artifact, progress=100.0, description=f"eval: acceptance length {results['trained']['acceptance_length']:.3f}")
    return report


def ttt_estimate(draft_dir: Path, num_steps: int) -> dict[str, Any] | None:
    """The training-time estimate for the same chain length: 1 + sum_k prod_{i<=k} a_i over the first num_steps steps."""
    summary = draft_dir / "train_summary.json"
    if not summary.is_file():
        return None
    last = json.loads(summary.read_text()).get("eval")
    if not last:
        return None
    cond = last["per_step_cond_acc"][:num_steps]
    length, running = 1.0, 1.0
    for a in cond:
        running *= a
        length += running
    return {"acceptance_length": round(length, 4), "per_position_acceptance": cond,
            "note": f"held-out TTT metrics at the end of training, first {len(cond)} steps"}


def eval_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    rows = []
    for name in ("untrained", "trained"):
        if name in report:
            r = report[name]
            rows.append({"draft": name, "acceptance_length": r["acceptance_length"],
                         **{f"pos_{i + 1}": a for i, a in enumerate(r["per_position_acceptance"])},
                         "rounds": r["rounds"], "tokens": r["new_tokens"]})
    if report.get("ttt_estimate"):
        e = report["ttt_estimate"]
        rows.append({"draft": "trained (TTT estimate)", "acceptance_length": e["acceptance_length"],
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
