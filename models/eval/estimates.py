"""Acceptance-length estimates, and how they relate to the measured value (models/eval/speculative_decoding.py).

Three numbers answer "how many tokens per target forward?" and they differ in kind:

1. training-time estimate at S steps: the chain formula `chain_acceptance_length` over the first S
   per-step conditional accept rates of the training job's held-out TTT eval (models/train/job.py,
   `per_step_cond_acc`). Teacher-forced on held-out *records* (the dataset's responses, not the
   target's greedy text), and every position counts as a chain root once.
2. measured: speculative decoding with S draft tokens per round on the eval prompts
   (models/eval/speculative_decoding.py `evaluate_acceptance`): the mean over verify rounds of the tokens a round
   adds. Rounds start only where the previous round ended, so positions are weighted by rounds.
3. round-weighted replay (`replay_acceptance`): the draft teacher-forced on the eval's own greedy
   output sequences (one target forward and one TTT forward per prompt: hits per position per
   step), then the chain rounds simulated over those hits, each round accepting while the draft
   is right, up to S, plus the target's bonus token, and cut where the output ends. This equals
   the measured value (2): the draft's TTT step k at root t is the same computation as its
   chain step k drafted after verifying through t (tests/models/draft/test_eagle3.py
   `test_inference_steps_equal_ttt_steps`). `replay_acceptance` also gives the chain formula over
   every root of those sequences (`all_roots`): the same text as (2), weighted like (1).

So (1) vs (3)'s `all_roots` is the distribution gap (held-out records vs the target's greedy
text), and `all_roots` vs (2) is the weighting gap (every root vs the roots rounds start at).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.draft.eagle3 import Eagle3Draft
from models.draft.target_head import TargetLogits
from models.draft.vocab import draft_to_target_ids

TRAINING_LABEL = "training-time estimate at {steps} steps (teacher-forced on held-out training records, chain formula)"
MEASURED_LABEL = "measured (speculative decoding, {steps} steps, on the eval prompts)"
REPLAY_LABEL = (
    "round-weighted replay at {steps} steps (draft teacher-forced on the eval's own greedy outputs, "
    "rounds simulated; equals the measured value in fp32, bf16 rounding may move a near-tie)"
)
ALL_ROOTS_LABEL = "chain formula at {steps} steps on the eval's own greedy outputs (every position a root)"


def chain_acceptance_length(cond_rates: Sequence[float], num_steps: int) -> float:
    """Expected tokens per verify round of a chain draft of `num_steps` tokens: 1 + sum_k prod_{j<=k} p_j.

    `cond_rates[k]` is the conditional accept rate of draft step k given steps < k were accepted;
    only the first num_steps are used (a draft never proposes more per round), so the value is at
    most num_steps + 1. ValueError when fewer rates than num_steps are given: an estimate at more
    steps than training unrolled is not known.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if len(cond_rates) < num_steps:
        raise ValueError(
            f"an estimate at {num_steps} steps needs {num_steps} per-step accept rates, got "
            f"{len(cond_rates)} (training unrolled {len(cond_rates)} TTT steps)"
        )
    length, running = 1.0, 1.0
    for p in cond_rates[:num_steps]:
        running *= float(p)
        length += running
    return length


@torch.no_grad()
def teacher_forced_hits(target, draft: Eagle3Draft, sequence: list[int], num_steps: int) -> list[list[bool]]:
    """hits[k][t]: the draft's TTT step k at root t proposes sequence[t + k + 2] (False where past the end).

    One cache-free target forward over `sequence` gives the aux features (hidden_states[k+1] of the
    draft's aux layers, as models/capture/job.py stores them); the draft runs its training-time test
    over them with the sequence's own tokens as inputs (teacher forcing), eager attention.
    """
    dev = next(target.parameters()).device
    ids = torch.tensor([sequence], device=dev)
    res = target(input_ids=ids, use_cache=False, output_hidden_states=True)
    aux = torch.cat([res.hidden_states[k + 1] for k in draft.config.aux_layers], dim=-1)  # [1, T, 3H]
    full = res.logits.float()  # [1, T, V]
    draft_ids = draft_to_target_ids(draft.d2t).to(dev)
    argmax = full.argmax(-1)
    in_draft = torch.zeros(full.shape[-1], dtype=torch.bool, device=dev)
    in_draft[draft_ids] = True
    tgt = TargetLogits(logits=full[..., draft_ids], in_draft=in_draft[argmax], argmax=argmax)
    out = draft.forward_ttt(
        ids, aux, tgt, torch.ones_like(ids), ttt_steps=num_steps, attn_impl="eager", return_steps=True
    )
    if out.step_logits is None:  # return_steps=True sets it
        raise RuntimeError("forward_ttt(return_steps=True) returned no step_logits")
    t_len = len(sequence)
    hits = []
    for k, logits in enumerate(out.step_logits):
        proposed = draft.draft_to_target(logits[0].argmax(-1)).tolist()  # [T] target ids
        hits.append([t + k + 2 < t_len and proposed[t] == sequence[t + k + 2] for t in range(t_len)])
    return hits


