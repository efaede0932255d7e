"""One token from a sequence's logits: `sample`, greedy or temperature + top-k + top-p with its own generator.

The params are SGLang 0.5.23's (emulators/sglang_protocol/sampling.py: greedy below ``_SAMPLING_EPS``
or with top_k 1, top_k -1 = off); the sampling is plain torch, not SGLang's sampler, so a sampled
(non-greedy) token need not be the one SGLang would draw.
"""

from __future__ import annotations

import torch

from emulators.sglang_protocol.sampling import SamplingParams


def sample(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
    """Greedy, or temperature + top-k + top-p sampling with the request's own generator."""
    if p.greedy:
        return int(torch.argmax(logits))
    logits = logits / p.temperature
    if 0 < p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the tokens before it already cover top_p (the first always stays).
        drop = (torch.cumsum(probs, dim=-1) - probs) > p.top_p
        logits = logits.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    return int(torch.multinomial(probs, 1, generator=gen))
