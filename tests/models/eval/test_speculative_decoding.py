"""Chain speculative decoding (models/eval/speculative_decoding.py) on the tiny target: output equal to plain
greedy, rounds equal to a cache-free reference, exact acceptance for scripted drafts, stopping."""

from __future__ import annotations

import json

import pytest
import torch

from models.draft.caches import KVCache
from models.draft.config import Eagle3Config, default_aux_layers
from models.draft.eagle3 import DraftStep, Eagle3Draft
from models.eval.context import rounds_from_steps
from models.eval.job import merge_results
from models.eval.speculative_decoding import (
    SpecEvalResult,
    evaluate_acceptance,
    greedy_generate,
    speculative_decode,
    speculative_generate,
)
from tests.drafts import load_target, random_draft, random_prompts

D = 256  # draft vocab < target vocab, so d2t is not the identity
MAX_NEW = 20

pytestmark = pytest.mark.usefixtures("one_torch_thread_in_module")  # tiny tensors


@pytest.fixture(scope="module")
def target_dir(one_torch_thread_in_module, request):
    """The session's `tiny_target_dir`, requested only once one thread is set: when this module
    is the first to ask, the build's calibration forwards run single-threaded (on a busy 2-core
    box two OpenMP threads make it several times slower)."""
    return request.getfixturevalue("tiny_target_dir")


@pytest.fixture(scope="module")
def target(target_dir):
    return load_target(target_dir)


@pytest.fixture(scope="module")
def prompts(target) -> list[list[int]]:
    """Distinct prompts of varied length, one of a single token (its extend has one position)."""
    return random_prompts(target.config.vocab_size, (1, 5, 9, 14), seed=0)


@pytest.fixture(scope="module")
def greedy(target, prompts) -> list[list[int]]:
    """Greedy continuations without eos, long enough for every draft position a run can reach."""
    return [greedy_generate(target, p, max_new_tokens=MAX_NEW + 12, eos_token_ids=set()) for p in prompts]


class ScriptedDraft(Eagle3Draft):
    """A real (random) draft whose logits are pushed so that it is right exactly where `hit(p)` says.

    The draft step at position p proposes the token at p + 2 (its input is the token at p + 1).
    Where the true greedy token is known: hit(p) adds +1e4 to it (certainly proposed), otherwise
    -1e4 (certainly not; the real random logits pick something else). Every extend call checks
    that its tokens are the verified ones at the right positions and records its aux features.
    """

    def setup(self, seqs: list[list[int]], hit) -> ScriptedDraft:
        self.seqs, self.hit, self.extends, self.seq = seqs, hit, [], None
        return self

    def forward(self, input_ids, hidden, position_ids=None, cache=None, *, target_vocab_logits=False):
        past = 0 if cache is None else len(cache)
        step = super().forward(input_ids, hidden, position_ids, cache)
        ids = input_ids[0].tolist()
        positions = range(past, past + len(ids))
        if hidden.shape[-1] == 3 * self.config.target_hidden_size:  # an extend over verified positions
            if past == 0:
                found = [s for s in self.seqs if s[1 : len(ids) + 1] == ids]
                assert len(found) == 1, "extend from an empty cache must start at a known prompt"
                self.seq = found[0]
            assert ids == self.seq[past + 1 : past + 1 + len(ids)], "extend tokens are not the verified ones"
            self.extends.append((past, hidden.detach().clone()))
        t2d_index = torch.cumsum(self.t2d.long(), 0) - 1  # target id -> draft index
        logits = step.logits.clone()
        for j, p in enumerate(positions):
            if p + 2 < len(self.seq):
                tok = self.seq[p + 2]
                assert self.t2d[tok], "scripted tokens must be in the draft vocab"
                logits[0, j, t2d_index[tok]] += 1e4 if self.hit(p) else -1e4
        return DraftStep(logits=logits, hidden=step.hidden, cache=step.cache)