def simulate_rounds(hits: list[list[bool]], prompt_len: int, output_len: int) -> list[tuple[int, int]]:
    """(accepted, kept) per verify round of a chain decode whose draft is right exactly where `hits` says.

    The output's first token comes from the prefill; each round drafts from the last verified
    position r (root), accepts steps 0, 1, ... while hits[k][r] (at most len(hits)), adds the
    accepted tokens plus the bonus, and is cut where the output ends. A cut round's accepted count
    is its known hits (at most what was left), as models/eval/speculative_decoding.py counts it.
    """
    steps = len(hits)
    rounds, produced = [], 1
    while produced < output_len:
        root, left = prompt_len + produced - 2, output_len - produced
        a = 0
        while a < steps and a < left and hits[a][root]:
            a += 1
        kept = min(a + 1, left)
        rounds.append((a, kept))
        produced += kept
    return rounds


def replay_acceptance(
    target, draft: Eagle3Draft, prompts: list[list[int]], outputs: list[list[int]], num_steps: int
) -> dict[str, Any]:
    """The round-weighted replay (module docstring, 3) over prompts and their greedy outputs.

    Returns acceptance_length (mean kept tokens per simulated round; 0.0 with no round),
    per_position_* counted as models/eval/speculative_decoding.py counts them, rounds, and `all_roots`: the
    per-step conditional accept rates over every root in the outputs and their chain formula.
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    reached, accepted = [0] * num_steps, [0] * num_steps
    root_reached, root_accepted = [0] * num_steps, [0] * num_steps
    kept_total, n_rounds = 0, 0
    for prompt, output in zip(prompts, outputs, strict=True):
        if len(output) < 2:
            continue
        hits = teacher_forced_hits(target, draft, list(prompt) + list(output), num_steps)
        for a, kept in simulate_rounds(hits, len(prompt), len(output)):
            n_rounds += 1
            kept_total += kept
            n_reached, n_accepted = (kept, kept) if kept <= a else (min(a + 1, num_steps), a)
            for i in range(n_reached):
                reached[i] += 1
            for i in range(n_accepted):
                accepted[i] += 1
        # Every root whose first drafted token is an output token, chained while right and known.
        t_len = len(prompt) + len(output)
        for root in range(len(prompt) - 1, t_len - 2):
            for k in range(num_steps):
                if root + k + 2 >= t_len:
                    break
                root_reached[k] += 1
                if not hits[k][root]:
                    break
                root_accepted[k] += 1
    cond = [acc / rch if rch else 0.0 for acc, rch in zip(root_accepted, root_reached)]
    return {
        "acceptance_length": kept_total / n_rounds if n_rounds else 0.0,
        "per_position_acceptance": [acc / max(rch, 1) for acc, rch in zip(accepted, reached)],
        "per_position_reached": reached,
        "per_position_accepted": accepted,
        "rounds": n_rounds,
        "all_roots": {
            "per_step_cond_acc": cond,
            "acceptance_length": chain_acceptance_length(cond, num_steps),
            "roots": root_reached[0],
        },
    }


def estimates_block(
    num_steps: int,
    *,
    training_cond_acc: Sequence[float] | None,
    measured: float | None,
    replay: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The labelled figures for eval.json and the reports: each entry {"label", "value", ...}; None where unknown.

    training: the chain formula over the first num_steps of `training_cond_acc` (None when training
    logged no held-out eval, or unrolled fewer TTT steps than num_steps, with the reason).
    """
    block: dict[str, Any] = {"num_steps": num_steps}
    training: dict[str, Any] = {"label": TRAINING_LABEL.format(steps=num_steps), "value": None}
    if training_cond_acc is None:
        training["missing"] = "training logged no held-out eval"
    elif len(training_cond_acc) < num_steps:
        training["missing"] = f"training unrolled {len(training_cond_acc)} TTT steps, fewer than {num_steps}"
    else:
        training["value"] = round(chain_acceptance_length(training_cond_acc, num_steps), 4)
        training["per_step_cond_acc"] = [round(float(p), 4) for p in training_cond_acc[:num_steps]]
    block["training_estimate"] = training
    block["measured"] = {
        "label": MEASURED_LABEL.format(steps=num_steps),
        "value": None if measured is None else round(float(measured), 4),
    }
    if replay is not None:
        block["replay"] = {
            "label": REPLAY_LABEL.format(steps=num_steps),
            "value": round(replay["acceptance_length"], 4),
            "rounds": replay["rounds"],
        }
        roots = replay["all_roots"]
        block["all_roots"] = {
            "label": ALL_ROOTS_LABEL.format(steps=num_steps),
            "value": round(roots["acceptance_length"], 4),
            "per_step_cond_acc": [round(p, 4) for p in roots["per_step_cond_acc"]],
            "roots": roots["roots"],
        }
    return block
