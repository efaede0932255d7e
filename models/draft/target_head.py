"""The target side of the training loss: the target's frozen lm_head over stored final hidden states, reduced to what
the training-time test needs (the draft-vocab logits and the full-vocab argmax)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.draft.vocab import draft_to_target_ids


@dataclass
class TargetLogits:
    """What the loss needs from the target at every position j (z[j] predicts token j+1)."""

    logits: torch.Tensor  # [B, T, D] target logits at the draft-vocab ids (fp32, or fp64)
    in_draft: torch.Tensor  # [B, T] bool: the full-vocab argmax is a draft-vocab token
    argmax: torch.Tensor  # [B, T] int64: the full-vocab argmax (target id)


class TargetHead(nn.Module):
    """The target's frozen lm_head applied to stored final hidden states (nobody stores logits).

    Full logits are [T, V] (Kimi: 163840 wide) only to find the argmax, so the vocab is walked
    in chunks of `chunk_size` rows keeping a running max: peak memory is [N, chunk_size], not
    [N, V]. The draft-vocab columns of each chunk are kept on the way; since draft ids are
    sorted they fill a contiguous slice of the [N, D] output. Ties resolve to the lowest id,
    like torch.argmax over the full row.
    """

    # buffers (register_buffer below), typed here: nn.Module's __getattr__ is typed Tensor | Module
    weight: torch.Tensor
    draft_ids: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, lm_head_weight: torch.Tensor, d2t: torch.Tensor, chunk_size: int = 16384):
        super().__init__()
        self.register_buffer("weight", lm_head_weight.detach(), persistent=False)  # [V, H]
        draft_ids = draft_to_target_ids(d2t).to(lm_head_weight.device)
        t2d = torch.zeros(lm_head_weight.shape[0], dtype=torch.bool, device=lm_head_weight.device)
        t2d[draft_ids] = True
        self.register_buffer("draft_ids", draft_ids, persistent=False)  # [D]
        self.register_buffer("t2d", t2d, persistent=False)  # [V]
        self.chunk_size = int(chunk_size)

    @torch.no_grad()
    def forward(self, last_hidden: torch.Tensor) -> TargetLogits:
        *lead, h = last_hidden.shape
        x = last_hidden.reshape(-1, h).to(self.weight.dtype)  # [N, H]
        n, vocab = x.shape[0], self.weight.shape[0]
        work = torch.promote_types(x.dtype, torch.float32)
        best = torch.full((n,), float("-inf"), device=x.device, dtype=work)  # running max
        best_id = torch.zeros(n, dtype=torch.int64, device=x.device)
        draft_logits = torch.empty(n, self.draft_ids.shape[0], device=x.device, dtype=work)  # [N, D]
        for c0 in range(0, vocab, self.chunk_size):
            c1 = min(vocab, c0 + self.chunk_size)
            logits = (x @ self.weight[c0:c1].T).to(work)  # [N, c]
            idx = logits.argmax(-1)
            top = logits.gather(-1, idx[:, None])[:, 0]
            better = top > best  # strict: on a tie the earlier (lower-id) chunk keeps it
            best = torch.where(better, top, best)
            best_id = torch.where(better, idx + c0, best_id)
            d0, d1 = torch.searchsorted(self.draft_ids, torch.tensor([c0, c1], device=x.device)).tolist()
            draft_logits[:, d0:d1] = logits[:, self.draft_ids[d0:d1] - c0]
        return TargetLogits(
            logits=draft_logits.view(*lead, -1), in_draft=self.t2d[best_id].view(*lead), argmax=best_id.view(*lead)
        )
