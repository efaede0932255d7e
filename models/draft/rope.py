"""The draft's rope frequencies: plain, or YaRN as the serving engines compute it for each draft shape.

Both shapes share YaRN's frequencies (vLLM 0.32 layers/rotary_embedding/common.py `yarn_find_correction_range`,
`yarn_linear_ramp_mask`; the same in SGLang 0.5.23 srt/layers/rotary_embedding/yarn.py): pair j of a rotary width d
turns by base^(-2j/d) where it extrapolates and by base^(-2j/d) / factor where it interpolates, blended over the
ramp between the correction dims of beta_fast and beta_slow at original_max_position_embeddings. They differ in
what multiplies cos/sin and the attention score:

- the MLA draft, as the DeepSeek attention serves it (vLLM's deepseek_scaling_rope.py
  `DeepseekScalingRotaryEmbedding`, deepseek_v2.py `DeepseekV2MLAAttention`): cos/sin times
  mscale(factor, mscale) / mscale(factor, mscale_all_dim) (defaults 1 and 0), the score times
  mscale(factor, mscale_all_dim)^2;
- the Llama-style draft, as Llama attention serves it (vLLM's yarn_scaling_rope.py `YaRNScalingRotaryEmbedding`,
  SGLang's yarn.py): cos/sin times the mscale ratio when the config gives both mscale and mscale_all_dim, else
  mscale(factor) = 0.1 ln(factor) + 1; the score is not scaled. For Kimi (mscale = mscale_all_dim = 1) both give 1.

Where the two engines read a key differently (vLLM tests mscale and mscale_all_dim for truth, SGLang for None;
vLLM reads `attention_factor`, SGLang `attn_factor`; `truncate`), such a rope_scaling is refused rather than guessed.
"""

from __future__ import annotations

import math
from typing import Any

import torch

YARN_DEFAULTS = {"beta_fast": 32.0, "beta_slow": 1.0}  # both engines' YaRN classes
SUPPORTED = ("default", "yarn")


def rope_type(rope_scaling: dict[str, Any] | None) -> str:
    """`yarn` or `default` (no scaling): the rope_scaling dict's `rope_type`, or its older `type` key."""
    scaling = rope_scaling or {}
    return str(scaling.get("rope_type") or scaling.get("type") or "default")


def rope_scaling_problems(rope_scaling: dict[str, Any] | None) -> list[str]:
    """Why a draft cannot train this rope_scaling exactly as both engines serve it; [] when it can."""
    kind = rope_type(rope_scaling)
    if kind not in SUPPORTED:
        return [f"rope_scaling type {kind!r} is not supported (default or yarn)"]
    if kind == "default":
        return []
    y = dict(rope_scaling or {})
    p = [f"rope_scaling (yarn) lacks {k}" for k in ("factor", "original_max_position_embeddings") if k not in y]
    for key in ("attention_factor", "attn_factor"):
        if key in y and float(y[key]) != 1.0:
            p.append(f"rope_scaling {key} {y[key]}: vLLM 0.32 and SGLang 0.5.23 do not read the same key")
    if y.get("truncate", True) is not True:
        p.append("rope_scaling truncate false: the DeepSeek rope of both engines always truncates")
    given = [k for k in ("mscale", "mscale_all_dim") if k in y]
    if len(given) == 1 or (len(given) == 2 and not (y["mscale"] and y["mscale_all_dim"])):
        p.append(
            "rope_scaling mscale / mscale_all_dim: give both, non-zero (vLLM tests them for truth, SGLang for "
            f"presence: the engines would scale cos/sin differently), got { ({k: y[k] for k in given}) }"
        )
    return p


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """vLLM 0.32 layers/rotary_embedding/common.py `yarn_get_mscale`."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn_correction_range(beta_fast: float, beta_slow: float, dim: int, base: float, original: int) -> tuple[int, int]:
    """vLLM's `yarn_find_correction_range` (truncated): the rotary dims between the two rotation counts."""

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = math.floor(correction_dim(beta_fast)), math.ceil(correction_dim(beta_slow))
    return max(low, 0), min(high, dim - 1)


def inv_freq(
    dim: int, base: float, rope_scaling: dict[str, Any] | None, work: torch.dtype, device: torch.device
) -> torch.Tensor:
    """[dim/2] the angle per position of each rotated pair (fp32 as the engines compute it; fp64 for fp64)."""
    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=work, device=device) / dim)
    if rope_type(rope_scaling) != "yarn":
        return 1.0 / pos_freqs
    y = {**YARN_DEFAULTS, **(rope_scaling or {})}
    factor = float(y["factor"])
    low, high = yarn_correction_range(
        float(y["beta_fast"]), float(y["beta_slow"]), dim, base, int(y["original_max_position_embeddings"])
    )
    span = (high - low) or 0.001  # yarn_linear_ramp_mask: high += 0.001 when they meet
    ramp = ((torch.arange(dim // 2, dtype=work, device=device) - low) / span).clamp(0, 1)
    extrapolate = 1 - ramp  # 1: the pair keeps base^(-2j/d); 0: interpolated by the factor
    return (1.0 / (factor * pos_freqs)) * (1 - extrapolate) + (1.0 / pos_freqs) * extrapolate


def deepseek_cos_sin_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What multiplies cos/sin of the MLA draft's rope (`DeepseekScalingRotaryEmbedding.mscale`)."""
    if rope_type(rope_scaling) != "yarn":
        return 1.0
    y = dict(rope_scaling or {})
    factor = float(y["factor"])
    return yarn_get_mscale(factor, float(y.get("mscale", 1.0))) / yarn_get_mscale(
        factor, float(y.get("mscale_all_dim", 0.0))
    )


def deepseek_score_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What multiplies the MLA score's (n + r)^-0.5: mscale(factor, mscale_all_dim)^2 under YaRN, else 1."""
    if rope_type(rope_scaling) != "yarn":
        return 1.0
    y = dict(rope_scaling or {})
    mscale = yarn_get_mscale(float(y["factor"]), float(y.get("mscale_all_dim", 0.0)))
    return mscale * mscale


def llama_cos_sin_factor(rope_scaling: dict[str, Any] | None) -> float:
    """What multiplies cos/sin of the Llama-style draft's rope (`YaRNScalingRotaryEmbedding.mscale`)."""
    if rope_type(rope_scaling) != "yarn":
        return 1.0
    y = dict(rope_scaling or {})
    factor = float(y["factor"])
    if y.get("mscale") and y.get("mscale_all_dim"):
        return yarn_get_mscale(factor, float(y["mscale"])) / yarn_get_mscale(factor, float(y["mscale_all_dim"]))
    return yarn_get_mscale(factor)
