"""The draft's attention caches: `TTTCache` (training-time test, one key/value block per unrolled step) and
`KVCache` (decoding), with the pieces they and models/draft/eagle3.py share (`repeat_kv`, `at_least_fp32`)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """x in fp32, or as is when already wider (fp64 in the reference tests)."""
    return x if x.dtype == torch.float64 else x.float()


def repeat_kv(x: torch.Tensor, groups: int) -> torch.Tensor:
    """[B, kv_heads, S, hd] -> [B, kv_heads * groups, S, hd]; query head h uses kv head h // groups."""
    if groups == 1:
        return x
    b, kv, s, d = x.shape
    return x[:, :, None].expand(b, kv, groups, s, d).reshape(b, kv * groups, s, d)


def masked_softmax_attention(scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """Softmax in (at least) fp32 over the last axis of `scores`, only where `allowed` (every row allows >= 1)."""
    return torch.softmax(at_least_fp32(scores).masked_fill(~allowed, float("-inf")), dim=-1)


class TTTCache:
    """Training-time-test attention: causal over step-0 keys, plus the diagonal of every later step.

    `attend` is called once per TTT step with that step's q/k/v over all T positions. Query (k, t)
    sees step-0 keys t' <= t whose token is not padding (its own t' = t always, so no row is
    empty) and the keys of steps 1..k at the same position t.

    impl="sdpa" puts every step's keys side by side ([T * (k+1)] keys) behind one boolean mask and
    calls F.scaled_dot_product_attention (memory-efficient kernels on GPU, no stored [T, T]
    probabilities); impl="eager" spells the same thing out with explicit scores (fp32 softmax).
    """

    def __init__(self, key_padding: torch.Tensor, impl: str = "sdpa"):
        if impl not in ("sdpa", "eager"):
            raise ValueError(f"impl must be 'sdpa' or 'eager', got {impl!r}")
        b, t = key_padding.shape
        idx = torch.arange(t, device=key_padding.device)
        causal = idx[None, :] <= idx[:, None]  # [T, T] key t' <= query t
        same = idx[None, :] == idx[:, None]  # [T, T] key t' == query t
        real_key = key_padding.bool()[:, None, None, :]  # [B, 1, 1, T]
        # A query's own step-0 key is always allowed, so a padded query's row is never empty (no NaN).
        self.step0_allowed = (causal & real_key) | same  # [B, 1, T, T]
        self.same_position = same.expand(b, 1, t, t)  # [B, 1, T, T] what a later step's keys allow
        self.keys: list[torch.Tensor] = []  # per step [B, kv, T, hd], RoPE at pos + step
        self.values: list[torch.Tensor] = []
        self.impl = impl

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
        self.keys.append(k)
        self.values.append(v)
        if self.impl == "sdpa":
            keys = repeat_kv(torch.cat(self.keys, dim=2), groups)  # [B, h, T*(k+1), hd]
            values = repeat_kv(torch.cat(self.values, dim=2), groups)
            allowed = torch.cat([self.step0_allowed] + [self.same_position] * (len(self.keys) - 1), dim=-1)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=allowed)  # [B, h, T, hd]

        scale = 1.0 / math.sqrt(q.shape[-1])
        k0, v0 = repeat_kv(self.keys[0], groups), repeat_kv(self.values[0], groups)  # [B, h, T, hd]
        later_k = [repeat_kv(ki, groups) for ki in self.keys[1:]]
        later_v = [repeat_kv(vi, groups) for vi in self.values[1:]]
        scores = [q @ k0.transpose(-1, -2) * scale]  # [B, h, T, T]
        scores += [(q * ki).sum(-1, keepdim=True) * scale for ki in later_k]  # k x [B, h, T, 1]
        diagonal = torch.ones_like(self.step0_allowed[..., :1]).expand(-1, -1, -1, len(later_k))
        allowed = torch.cat([self.step0_allowed, diagonal], dim=-1)  # [B, 1, T, T+k]
        weights = masked_softmax_attention(torch.cat(scores, dim=-1), allowed).to(q.dtype)  # [B, h, T, T+k]
        t = q.shape[2]
        out = weights[..., :t] @ v0  # [B, h, T, hd]
        for i, vi in enumerate(later_v):
            out = out + weights[..., t + i, None] * vi  # diagonal terms
        return out


class KVCache:
    """Inference cache: every key the draft has processed, in order; new tokens see all of it plus
    themselves causally. After verification, `crop(n)` drops the rejected draft positions."""

    def __init__(self) -> None:
        self.k: torch.Tensor | None = None  # [B, kv, L, hd]
        self.v: torch.Tensor | None = None

    def __len__(self) -> int:
        return 0 if self.k is None else self.k.shape[2]

    def crop(self, length: int) -> None:
        if self.k is not None and self.v is not None:  # set together by attend
            self.k, self.v = self.k[:, :, :length], self.v[:, :, :length]

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
        past, s = len(self), q.shape[2]
        self.k = k if self.k is None else torch.cat([self.k, k], dim=2)
        self.v = v if self.v is None else torch.cat([self.v, v], dim=2)
        keys, values = repeat_kv(self.k, groups), repeat_kv(self.v, groups)  # [B, h, L, hd]
        idx = torch.arange(past + s, device=q.device)
        allowed = idx[None, :] <= idx[past:, None]  # [S, L]
        scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])  # [B, h, S, L]
        return masked_softmax_attention(scores, allowed).to(q.dtype) @ values
