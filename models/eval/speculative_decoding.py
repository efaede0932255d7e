"""Chain (top-1) speculative decoding with a Hugging Face target and an `Eagle3Draft`, greedy.

Measures the acceptance length the way SGLang reports it for
`--speculative-eagle-topk 1 --speculative-num-steps K --speculative-num-draft-tokens K+1`:
the mean, over verify rounds (target forwards after the prefill), of the tokens a round adds
(accepted draft tokens + the target's own bonus token).

One prompt, batch size 1, positions 0-based, prompt t[0..n-1], K = num_steps:

    prefill   target(t[0..n-1]) -> aux features [1, n, 3H] (hidden_states[k+1] for each 0-based
              aux layer k, as models/capture/job.py stores them) and the first token t[n] = argmax.
    extend    draft(input_ids=t[1..n], hidden=aux[0..n-1]) on the draft's KVCache: TTT step 0
              over the new positions (each fed the token that FOLLOWS it); the logits at the
              last position give d1 (draft index -> target id through `draft.draft_to_target`).
    chain     draft(input_ids=[[d_{i-1}]], hidden=<previous step's hidden at its last position>)
              at the next position, i = 2..K -> d_i (TTT step i-1).
    verify    target([t[n], d1..dK]) on the target's cache -> argmax g_0..g_K at those K+1
              positions; d_i is accepted while d_i == g_{i-1} (all earlier accepted); with a
              accepted, the round adds d1..da and the bonus g_a (a + 1 tokens).
    rollback  the target cache is cropped to the verified prefix (through the position of d_a),
              the draft cache back to its extend part (the chain keys are dropped); the next
              extend runs over the a + 1 newly verified positions with the target's aux
              features from the verify forward and the tokens following them (d1..da, g_a),
              like SGLang's draft-extend after verify. Then the chain again.

Stopping: generation ends after max_new_tokens tokens or at the first eos token (kept). The
first token comes from the prefill and belongs to no round. A round that crosses the end keeps
only its first `kept` tokens (kept <= a + 1), and the round is COUNTED WITH WHAT WAS KEPT:
its accepted count is kept - 1 (so it adds kept to the acceptance length, and the sum over a
prompt's rounds of (accepted + 1) is exactly len(output) - 1, as SGLang's completion tokens per
verify). For per-position acceptance a cut round counts draft positions 1..kept as reached and
accepted (those draft tokens were verified and kept) and nothing after them: the round was cut,
not rejected. Uncut rounds count positions 1..min(a+1, K) as reached and 1..a as accepted.

Torch and transformers only: the target is any causal LM that takes a cache (`cache=` in
transformers >= 5.2x, `past_key_values=` before) and returns `logits` and `hidden_states` (a
`DynamicCache` is made here). eos_token_ids=None means the target's generation_config (or
config) eos id(s); an empty set disables eos. acceptance_length is 0.0 when no round ran.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import torch

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.draft.caches import KVCache
from models.draft.eagle3 import Eagle3Draft
from models.eval.context import bucket_of


@dataclass
class SpecEvalResult:
    """Acceptance statistics of a speculative run over several prompts (see the module docstring)."""

    acceptance_length: float  # mean over verify rounds of (accepted draft tokens + 1); 0.0 if no round ran
    per_position_acceptance: list[float]  # [K] of rounds that reached draft position i, share accepted at i
    per_position_reached: list[int]  # [K]
    per_position_accepted: list[int]  # [K]
    rounds: int  # verify rounds (target forwards after the prefill)
    new_tokens: int  # tokens generated over all prompts (prefill tokens included)
    prompts: int
    num_steps: int  # K
    outputs: list[list[int]]  # generated ids per prompt (excluding the prompt)
    context_edges: list[int]  # the context buckets' edges (models/eval/context.py)
    context_rounds: list[int]  # [len(context_edges) + 1] rounds that started in each bucket
    context_tokens: list[int]  # [len(context_edges) + 1] tokens those rounds added (kept)
    round_tokens: list[int] = field(default_factory=list)  # the tokens each round added (kept), in decode order

    def as_dict(self) -> dict:
        """JSON-able summary, without the outputs and the rounds one by one."""
        out = asdict(self)
        out.pop("outputs")
        out.pop("round_tokens")
        return out


@dataclass
class _Round:
    """One verify round: what a test or a report needs to know about it."""

    drafted: list[int]  # [K] proposed target ids d1..dK
    verified: list[int]  # [K+1] target argmax at [t_last, d1..dK]
    accepted: int  # a: draft tokens accepted by the target (before any cut)
    kept: int  # tokens of this round kept in the output (a + 1 unless the end cut it)
    start: int  # tokens before d1: the prompt's and those generated before the round (its context position)


# ----------------------------------------------------------------------------- helpers


def _device(module: torch.nn.Module) -> torch.device:
    return next(module.parameters()).device


def _eos_set(target, eos_token_ids: set[int] | None) -> set[int]:
    """The explicit set, or the target's generation_config / config eos id(s); an empty set disables eos."""
    if eos_token_ids is not None:
        return {int(i) for i in eos_token_ids}
    for cfg in (getattr(target, "generation_config", None), getattr(target, "config", None)):
        eos = getattr(cfg, "eos_token_id", None) if cfg is not None else None
        if eos is not None:
            return {int(eos)} if isinstance(eos, int) else {int(i) for i in eos}
    return set()


