"""Prefect task of the eval stage: speculative decoding with the target and the exported draft, measured."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task
from prefect.artifacts import create_progress_artifact, create_table_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE

from tasks.generate_tasks import artifact_key

EVAL_FILE = "eval.json"
CHUNKS = 10  # progress updates per evaluated draft


@dataclass
class EvalSettings:
    """What `eagle3 eval` measures (config section `eval`, plus the split of `train`)."""

    prompts: int
    max_new_tokens: int
    num_steps: int
    device: str
    eval_fraction: float
    seed: int
    compare_untrained: bool = True


@task(name="spec-eval", cache_policy=NO_CACHE)
def evaluate_draft(target_path: str, trust_remote_code: bool, draft_dir: Path, records: list[tuple[str, Path]],
                   settings: EvalSettings, config_name: str) -> dict[str, Any]:
    """Chain speculative decoding (greedy target, top-1 draft) on held-out prompts; write draft_dir/eval.json."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.capture import DatasetRecords
    from models.eagle3 import Eagle3Draft
    from models.eagle3_export import load_exported_draft
    from models.spec_eval import evaluate_acceptance
    from models.train_data import held_out_prompts

    logger = get_run_logger()
    final = draft_dir / "final"
    if not (final / "config.json").is_file():
        raise FileNotFoundError(f"{final}: no exported draft; run the train stage first (eagle3 run CONFIG --stages train)")
    device = torch.device("cuda" if settings.device == "cuda" or (settings.device == "auto" and torch.cuda.is_available()) else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype, trust_remote_code=trust_remote_code,
                                                  **({"device_map": "auto"} if device.type == "cuda" else {}))
    target = target.eval().requires_grad_(False).to(device) if device.type == "cpu" else target.eval().requires_grad_(False)
    tokenizer = AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    trained = load_exported_draft(final, dtype=dtype).to(device).eval()

    prompts = held_out_prompts([DatasetRecords(n, str(d)) for n, d in records], settings.eval_fraction, settings.prompts,
                               int(trained.config.vocab_size))
    if not prompts:
        raise ValueError(f"no held-out prompts (train.eval_fraction={settings.eval_fraction}); raise eval_fraction "
                         "and retrain, or the records hold no prompt before their first loss token")
    if len(prompts) < settings.prompts:
        logger.warning("only %d held-out prompts (asked for %d): raise train.eval_fraction for more", len(prompts), settings.prompts)
    ids = [p for _, _, p in prompts]

    drafts = {"trained": trained}
    if settings.compare_untrained:
        drafts = {"untrained": _untrained_like(trained, settings.seed, Eagle3Draft).to(device).eval(), **drafts}
    artifact = create_progress_artifact(progress=0.0, key=artifact_key("eval", config_name), description="eval: starting")
    results: dict[str, dict[str, Any]] = {}
    chunk = max(1, -(-len(ids) // CHUNKS))
    for n, (name, draft) in enumerate(drafts.items()):
        parts = []
        for start in range(0, len(ids), chunk):
            parts.append(evaluate_acceptance(target, draft, ids[start : start + chunk], num_steps=settings.num_steps,
                                             max_new_tokens=settings.max_new_tokens, eos_token_ids=eos))
            done = (n + min(1.0, (start + chunk) / len(ids))) / len(drafts)
            update_progress_artifact(artifact, progress=round(100 * done, 1),
                                     description=f"eval: {name} draft, {min(start + chunk, len(ids))}/{len(ids)} prompts")
        results[name] = merge_results(parts)
        logger.info("%s draft: acceptance length %.3f over %d rounds (%d prompts, %d tokens); per position %s",
                    name, results[name]["acceptance_length"], results[name]["rounds"], len(ids), results[name]["new_tokens"],
                    results[name]["per_position_acceptance"])

    estimate = ttt_estimate(draft_dir, settings.num_steps)
    report = {"num_steps": settings.num_steps, "prompts": len(ids), "max_new_tokens": settings.max_new_tokens,
              "device": str(device), "draft": str(final), "ttt_estimate": estimate, **results,
              "sglang_command": sglang_command(target_path, final, settings.num_steps, trust_remote_code)}
    tmp = draft_dir / f".{EVAL_FILE}.tmp"
    tmp.write_text(json.dumps(report, indent=2))
    tmp.replace(draft_dir / EVAL_FILE)
    create_table_artifact(table=eval_rows(report), key=artifact_key("eval-summary", config_name),
                          description=f"Acceptance length, chain speculative decoding, {settings.num_steps} draft tokens per round "
                                      f"(SGLang topk 1), greedy target, {len(ids)} held-out prompts")
    update_progress_artifact(artifact, progress=100.0, description=f"eval: acceptance length {results['trained']['acceptance_length']:.3f}")
    return report


def merge_results(parts: list) -> dict[str, Any]:
    """One summary from SpecEvalResults over disjoint prompt chunks."""
    k = parts[0].num_steps
    reached = [sum(p.per_position_reached[i] for p in parts) for i in range(k)]
    accepted = [sum(p.per_position_accepted[i] for p in parts) for i in range(k)]
    rounds = sum(p.rounds for p in parts)
    return {
        "acceptance_length": round(sum(p.acceptance_length * p.rounds for p in parts) / max(1, rounds), 4),
        "per_position_acceptance": [round(a / r, 4) if r else 0.0 for a, r in zip(accepted, reached)],
        "per_position_reached": reached, "per_position_accepted": accepted,
        "rounds": rounds, "new_tokens": sum(p.new_tokens for p in parts), "prompts": sum(p.prompts for p in parts),
    }


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


def _untrained_like(trained, seed: int, draft_class):
    """A draft as training starts it: the same seed's initial weights, the trained draft's embedding and vocab."""
    import torch

    torch.manual_seed(seed)
    draft = draft_class(trained.config).to(trained.fc.weight.dtype)
    draft.load_target_embedding(trained.embed_tokens.weight.detach().cpu())
    draft.set_draft_vocab(trained.d2t.cpu(), trained.t2d.cpu())
    return draft