def _draft(target, counts: torch.Tensor, cls=Eagle3Draft, dtype=torch.float32, seed: int = 0):
    cfg = Eagle3Config.from_target_config(
        target.config, draft_vocab_size=D, aux_layers=default_aux_layers(target.config.num_hidden_layers)
    )
    model = random_draft(cfg, target.get_input_embeddings().weight, seed=seed, counts=counts.numpy(), cls=cls)
    return model.to(dtype).eval()


def _random_draft(target, dtype=torch.float32):
    g = torch.Generator().manual_seed(1)
    return _draft(target, torch.randint(0, 100, (target.config.vocab_size,), generator=g), dtype=dtype)


def _scripted_draft(target, prompts, greedy, hit) -> ScriptedDraft:
    seqs = [p + c for p, c in zip(prompts, greedy)]
    counts = torch.bincount(torch.tensor([t for s in seqs for t in s]), minlength=target.config.vocab_size)
    assert int((counts > 0).sum()) <= D
    return _draft(target, counts, cls=ScriptedDraft).setup(seqs, hit)


_PATTERN = "1101110111101101011110011011101"  # hits and misses: rounds accept 0..K tokens


def _mixed(p: int) -> bool:
    return _PATTERN[p % len(_PATTERN)] == "1"


def _expected_rounds(prompt_len: int, num_steps: int, max_new: int, hit) -> list[tuple[int, int]]:
    """(accepted a, kept tokens) per round for a scripted draft."""
    m, out, rounds = prompt_len, 1, []  # m: position of the last verified token (the prefill's)
    while out < max_new:
        a = 0
        while a < num_steps and hit(m - 1 + a):  # d_{a+1} is drafted at position m - 1 + a
            a += 1
        kept = min(a + 1, max_new - out)
        rounds.append((a, kept))
        out, m = out + kept, m + kept
    return rounds


def _expected_accepts(prompt_len: int, num_steps: int, max_new: int, hit) -> list[int]:
    """Accepted count per round as speculative_generate reports it: kept - 1 (a, unless cut)."""
    return [kept - 1 for _, kept in _expected_rounds(prompt_len, num_steps, max_new, hit)]


# ----------------------------------------------------------------------------- output == greedy


@pytest.mark.parametrize("num_steps", [1, 3, 5])
def test_random_draft_output_equals_greedy(target, prompts, greedy, num_steps):
    draft = _random_draft(target)
    for prompt, want in zip(prompts, greedy):
        out, accepts = speculative_generate(
            target, draft, prompt, num_steps=num_steps, max_new_tokens=MAX_NEW, eos_token_ids=set()
        )
        assert out == want[:MAX_NEW]
        assert sum(a + 1 for a in accepts) == len(out) - 1
        assert all(0 <= a <= num_steps for a in accepts)


def test_bf16_draft_output_equals_greedy(target, prompts, greedy):
    draft = _random_draft(target, dtype=torch.bfloat16)
    out, _ = speculative_generate(target, draft, prompts[2], num_steps=3, max_new_tokens=MAX_NEW, eos_token_ids=set())
    assert out == greedy[2][:MAX_NEW]


@pytest.mark.parametrize("num_steps", [2, 4])
def test_partly_right_draft_output_and_accepts(target, prompts, greedy, num_steps):
    """Rounds accepting 0..K tokens: the output stays greedy, the accepted counts follow the script."""
    draft = _scripted_draft(target, prompts, greedy, _mixed)
    for prompt, want in zip(prompts, greedy):
        out, accepts = speculative_generate(
            target, draft, prompt, num_steps=num_steps, max_new_tokens=MAX_NEW, eos_token_ids=set()
        )
        assert out == want[:MAX_NEW]
        assert accepts == _expected_accepts(len(prompt), num_steps, MAX_NEW, _mixed)
    seen = {a for p in prompts for a in _expected_accepts(len(p), num_steps, MAX_NEW, _mixed)}
    assert seen == set(range(num_steps + 1))


# ----------------------------------------------------------------------------- cache bookkeeping


