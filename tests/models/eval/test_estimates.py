"""Acceptance estimates (models/eval/estimates.py): the chain formula at any number of steps, and the
round-weighted replay on the eval's own greedy outputs, which equals the measured acceptance."""

from __future__ import annotations

import pytest
import torch

from models.draft.config import Eagle3Config, default_aux_layers
from models.draft.eagle3 import Eagle3Draft
from models.draft.target_head import TargetLogits
from models.draft.vocab import draft_vocab
from models.eval.estimates import (
    chain_acceptance_length,
    estimates_block,
    replay_acceptance,
    simulate_rounds,
    teacher_forced_hits,
)
from models.eval.speculative_decoding import evaluate_acceptance, greedy_generate
from tests.drafts import load_target, random_prompts

D = 256


# ----------------------------------------------------------------------------- pure functions


def test_chain_formula_uses_the_first_num_steps_rates():
    rates = [0.8, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9]
    assert chain_acceptance_length(rates, 1) == pytest.approx(1.8)
    assert chain_acceptance_length(rates, 3) == pytest.approx(1 + 0.8 + 0.4 + 0.2)
    assert chain_acceptance_length(rates, 7) == pytest.approx(1 + 0.8 + 0.4 + 0.2 + 0.18 + 0.162 + 0.1458 + 0.13122)
    assert chain_acceptance_length([1.0] * 7, 3) == 4.0  # never more than num_steps + 1
    with pytest.raises(ValueError, match="needs 5 per-step"):
        chain_acceptance_length(rates[:4], 5)
    with pytest.raises(ValueError, match="num_steps"):
        chain_acceptance_length(rates, 0)


def test_simulated_rounds_accept_while_right_and_cut_at_the_end():
    # prompt of 2 tokens, K = 2; the round after `produced` output tokens drafts from root produced.
    hits = [[True] * 12, [True] * 12]
    hits[0][3] = False
    hits[1][1] = False
    # root 1: step 0 right, step 1 wrong -> (1, 2); root 3: step 0 wrong -> (0, 1); root 4: both -> (2, 3);
    # root 7 with 2 tokens left: both right, cut to the 2 left -> (2, 2) (a cut round counts what was kept).
    assert simulate_rounds(hits, 2, 9) == [(1, 2), (0, 1), (2, 3), (2, 2)]
    assert simulate_rounds(hits, 2, 10) == [(1, 2), (0, 1), (2, 3), (2, 3)]
    assert simulate_rounds(hits, 2, 1) == [] and simulate_rounds(hits, 2, 0) == []


def test_estimates_block_labels_each_number():
    block = estimates_block(3, training_cond_acc=[0.8, 0.5, 0.5, 0.9, 0.9, 0.9, 0.9], measured=1.83)
    assert block["training_estimate"]["value"] == pytest.approx(2.4)
    assert "training-time estimate at 3 steps" in block["training_estimate"]["label"]
    assert "teacher-forced" in block["training_estimate"]["label"]
    assert block["measured"] == {
        "label": "measured (speculative decoding, 3 steps, on the eval prompts)",
        "value": 1.83,
    }
    short = estimates_block(5, training_cond_acc=[0.5, 0.5], measured=None)
    assert (
        short["training_estimate"]["value"] is None and "unrolled 2 TTT steps" in short["training_estimate"]["missing"]
    )
    assert estimates_block(2, training_cond_acc=None, measured=1.0)["training_estimate"]["missing"]


# ----------------------------------------------------------------------------- replay == measured


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(tiny_target_dir)


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    return random_prompts(target.config.vocab_size, (1, 4, 7, 11, 6, 9), seed=3)


@pytest.fixture(scope="module")
def greedy(target, prompts) -> list[list[int]]:
    return [greedy_generate(target, p, max_new_tokens=40, eos_token_ids=set()) for p in prompts]


def _target_logits(target, ids: torch.Tensor, d2t: torch.Tensor, aux_layers: list[int]):
    from models.draft.vocab import draft_to_target_ids

    with torch.no_grad():
        res = target(input_ids=ids, use_cache=False, output_hidden_states=True)
    aux = torch.cat([res.hidden_states[k + 1] for k in aux_layers], dim=-1)
    full, draft_ids = res.logits.float(), draft_to_target_ids(d2t)
    in_draft = torch.zeros(full.shape[-1], dtype=torch.bool)
    in_draft[draft_ids] = True
    argmax = full.argmax(-1)
    return aux, TargetLogits(logits=full[..., draft_ids], in_draft=in_draft[argmax], argmax=argmax)


@pytest.fixture(scope="module")
def drafts(target, prompts, greedy) -> dict[str, Eagle3Draft]:
    """An untrained draft, and one trained briefly (TTT, AdamW) on the first four prompts' greedy text."""
    seqs = [p + g for p, g in zip(prompts, greedy)]
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=target.config.vocab_size)
    cfg = Eagle3Config.from_target_config(
        target.config, draft_vocab_size=D, aux_layers=default_aux_layers(target.config.num_hidden_layers)
    )
    out = {}
    for name in ("untrained", "trained"):
        torch.manual_seed(0)
        draft = Eagle3Draft(cfg)
        draft.load_target_embedding(target.get_input_embeddings().weight.detach())
        draft.set_draft_vocab(*draft_vocab(counts.numpy(), cfg.vocab_size, D))
        out[name] = draft.float()
    draft = out["trained"].train()
    batches = [
        (torch.tensor([s]), *_target_logits(target, torch.tensor([s]), draft.d2t, cfg.aux_layers)) for s in seqs[:4]
    ]
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=3e-3)
    for i in range(60):
        ids, aux, tgt = batches[i % len(batches)]
        loss = draft.forward_ttt(ids, aux, tgt, torch.ones_like(ids), ttt_steps=3).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {name: d.eval() for name, d in out.items()}


def test_teacher_forced_hits_mark_nothing_past_the_end(target, drafts, prompts, greedy):
    seq = prompts[1] + greedy[1][:10]
    hits = teacher_forced_hits(target, drafts["trained"], seq, 3)
    assert len(hits) == 3 and all(len(h) == len(seq) for h in hits)
    assert not any(hits[k][t] for k in range(3) for t in range(len(seq) - k - 2, len(seq)))


@pytest.mark.parametrize(
    "name,num_steps,max_new", [("untrained", 3, 24), ("trained", 3, 24), ("trained", 2, 31), ("trained", 5, 40)]
)
def test_round_weighted_replay_equals_measured_acceptance(target, drafts, prompts, greedy, name, num_steps, max_new):
    """Teacher-forced hits on the eval's own greedy outputs, simulated round by round, give the measured
    acceptance length exactly (and the same rounds and per-position counts); the chain formula over every
    root of the same text (`all_roots`) is another number: it weights positions differently."""
    draft = drafts[name]
    eos = {greedy[5][17]}  # one prompt stops at an eos inside a round
    measured = evaluate_acceptance(
        target, draft, prompts, num_steps=num_steps, max_new_tokens=max_new, eos_token_ids=eos
    )
    replay = replay_acceptance(target, draft, prompts, measured.outputs, num_steps)
    assert replay["rounds"] == measured.rounds
    assert replay["per_position_reached"] == measured.per_position_reached
    assert replay["per_position_accepted"] == measured.per_position_accepted
    assert replay["acceptance_length"] == pytest.approx(measured.acceptance_length, abs=1e-12)
    if name == "trained":
        assert measured.acceptance_length > 1.5  # the equality is not the trivial one of a draft that is never right
        assert replay["all_roots"]["acceptance_length"] != pytest.approx(measured.acceptance_length, abs=1e-3)
