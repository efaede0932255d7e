"""The draft's RMSNorm (Llama's; DeepSeek's is the same), used by every draft layer and the MLA attention."""

from __future__ import annotations

import torch
from torch import nn

from models.draft.caches import at_least_fp32


class RMSNorm(nn.Module):
    """Llama RMSNorm: normalized in fp32 (fp64 stays fp64), scaled in the input dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        wide = at_least_fp32(x)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * wide.to(x.dtype)
