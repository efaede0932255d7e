"""The `target:` section: the target model, one class for the run config and for every job that loads the target.

The job files a launched process reads carry it whole as their `target` (models/common/job_files.py), so a rank
reads `job.target.path` and `job.target.trust_remote_code`.
"""

from __future__ import annotations

from typing import Literal

from settings.base import Section


class Target(Section):
    """The target model whose responses and hidden states the draft learns from."""

    trust_remote_code: bool = False
    """Pass trust_remote_code=True to transformers (Kimi-K2.5's tokenizer needs it)."""
    path: str
    """Hugging Face repo id or local directory of the target: its tokenizer and chat template build the prompts; its
    weights are loaded by the capture stage."""
    build_tiny_target: bool = False
    """Build the deterministic tiny demo target at `path` if it is not there yet (demo and tests only)."""
    tiny_shape: Literal["llama", "kimi", "kimi-long"] = "llama"
    """The tiny target's shape, with build_tiny_target: `llama` (a tiny Llama), `kimi` (Kimi-K2.5's: a tiny
    DeepSeek-V3 with MLA, MoE and YaRN in the kimi_k25 checkpoint layout, models/target/tiny_kimi.py), or `kimi-long`
    (the kimi target trained further on a book, so that it answers at length: models/target/book.py)."""
    tiny_quantize: Literal["int4"] | None = None
    """With build_tiny_target and a kimi shape: `int4` writes the target as Kimi-K2.5 is published, its routed experts
    INT4 (compressed-tensors pack-quantized, group size 32: models/target/int4.py), the rest as built."""
