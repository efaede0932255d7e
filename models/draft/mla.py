"""The MLA draft's attention and rope (`Eagle3Config.draft_arch: mla`): DeepSeek-V3's multi-head latent attention
over the draft layer's 2H-wide [embedding; hidden] input, as the engines serve a Kimi/DeepSeek EAGLE-3 draft.

Followed: vLLM 0.32 `model_executor/models/deepseek_eagle3.py` (`DeepseekV2Eagle3DecoderLayer`: the target's
`DeepseekV2MLAAttention` from model_executor/models/deepseek_v2.py with `input_size=2 * hidden_size`) and its rope,
`layers/rotary_embedding/deepseek_scaling_rope.py` (`DeepseekScalingRotaryEmbedding`, GPT-J style:
`is_neox_style=False`); SGLang 0.5.23 `srt/models/kimi_k25_eagle3.py` (`Eagle3MLADecoderLayer`: the same layer,
its fused q/kv down-projection widened to 2H). Everything outside the attention is the Llama-style draft's
(models/draft/layers.py): the same norms, residual, MLP, fc and head in both engines.

With x = cat(input_layernorm(embed), hidden_norm(h)) [2H], per head i (n = qk_nope_head_dim, r = qk_rope_head_dim):

    q      = q_b_proj(q_a_layernorm(q_a_proj(x)))   [heads, n + r]
    c, kr  = kv_a_proj_with_mqa(x)                  [kv_lora_rank], [r]   (kr: ONE rope key shared by every head)
    k_n, v = kv_b_proj(kv_a_layernorm(c))           [heads, n], [heads, v_head_dim]
    score  = (q_n . k_n + rope(q_r) . rope(kr)) * scale,   scale = (n + r)^-0.5 * mscale(factor, mscale_all_dim)^2
    out    = o_proj(softmax(score) v)               [H]

rope(x) at position p rotates the pairs (x[2j], x[2j+1]) by p * inv_freq[j] (GPT-J style, as DeepSeek's
`rope_interleave`) and multiplies by mscale(factor, mscale) / mscale(factor, mscale_all_dim); with YaRN, inv_freq
blends the extrapolated base^(-2j/r) and the interpolated base^(-2j/r) / factor over the ramp between the
correction dims of beta_fast and beta_slow at original_max_position_embeddings. Plain rope (no scaling) is inv_freq
= base^(-2j/r), no mscale.

The training-time test and the decoding cache are the Llama draft's (models/draft/caches.py): the rope part of a
step-k query and key sits at position + k like the whole head's does there; the caches scale scores by
(n + r)^-0.5, so the YaRN factor mscale^2 is folded into q.
"""

from __future__ import annotations

import torch
from torch import nn

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.draft.config import Eagle3Config
from models.draft.norm import RMSNorm
from models.draft.rope import deepseek_cos_sin_factor, deepseek_score_factor, inv_freq


class MLARotary(nn.Module):
    """The MLA draft's rope over the qk_rope_head_dim part: (cos, sin) [B, S, r/2], one angle per rotated pair,
    with YaRN's cos/sin factor (vLLM's `DeepseekScalingRotaryEmbedding._compute_cos_sin_cache`; models/draft/rope.py).
    """

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.dim = int(config.qk_rope_head_dim or 0)
        self.base = float(config.rope_theta)
        self.scaling = dict(config.rope_scaling) if config.rope_scaling else None
        self.mscale = deepseek_cos_sin_factor(self.scaling)

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        work = torch.float64 if dtype == torch.float64 else torch.float32
        angles = inv_freq(self.dim, self.base, self.scaling, work, position_ids.device)
        freqs = position_ids.to(work)[..., None] * angles  # [B, S, r/2]
        return (freqs.cos() * self.mscale).to(dtype), (freqs.sin() * self.mscale).to(dtype)


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, S, r] with pairs (2j, 2j+1) rotated by cos/sin [B, S, r/2] (vLLM's `rotate_gptj`)."""
    even, odd = x[..., 0::2], x[..., 1::2]
    c, s = cos[:, None], sin[:, None]
    return torch.stack((even * c - odd * s, odd * c + even * s), dim=-1).flatten(-2)


class MLAAttention(nn.Module):
    """Multi-head latent attention over the 2H-wide input, with the engines' weight names (module docstring)."""

    def __init__(self, config: Eagle3Config):
        super().__init__()
        width = 2 * config.hidden_size
        self.num_heads = config.num_attention_heads
        self.nope = int(config.qk_nope_head_dim or 0)
        self.rope = int(config.qk_rope_head_dim or 0)
        self.v_dim = int(config.v_head_dim or 0)
        self.kv_lora_rank = int(config.kv_lora_rank or 0)
        q_lora_rank = int(config.q_lora_rank or 0)  # Eagle3Config requires it for mla, as both engines do
        self.q_a_proj = nn.Linear(width, q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(q_lora_rank, config.rms_norm_eps)
        self.q_b_proj = nn.Linear(q_lora_rank, self.num_heads * (self.nope + self.rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(width, self.kv_lora_rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps)
        self.kv_b_proj = nn.Linear(self.kv_lora_rank, self.num_heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.v_dim, config.hidden_size, bias=False)
        self.score_factor = deepseek_score_factor(config.rope_scaling)  # vLLM: self.scaling * mscale * mscale

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache) -> torch.Tensor:
        b, s, _ = x.shape
        h = self.num_heads
        q = (
            self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(b, s, h, self.nope + self.rope).transpose(1, 2)
        )  # [B, h, S, n + r]
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(b, s, h, self.nope + self.v_dim).transpose(1, 2)
        k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)  # [B, h, S, n], [B, h, S, v]
        q_nope, q_rope = q.split([self.nope, self.rope], dim=-1)
        q_rope = apply_rope_interleaved(q_rope, cos, sin)
        k_rope = apply_rope_interleaved(k_rope[:, None], cos, sin).expand(b, h, s, self.rope)  # one key, every head
        q = torch.cat([q_nope, q_rope], dim=-1)
        if self.score_factor != 1.0:
            q = q * self.score_factor  # the caches scale by (n + r)^-0.5: YaRN's mscale^2 rides on q
        k = torch.cat([k_nope, k_rope], dim=-1)  # [B, h, S, n + r]
        out = cache.attend(q, k, v, 1)  # [B, h, S, v]
        return self.o_proj(out.transpose(1, 2).reshape(b, s, h * self.v_dim))