def _new_cache(target):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=target.config)
    except TypeError:  # transformers 4.x without the config argument
        return DynamicCache()


def _forward(target, input_ids: torch.Tensor, cache, hidden_states: bool = False):
    """target(input_ids) appending to `cache`; transformers >= 5.2x names the argument `cache`
    (`past_key_values` is deprecated there), older versions `past_key_values`."""
    name = "cache" if "cache" in inspect.signature(target.forward).parameters else "past_key_values"
    extra = {"output_hidden_states": True} if hidden_states else {}
    return target(input_ids=input_ids, use_cache=True, **{name: cache}, **extra)


def _crop_target_cache(cache, length: int) -> None:
    """Keep the first `length` positions. crop(-n) removes n tokens in transformers 4.x and 5.x alike
    (5.x rejects a positive absolute length; 4.x reads a negative one as tokens to remove)."""
    remove = cache.get_seq_length() - length
    if remove < 0:
        raise ValueError(f"cannot crop a cache of {cache.get_seq_length()} positions to {length}")
    if remove:
        cache.crop(-remove)


def _cut(tokens: list[int], room: int, eos: set[int]) -> tuple[list[int], bool]:
    """tokens truncated to `room` and after the first eos (inclusive); whether generation ends."""
    kept = tokens[:room]
    for i, tok in enumerate(kept):
        if tok in eos:
            return kept[: i + 1], True
    return kept, len(kept) >= room


def _check_prompt(prompt_ids, num_steps: int | None = None) -> list[int]:
    ids = [int(i) for i in prompt_ids]
    if not ids:
        raise ValueError("prompt_ids is empty: the target needs at least one token to predict from")
    if num_steps is not None and num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    return ids


# ----------------------------------------------------------------------------- decoding


@torch.no_grad()
def greedy_generate(target, prompt_ids, *, max_new_tokens, eos_token_ids=None) -> list[int]:
    """Plain greedy decoding with the target alone (the reference the speculative output must equal).

    One token per target forward on a DynamicCache; stops after max_new_tokens tokens or at the
    first eos (kept). eos_token_ids None: the target's generation_config/config eos; set(): none.
    """
    ids = _check_prompt(prompt_ids)
    eos = _eos_set(target, eos_token_ids)
    out: list[int] = []
    if max_new_tokens <= 0:
        return out
    dev = _device(target)
    cache = _new_cache(target)
    step_in = torch.tensor([ids], device=dev)
    while True:
        logits = _forward(target, step_in, cache).logits
        tok = int(logits[0, -1].argmax(-1))
        out.append(tok)
        if tok in eos or len(out) >= max_new_tokens:
            return out
        step_in = torch.tensor([[tok]], device=dev)


def _aux(hidden_states, aux_layers: list[int], upto: int | None = None) -> torch.Tensor:
    """cat(hidden_states[k+1] for k in aux_layers) -> [1, S, 3H] (first `upto` positions)."""
    parts = [hidden_states[k + 1] if upto is None else hidden_states[k + 1][:, :upto] for k in aux_layers]
    return torch.cat(parts, dim=-1)


def _draft_chain(
    draft: Eagle3Draft, cache: KVCache, next_ids: torch.Tensor, aux: torch.Tensor, num_steps: int
) -> torch.Tensor:
    """Extend the draft cache over the new verified positions, then chain: K proposed target ids [1, K].

    Leaves the draft cache at its extend part (the chain's keys are cropped away again).
    """
    step = draft(input_ids=next_ids, hidden=aux, cache=cache)  # TTT step 0 over the new positions
    extend_len = len(cache)
    tok = draft.draft_to_target(step.logits[:, -1:].argmax(-1))  # [1, 1]
    proposals = [tok]
    hidden = step.hidden[:, -1:]
    for _ in range(1, num_steps):
        step = draft(input_ids=tok, hidden=hidden, cache=cache)  # one position further
        tok = draft.draft_to_target(step.logits[:, -1:].argmax(-1))
        proposals.append(tok)
        hidden = step.hidden[:, -1:]
    cache.crop(extend_len)
    return torch.cat(proposals, dim=1)  # [1, K]