def _full(target, ids: list[int], aux_layers: list[int]) -> tuple[torch.Tensor, list[int]]:
    """One cache-free target forward: aux features [1, n, 3H] and the argmax at every position."""
    out = target(input_ids=torch.tensor([ids]), use_cache=False, output_hidden_states=True)
    return torch.cat([out.hidden_states[k + 1] for k in aux_layers], -1), out.logits[0].argmax(-1).tolist()


@torch.no_grad()
def _reference_rounds(target, draft, prompt: list[int], num_steps: int, max_new: int) -> list[tuple]:
    """Speculative decoding without caches: every round re-runs the target over the whole sequence
    and the draft's extend over the whole verified prefix from an empty KVCache."""
    layers = draft.config.aux_layers
    seq = list(prompt)
    seq.append(_full(target, seq, layers)[1][-1])
    out, rounds = 1, []
    while out < max_new:
        aux, _ = _full(target, seq[:-1], layers)  # positions 0..L-2, tokens 1..L-1 follow
        step = draft(torch.tensor([seq[1:]]), aux, cache=(cache := KVCache()))
        drafted = [int(draft.draft_to_target(step.logits[0, -1].argmax()))]
        for _ in range(1, num_steps):
            step = draft(torch.tensor([[drafted[-1]]]), step.hidden[:, -1:], cache=cache)
            drafted.append(int(draft.draft_to_target(step.logits[0, -1].argmax())))
        verified = _full(target, seq + drafted, layers)[1][len(seq) - 1 :]  # argmax at [t_last, d1..dK]
        a = 0
        while a < num_steps and drafted[a] == verified[a]:
            a += 1
        kept = (drafted[:a] + [verified[a]])[: max_new - out]
        rounds.append((drafted, verified, a, len(kept)))
        seq += kept
        out += len(kept)
    return rounds


@pytest.mark.parametrize("scripted", [False, True], ids=["random", "partly_right"])
def test_rounds_equal_cache_free_reference(target, prompts, greedy, scripted):
    """Every round's drafted tokens and target argmaxes equal a recompute-everything reference: an
    off-by-one in either cache's crop, the positions or the aux slice changes the draft's tokens."""
    draft = _scripted_draft(target, prompts, greedy, _mixed) if scripted else _random_draft(target)
    accepted = set()
    for prompt in prompts[1:3]:
        _, rounds = speculative_decode(target, draft, prompt, num_steps=3, max_new_tokens=14, eos_token_ids=set())
        got = [(r.drafted, r.verified, r.accepted, r.kept) for r in rounds]
        assert got == _reference_rounds(target, draft, prompt, 3, 14)
        accepted |= {r.accepted for r in rounds}
    if scripted:
        assert accepted == {0, 1, 2, 3}


def test_extend_features_are_the_targets(target, prompts, greedy):
    """The draft extends over each newly verified position exactly once, with the target's aux
    features at that position (hidden_states[k+1] of the aux layers), in order."""
    draft = _scripted_draft(target, prompts, greedy, _mixed)
    prompt = prompts[2]
    out, accepts = speculative_generate(target, draft, prompt, num_steps=3, max_new_tokens=MAX_NEW, eos_token_ids=set())
    starts = [past for past, _ in draft.extends]
    ends = [past + aux.shape[1] for past, aux in draft.extends]
    assert len(draft.extends) == len(accepts)  # one extend before each round's chain
    assert starts[0] == 0 and starts[1:] == ends[:-1]  # contiguous, nothing twice
    # Before the last round: every position but the last verified one (its next token is unknown).
    assert ends[-1] == len(prompt) + len(out) - (accepts[-1] + 1) - 1
    assert [e - s for s, e in zip(starts[1:], ends[1:])] == [a + 1 for a in accepts[:-1]]
    with torch.no_grad():
        want, _ = _full(target, prompt + out, draft.config.aux_layers)
    for past, aux in draft.extends:
        torch.testing.assert_close(aux, want[:, past : past + aux.shape[1]], rtol=1e-4, atol=1e-4)


