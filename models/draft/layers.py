"""The draft's building blocks: Llama's RoPE, attention, MLP and the `midlayer` decoder layer (its attention Llama's
or, with `draft_arch: mla`, DeepSeek's: models/draft/mla.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.draft.config import ACTIVATIONS, Eagle3Config, resolved_size
from models.draft.mla import MLAAttention
from models.draft.norm import RMSNorm
from models.draft.rope import inv_freq, llama_cos_sin_factor


class RotaryEmbedding(nn.Module):
    """Llama RoPE: dims i and i + head_dim/2 rotate together by pos * inv_freq[i], inv_freq = theta^(-2i/head_dim), or
    YaRN's frequencies and cos/sin factor with `rope_scaling` (as Llama attention serves it: models/draft/rope.py).

    The frequencies are recomputed per call (head_dim/2 numbers), not kept in a buffer that
    `model.to(torch.bfloat16)` would round; angles are fp32 like HF's, fp64 for an fp64 model.
    """

    def __init__(self, head_dim: int, theta: float, rope_scaling: dict[str, Any] | None = None):
        super().__init__()
        self.head_dim = head_dim
        self.theta = float(theta)
        self.scaling = dict(rope_scaling) if rope_scaling else None
        self.mscale = llama_cos_sin_factor(self.scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        angles = inv_freq(self.head_dim, self.theta, self.scaling, work, position_ids.device)  # [hd/2]
        freqs = position_ids.to(work)[..., None] * angles  # [B, S, hd/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # [B, S, hd]
        return (emb.cos() * self.mscale).to(dtype), (emb.sin() * self.mscale).to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, hd] rotated by cos/sin [B, S, hd]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos[:, None] + rotated * sin[:, None]


class Eagle3Attention(nn.Module):
    """Llama attention over the 2H-wide [embedding; hidden] input; the cache decides who sees whom."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = resolved_size(config.head_dim, "head_dim")
        width = 2 * config.hidden_size
        self.q_proj = nn.Linear(width, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(width, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q_proj(x).view(b, s, self.num_heads, self.head_dim).transpose(1, 2)  # [B, h, S, hd]
        k = self.k_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, S, hd]
        v = self.v_proj(x).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)  # [B, kv, S, hd]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = cache.attend(q, k, v, self.num_heads // self.num_kv_heads)  # [B, h, S, hd]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, self.num_heads * self.head_dim))


class Eagle3MLP(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class Eagle3DecoderLayer(nn.Module):
    """`midlayer`: a Llama layer whose attention reads cat(input_layernorm(embeds), hidden_norm(hidden))."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.self_attn = MLAAttention(config) if config.draft_arch == "mla" else Eagle3Attention(config)
        self.mlp = Eagle3MLP(config)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.norm_before_residual = config.norm_before_residual

    def forward(
        self, embeds: torch.Tensor, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache
    ) -> torch.Tensor:
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden  # [B, S, H]
        x = torch.cat([self.input_layernorm(embeds), normed], -1)  # [B, S, 2H]
        hidden = residual + self.self_attn(x, cos, sin, cache)  # [B, S, H]
        return hidden + self.mlp(self.post_attention_layernorm(hidden))  # [B, S, H]
