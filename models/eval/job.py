"""Eval entry point: acceptance length of an exported draft on held-out prompts, in its own process.

    python -m models.eval --job JOB.json

A process of its own (like the capture and training ranks) because the target may need every
GPU, and because CPU math must start with denormals flushed in every thread (models/__init__.py):
a Prefect worker thread that was created before that setting decodes up to 40x slower.

Progress goes to stdout after each prompt as `EVAL_PROGRESS draft=NAME done=i total=n new_tokens=T
rounds=R accepted=A` (models/common/rank_protocol.py): that prompt's figures, so a caller that stops the eval
(the GPU check at its time limit) keeps what was measured. The trained draft goes first, for the same
reason. Then the trained draft on each of `eval.benchmarks` (progress as `draft=trained:BENCHMARK`).
The result (one entry per evaluated draft, see `merge_results`, and "benchmarks") is written atomically to the
job's `out` path. A failure exits through the rank harness (models/ranks/harness.py) with one `EVAL_ERROR {json}` line.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.common.atomic import write_atomic
from models.common.job_files import EvalJobFile
from models.common.rank_protocol import EVAL, EVAL_PROGRESS
from models.draft.eagle3 import Eagle3Draft
from models.eval.context import by_context, context_text
from models.eval.estimates import replay_acceptance
from models.eval.prompts import EvalPrompt, benchmark_prompts, eval_prompts
from models.eval.speculative_decoding import SpecEvalResult, evaluate_acceptance
from models.export.eagle3 import has_embedding, load_exported_draft
from models.ranks.harness import say, serve
from models.target.loader import load_language_model
from settings.eval import BenchmarkSpec


def run(job: EvalJobFile) -> dict[str, Any]:
    """Decode the held-out prompts with each draft, then the benchmarks with the trained one; return {"prompts",
    "device", "untrained"?, "trained", "benchmarks"?}.

    Each draft's entry is `merge_results` plus "per_prompt" (new tokens, verify rounds and each round's tokens of each
    prompt) and "replay": the round-weighted replay of its own greedy outputs and the chain formula over every root of
    them (models/eval/estimates.py `replay_acceptance`). "benchmarks": `decode_benchmark`'s entry per benchmark.
    """
    from models.target.tokenizer import load_tokenizer

    final = Path(job.draft_dir)
    if not (final / "config.json").is_file():
        raise FileNotFoundError(
            f"{final}: no exported draft; run the train stage first (eagle3 run CONFIG --stages train)"
        )
    device = torch.device(
        "cuda" if job.device == "cuda" or (job.device == "auto" and torch.cuda.is_available()) else "cpu"
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    # On GPUs: a target larger than one spread over all of them.
    spread = {"device_map": "auto"} if device.type == "cuda" else {}
    target = load_language_model(job.target.path, dtype=dtype, trust_remote_code=job.target.trust_remote_code, **spread)
    target = target.eval().requires_grad_(False)
    tokenizer = load_tokenizer(job.target.path, job.target.trust_remote_code)
    eos = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    first_device = next(target.parameters()).device
    trained = draft_for_target(final, target, dtype).to(first_device).eval()

    selected = eval_prompts(job, int(trained.config.vocab_size))
    prompts = [p.input_ids for p in selected]
    if not prompts:
        raise ValueError(
            f"no held-out prompts (train.eval_fraction={job.eval_fraction}): raise eval_fraction and retrain, "
            "or the records hold no prompt before their first loss token"
        )
    if len(prompts) < job.prompts:
        print(
            f"eval: only {len(prompts)} prompts (asked for {job.prompts}): raise train.eval_fraction or add "
            "eval.prompt_files for more",
            flush=True,
        )

    benchmarks = benchmark_prompts(job, int(trained.config.vocab_size))  # read (and checked) before any decoding

    drafts = {"trained": trained}  # first: an eval stopped part-way has measured the draft that matters
    if job.compare_untrained:
        drafts["untrained"] = untrained_like(trained, job.seed).to(first_device).eval()
    result: dict[str, Any] = {"prompts": len(prompts), "device": str(first_device)}
    for name, draft in drafts.items():
        parts = []
        for i, prompt in enumerate(prompts):
            part = evaluate_acceptance(
                target,
                draft,
                [prompt],
                num_steps=job.num_steps,
                max_new_tokens=job.max_new_tokens,
                eos_token_ids=eos,
                context_edges=job.context_buckets,
            )
            parts.append(part)
            say(
                EVAL_PROGRESS.format(
                    draft=name,
                    done=i + 1,
                    total=len(prompts),
                    new_tokens=part.new_tokens,
                    rounds=part.rounds,
                    accepted=accepted_tokens(part),
                )
            )
        result[name] = merge_results(parts)
        # per prompt, to set beside the engine backend's replies (tasks/eval/engine_report.py compare_with_hf)
        result[name]["per_prompt"] = [
            {
                "source": p.source,
                "id": p.id,
                "new_tokens": r.new_tokens,
                "rounds": r.rounds,
                "round_tokens": r.round_tokens,
            }
            for p, r in zip(selected, parts)
        ]
        # The draft teacher-forced on these greedy outputs, rounds simulated (models/eval/estimates.py): the
        # measured value again in exact arithmetic, plus the chain formula over every root of that text.
        replay = replay_acceptance(target, draft, prompts, [o for p in parts for o in p.outputs], job.num_steps)
        roots = replay["all_roots"]
        result[name]["replay"] = {
            "acceptance_length": round(replay["acceptance_length"], 4),
            "rounds": replay["rounds"],
            "all_roots": {
                "acceptance_length": round(roots["acceptance_length"], 4),
                "roots": roots["roots"],
                "per_step_cond_acc": [round(p, 4) for p in roots["per_step_cond_acc"]],
            },
        }
        print(
            f"eval: {name} draft: acceptance length {result[name]['acceptance_length']:.3f} over "
            f"{result[name]['rounds']} rounds; per position {result[name]['per_position_acceptance']}; by context "
            f"position {context_text(result[name]['by_context'])}",
            flush=True,
        )
    if job.benchmarks:
        result["benchmarks"] = {
            spec.name: decode_benchmark(target, trained, spec, benchmarks[spec.name], job, eos)
            for spec in job.benchmarks
        }
    out = Path(job.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(out, json.dumps(result, indent=2))
    return result


def decode_benchmark(
    target: Any, draft: Eagle3Draft, spec: BenchmarkSpec, prompts: list[EvalPrompt], job: EvalJobFile, eos: set[int]
) -> dict[str, Any]:
    """One benchmark's questions decoded with `draft`: `merge_results` over them, "max_new_tokens", "per_prompt", and
    "acceptance_length_specforge": completion tokens / verify rounds (the prefill's token counted), as SpecForge's
    bench_eagle3 and the published anchors count (models/eval/speculative_decoding.py counts tokens per verify
    round)."""
    max_new_tokens = spec.max_new_tokens or job.max_new_tokens
    parts = []
    for i, prompt in enumerate(prompts):
        part = evaluate_acceptance(
            target,
            draft,
            [prompt.input_ids],
            num_steps=job.num_steps,
            max_new_tokens=max_new_tokens,
            eos_token_ids=eos,
            context_edges=job.context_buckets,
        )
        parts.append(part)
        say(
            EVAL_PROGRESS.format(
                draft=f"trained:{spec.name}",
                done=i + 1,
                total=len(prompts),
                new_tokens=part.new_tokens,
                rounds=part.rounds,
                accepted=accepted_tokens(part),
            )
        )
    merged = merge_results(parts)
    rounds = merged["rounds"]
    merged["acceptance_length_specforge"] = round(merged["new_tokens"] / rounds, 4) if rounds else None
    merged["max_new_tokens"] = max_new_tokens
    merged["per_prompt"] = [
        {"id": p.id, "new_tokens": r.new_tokens, "rounds": r.rounds} for p, r in zip(prompts, parts)
    ]
    print(
        f"eval: benchmark {spec.name}: acceptance length {merged['acceptance_length']:.3f} per verify round "
        f"({merged['acceptance_length_specforge']} as SpecForge counts) over {len(prompts)} questions; by context "
        f"position {context_text(merged['by_context'])}",
        flush=True,
    )
    return merged


def merge_results(parts: list[SpecEvalResult]) -> dict[str, Any]:
    """One summary from SpecEvalResults over disjoint prompts (same num_steps and context edges); "by_context": the
    rounds by context position (models/eval/context.py)."""
    k = parts[0].num_steps
    edges = parts[0].context_edges
    buckets = range(len(edges) + 1)
    reached = [sum(p.per_position_reached[i] for p in parts) for i in range(k)]
    accepted = [sum(p.per_position_accepted[i] for p in parts) for i in range(k)]
    rounds = sum(p.rounds for p in parts)
    return {
        "acceptance_length": round(sum(p.acceptance_length * p.rounds for p in parts) / max(1, rounds), 4),
        "per_position_acceptance": [round(a / r, 4) if r else 0.0 for a, r in zip(accepted, reached)],
        "per_position_reached": reached,
        "per_position_accepted": accepted,
        "rounds": rounds,
        "new_tokens": sum(p.new_tokens for p in parts),
        "prompts": sum(p.prompts for p in parts),
        "by_context": by_context(
            [sum(p.context_rounds[i] for p in parts) for i in buckets],
            [sum(p.context_tokens[i] for p in parts) for i in buckets],
            edges,
        ),
    }


def accepted_tokens(result: SpecEvalResult) -> int:
    """Draft tokens the target accepted over `result`'s verify rounds: acceptance_length x rounds - rounds.

    acceptance_length is the mean over rounds of accepted + 1 (models/eval/speculative_decoding.py), so this is exact.
    """
    return round(result.acceptance_length * result.rounds) - result.rounds


def draft_for_target(final: Path, target: Any, dtype: torch.dtype) -> Eagle3Draft:
    """The export in `final` as the engines serve it beside `target`: an export without embed_tokens gets the
    target's embedding, as vLLM 0.32 (v1/spec_decode/llm_base_proposer.py `_maybe_share_embeddings`: a draft
    without its own embed_tokens shares the target's) and SGLang 0.5.23 (speculative/eagle_worker.py
    `init_lm_head` -> `set_embed`) give it. Without this the draft would be measured with an uninitialized
    embedding."""
    draft = load_exported_draft(final, dtype=dtype)
    if not has_embedding(final):  # validate_export allows that only when hidden_size == target_hidden_size
        draft.load_target_embedding(target.get_input_embeddings().weight.detach().cpu().to(dtype))
    return draft


def untrained_like(trained: Eagle3Draft, seed: int) -> Eagle3Draft:
    """The draft as training starts it: the same seed's initial weights, the trained draft's embedding and vocab."""
    torch.manual_seed(seed)
    draft = Eagle3Draft(trained.config).to(trained.fc.weight.dtype)
    draft.load_target_embedding(trained.embed_tokens.weight.detach().cpu())
    draft.set_draft_vocab(trained.d2t.cpu(), trained.t2d.cpu())
    return draft


def main(argv: list[str] | None = None) -> int:
    """The eval process's entry point (models/ranks/harness.py): run the job, report a failure; the exit status."""
    return serve(argv, "models.eval", __doc__, EVAL, lambda job_path, dist: run(EvalJobFile.load(job_path)))


if __name__ == "__main__":
    sys.exit(main())