# ----------------------------------------------------------------------------- acceptance statistics


def test_oracle_draft_accepts_every_token(target, prompts, greedy):
    k, per_prompt = 3, 4
    draft = _scripted_draft(target, prompts, greedy, lambda p: True)
    max_new = 1 + per_prompt * (k + 1)  # the prefill token, then whole rounds: no round is cut
    res = evaluate_acceptance(target, draft, prompts, num_steps=k, max_new_tokens=max_new, eos_token_ids=set())
    assert res.acceptance_length == k + 1
    assert res.per_position_acceptance == [1.0] * k
    assert res.rounds == len(prompts) * per_prompt
    assert res.per_position_reached == res.per_position_accepted == [res.rounds] * k
    assert res.new_tokens == len(prompts) * max_new and res.prompts == len(prompts) and res.num_steps == k
    assert res.outputs == [g[:max_new] for g in greedy]


def test_always_wrong_draft_accepts_nothing(target, prompts, greedy):
    k = 4
    draft = _scripted_draft(target, prompts, greedy, lambda p: False)
    res = evaluate_acceptance(target, draft, prompts, num_steps=k, max_new_tokens=10, eos_token_ids=set())
    assert res.acceptance_length == 1.0
    assert res.rounds == len(prompts) * 9
    assert res.per_position_acceptance == [0.0] * k
    assert res.per_position_reached == [res.rounds, 0, 0, 0]
    assert res.per_position_accepted == [0] * k
    assert res.outputs == [g[:10] for g in greedy]


def test_mixed_acceptance_statistics(target, prompts, greedy):
    k = 3
    draft = _scripted_draft(target, prompts, greedy, _mixed)
    res = evaluate_acceptance(target, draft, prompts, num_steps=k, max_new_tokens=MAX_NEW, eos_token_ids=set())
    rounds = [r for p in prompts for r in _expected_rounds(len(p), k, MAX_NEW, _mixed)]
    assert any(kept < a + 1 for a, kept in rounds)  # some last round is cut by max_new_tokens
    reached, accepted = [0] * k, [0] * k
    for a, kept in rounds:
        # A cut round counts its kept draft tokens as reached and accepted, nothing after them.
        n_reached, n_accepted = (kept, kept) if kept <= a else (min(a + 1, k), a)
        for i in range(n_reached):
            reached[i] += 1
        for i in range(n_accepted):
            accepted[i] += 1
    assert res.rounds == len(rounds)
    assert res.new_tokens == len(prompts) * MAX_NEW
    assert res.acceptance_length == pytest.approx(len(prompts) * (MAX_NEW - 1) / len(rounds))
    assert res.per_position_reached == reached and res.per_position_accepted == accepted
    assert res.per_position_acceptance == pytest.approx([x / y for x, y in zip(accepted, reached)])
    assert 0 < min(res.per_position_acceptance) and max(res.per_position_acceptance) < 1


def test_round_cut_by_max_new_tokens_counts_kept_tokens(target, prompts, greedy):
    """Oracle, K=3, max 1 + 4 + 2 tokens: round 1 adds 4, round 2 is cut to 2 kept tokens."""
    draft = _scripted_draft(target, prompts, greedy, lambda p: True)
    out, accepts = speculative_generate(target, draft, prompts[1], num_steps=3, max_new_tokens=7, eos_token_ids=set())
    assert out == greedy[1][:7] and accepts == [3, 1]
    res = evaluate_acceptance(target, draft, [prompts[1]], num_steps=3, max_new_tokens=7, eos_token_ids=set())
    assert res.acceptance_length == 3.0 and res.rounds == 2 and res.new_tokens == 7
    # The cut round reached and accepted d1, d2 (kept); d3 was neither rejected nor kept.
    assert res.per_position_reached == [2, 2, 1] and res.per_position_accepted == [2, 2, 1]