@torch.no_grad()
def speculative_decode(
    target,
    draft: Eagle3Draft,
    prompt_ids,
    *,
    num_steps: int,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    aux_layers: list[int] | None = None,
) -> tuple[list[int], list[_Round]]:
    """speculative_generate with the full record of every round."""
    ids = _check_prompt(prompt_ids, num_steps)
    eos = _eos_set(target, eos_token_ids)
    aux_layers = list(draft.config.aux_layers if aux_layers is None else aux_layers)
    out: list[int] = []
    rounds: list[_Round] = []
    if max_new_tokens <= 0:
        return out, rounds
    dev = _device(target)
    if _device(draft) != dev:
        raise ValueError(f"draft is on {_device(draft)}, target on {dev}: put them on the same device")

    tcache = _new_cache(target)
    res = _forward(target, torch.tensor([ids], device=dev), tcache, hidden_states=True)
    last = int(res.logits[0, -1].argmax(-1))
    out.append(last)
    if last in eos or len(out) >= max_new_tokens:
        return out, rounds
    aux = _aux(res.hidden_states, aux_layers)  # [1, n, 3H]
    next_ids = torch.tensor([ids[1:] + [last]], device=dev)  # token following each position
    dcache = KVCache()

    while True:
        proposals = _draft_chain(draft, dcache, next_ids, aux, num_steps)  # [1, K]
        prefix = tcache.get_seq_length()  # verified positions in the cache
        verify_in = torch.cat([torch.tensor([[last]], device=dev), proposals], dim=1)  # [1, K+1]
        res = _forward(target, verify_in, tcache, hidden_states=True)
        greedy = res.logits[0].argmax(-1).tolist()  # [K+1]
        drafted = proposals[0].tolist()
        a = 0
        while a < num_steps and drafted[a] == greedy[a]:
            a += 1
        gained = drafted[:a] + [greedy[a]]
        kept, done = _cut(gained, max_new_tokens - len(out), eos)
        start = len(ids) + len(out)
        out.extend(kept)
        rounds.append(_Round(drafted=drafted, verified=greedy, accepted=a, kept=len(kept), start=start))
        if done:
            return out, rounds
        # Verified now: positions prefix .. prefix + a (tokens last, d1..da); the bonus is not yet in.
        _crop_target_cache(tcache, prefix + a + 1)
        aux = _aux(res.hidden_states, aux_layers, upto=a + 1)  # [1, a+1, 3H]
        next_ids = torch.tensor([gained], device=dev)  # d1..da, bonus
        last = gained[-1]


def speculative_generate(
    target,
    draft,
    prompt_ids: list[int],
    *,
    num_steps: int,
    max_new_tokens: int,
    eos_token_ids: set[int] | None = None,
    aux_layers: list[int] | None = None,
) -> tuple[list[int], list[int]]:
    """Greedy decoding, the draft proposing num_steps tokens per round; returns (output ids, accepted count per round).

    The output equals `greedy_generate`'s. The accepted count of a round cut by eos or
    max_new_tokens is what was kept minus one (module docstring), so sum(a + 1) == len(output) - 1.
    aux_layers default: draft.config.aux_layers. eos_token_ids None: the target's eos; set(): none.
    """
    out, rounds = speculative_decode(
        target,
        draft,
        prompt_ids,
        num_steps=num_steps,
        max_new_tokens=max_new_tokens,
        eos_token_ids=eos_token_ids,
        aux_layers=aux_layers,
    )
    return out, [r.kept - 1 for r in rounds]


def evaluate_acceptance(
    target,
    draft,
    prompts: list[list[int]],
    *,
    num_steps: int = 3,
    max_new_tokens: int = 64,
    eos_token_ids: set[int] | None = None,
    context_edges: Sequence[int] = (),
) -> SpecEvalResult:
    """Speculative greedy decoding of every prompt; acceptance length and per-position acceptance over all rounds,
    and the rounds and their tokens by context position (`context_edges`: the buckets' ascending edges; none: one
    bucket)."""
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    edges = list(context_edges)
    if any(b <= a for a, b in zip(edges, edges[1:])) or any(e < 1 for e in edges):
        raise ValueError(f"context_edges must be ascending positive positions, got {edges}")
    reached, accepted = [0] * num_steps, [0] * num_steps
    in_bucket, tokens_in_bucket = [0] * (len(edges) + 1), [0] * (len(edges) + 1)
    outputs: list[list[int]] = []
    lengths: list[int] = []
    for prompt in prompts:
        out, rounds = speculative_decode(
            target, draft, prompt, num_steps=num_steps, max_new_tokens=max_new_tokens, eos_token_ids=eos_token_ids
        )
        outputs.append(out)
        for r in rounds:
            lengths.append(r.kept)
            bucket = bucket_of(r.start, edges)
            in_bucket[bucket] += 1
            tokens_in_bucket[bucket] += r.kept
            if r.kept <= r.accepted:  # cut inside the accepted drafts: d1..d_kept verified and kept
                n_reached = n_accepted = r.kept
            else:
                n_reached, n_accepted = min(r.accepted + 1, num_steps), r.accepted
            for i in range(n_reached):
                reached[i] += 1
            for i in range(n_accepted):
                accepted[i] += 1
    return SpecEvalResult(
        acceptance_length=sum(lengths) / len(lengths) if lengths else 0.0,
        per_position_acceptance=[acc / max(rch, 1) for acc, rch in zip(accepted, reached)],
        per_position_reached=reached,
        per_position_accepted=accepted,
        rounds=len(lengths),
        new_tokens=sum(len(o) for o in outputs),
        prompts=len(prompts),
        num_steps=num_steps,
        outputs=outputs,
        context_edges=edges,
        context_rounds=in_bucket,
        context_tokens=tokens_in_bucket,
        round_tokens=lengths,
    )