def test_rounds_are_counted_in_the_bucket_of_where_they_start(target, prompts, greedy):
    """Each round in the bucket of its first draft token's position (prompt + tokens before it), from the scripted
    rounds: the first round's d1 follows the prompt and the prefill's token, each later one the kept tokens before."""
    k, edges = 3, [8, 16, 24]
    draft = _scripted_draft(target, prompts, greedy, _mixed)
    res = evaluate_acceptance(
        target, draft, prompts, num_steps=k, max_new_tokens=MAX_NEW, eos_token_ids=set(), context_edges=edges
    )
    rounds_in, tokens_in = [0] * 4, [0] * 4
    for p in prompts:
        start = len(p) + 1
        for _, kept in _expected_rounds(len(p), k, MAX_NEW, _mixed):
            i = sum(start >= e for e in edges)
            rounds_in[i] += 1
            tokens_in[i] += kept
            start += kept
    assert all(rounds_in)  # every bucket holds rounds: a shifted position would move some
    assert res.context_edges == edges and res.context_rounds == rounds_in and res.context_tokens == tokens_in
    merged = merge_results([res])["by_context"]
    assert [(b["label"], b["rounds"]) for b in merged] == list(zip(["0-8", "8-16", "16-24", "24+"], rounds_in))
    assert [b["acceptance_length"] for b in merged] == [round(t / r, 4) for t, r in zip(tokens_in, rounds_in)]
    # the overall figure is the round-weighted mean of the buckets'
    assert res.acceptance_length == pytest.approx(sum(tokens_in) / sum(rounds_in))


@pytest.mark.parametrize("end", ["max_new_tokens", "eos"])
def test_an_engine_s_per_round_counts_place_the_rounds_where_the_decoding_had_them(target, prompts, greedy, end):
    """models/eval/context.py `rounds_from_steps`, given only what vLLM sends (the prompt's length, the answer's and
    each round's accepted drafts before any cut), finds where the decoding loop itself started each round and what it
    kept, the last round cut by the end."""
    k, cut, decoded = 3, 0, 0
    draft = _scripted_draft(target, prompts, greedy, lambda p: True)  # oracle: rounds of 4, so the end cuts one
    mixed = _scripted_draft(target, prompts, greedy, _mixed)
    for prompt, want in zip(prompts, greedy):
        eos = set()
        if end == "eos":
            # The latest token first seen at index 9 to MAX_NEW - 3 (the tiny target's greedy text repeats tokens,
            # and which ones has differed between the machines that built it): the decoding stops there, after 3 or
            # more rounds.
            j = next((j for j in range(MAX_NEW - 3, 8, -1) if want[j] not in want[:j]), None)
            if j is None:
                continue
            eos = {want[j]}
        decoded += 1
        for d in (draft, mixed):
            out, rounds = speculative_decode(
                target, d, prompt, num_steps=k, max_new_tokens=MAX_NEW - 1, eos_token_ids=eos
            )
            assert len(rounds) >= 3
            placed = rounds_from_steps(len(prompt), len(out), [r.accepted for r in rounds])
            assert placed == [(r.start, r.kept) for r in rounds]
            cut += rounds[-1].kept < rounds[-1].accepted + 1
    assert decoded >= 2 and cut  # some last round was cut by the end


def test_context_edges_must_ascend(target, prompts):
    draft = _random_draft(target)
    for bad in ([16, 8], [8, 8], [0, 8]):
        with pytest.raises(ValueError, match="ascending positive"):
            evaluate_acceptance(target, draft, prompts[:1], num_steps=2, max_new_tokens=4, context_edges=bad)


# ----------------------------------------------------------------------------- stopping


@pytest.mark.parametrize("scripted", [False, True], ids=["random", "oracle"])
def test_eos_stops_generation(target, prompts, greedy, scripted):
    """A token of a greedy continuation declared eos: the output ends right after its first occurrence."""
    # The tiny target's greedy text is repetitive: find a token first seen at index j, with j
    # inside an oracle round of 4 (indices 1-4, 5-8, ...) but not at its end, so the round is cut.
    i, j = next(
        (i, j)
        for i, want in enumerate(greedy)
        for j in range(3, MAX_NEW)
        if want[j] not in want[:j] and (j - 1) % 4 in (1, 2)
    )
    prompt, want, eos = prompts[i], greedy[i], {greedy[i][j]}
    draft = _scripted_draft(target, prompts, greedy, lambda p: True) if scripted else _random_draft(target)
    assert greedy_generate(target, prompt, max_new_tokens=MAX_NEW, eos_token_ids=eos) == want[: j + 1]
    out, accepts = speculative_generate(target, draft, prompt, num_steps=3, max_new_tokens=MAX_NEW, eos_token_ids=eos)
    assert out == want[: j + 1]
    assert sum(a + 1 for a in accepts) == j
    if scripted:  # oracle rounds of 4 tokens, then the eos round cut after (j - 1) % 4 + 1 kept tokens
        assert accepts == [3] * ((j - 1) // 4) + [(j - 1) % 4]
        res = evaluate_acceptance(target, draft, [prompt], num_steps=3, max_new_tokens=MAX_NEW, eos_token_ids=eos)
        assert res.new_tokens == j + 1 and res.rounds == len(accepts)
        assert res.per_position_acceptance == [1.0, 1.0, 1.0]


def test_default_eos_is_the_targets(target, target_dir):
    """eos_token_ids=None reads the target's eos (<|im_end|>, id 1), kept as the last token; set() disables it.

    Sample chat prompts, which the tiny target answers with <|im_end|> after some tokens; and each
    such prompt extended by its answer up to the eos, which stops at once (on the prefill's token)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(target_dir)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    assert target.generation_config.eos_token_id == eos == 1
    draft = _random_draft(target)
    stops = []
    for text in (
        "Maria has 12 apples. She gives 5 to her brother and buys 8 more. How many apples does she have now?",
        "A rectangle is 9 cm long and 4 cm wide. What is its area?",
        "What is 2+2?",
    ):
        prompt = list(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, return_dict=True)[
                "input_ids"
            ]
        )
        free = greedy_generate(target, prompt, max_new_tokens=64, eos_token_ids=set())
        for p in [prompt, prompt + free[: free.index(eos)]] if eos in free else [prompt]:
            free = greedy_generate(target, p, max_new_tokens=64, eos_token_ids=set())
            default = greedy_generate(target, p, max_new_tokens=64)
            want = free[: free.index(eos) + 1] if eos in free else free
            assert default == want
            assert speculative_generate(target, draft, p, num_steps=2, max_new_tokens=64)[0] == want
            stops.append(len(want) if eos in free else None)
    assert 1 in stops and any(s and s > 1 for s in stops), stops


def test_edge_cases_and_result_dict(target, prompts, greedy):
    draft = _random_draft(target)
    assert speculative_generate(target, draft, prompts[0], num_steps=2, max_new_tokens=0) == ([], [])
    assert speculative_generate(target, draft, prompts[0], num_steps=2, max_new_tokens=1, eos_token_ids=set()) == (
        greedy[0][:1],
        [],
    )
    res = evaluate_acceptance(target, draft, prompts[:2], num_steps=2, max_new_tokens=1, eos_token_ids=set())
    assert isinstance(res, SpecEvalResult)
    assert res.rounds == 0 and res.acceptance_length == 0.0 and res.new_tokens == 2
    assert res.per_position_acceptance == [0.0, 0.0] and res.per_position_reached == [0, 0]
    d = json.loads(json.dumps(res.as_dict()))
    assert "outputs" not in d and d["num_steps"] == 2 and d["prompts"] == 2
    with pytest.raises(ValueError, match="empty"):
        speculative_generate(target, draft, [], num_steps=2, max_new_tokens=4)
    with pytest.raises(ValueError, match="num_steps"):
        evaluate_acceptance(target, draft, prompts[:1], num_steps=0)
