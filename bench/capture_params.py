"""The capture bench's parameters: every knob of one run (printed and saved with the figures) and the quick preset."""

from __future__ import annotations

from dataclasses import dataclass

from bench import harness
from settings.capture import CaptureSettings

DATASET = "bench"
RUN_CONFIG = CaptureSettings()  # the run config's capture section as declared: its defaults


@dataclass
class Params(harness.TargetParams):
    """Every knob of one bench run (printed and saved with the figures)."""

    # target: the tiny target's shape (harness.TargetParams), made wider so the forward has work to do
    hidden_size: int = 256
    intermediate_size: int = 704  # 2.75 x hidden, as the default tiny target
    quick: bool = False
    dtype: str = "float32"  # the capture dtype (the tiny target is saved in fp32)
    # records
    records: int = 200
    mean_len: float = 256.0
    sigma: float = 0.9
    min_len: int = 16
    max_len: int = 3072
    records_per_part: int = 64
    # the capture job: the run config's max_batch_tokens and shard_tokens (several shards per rank)
    max_batch_tokens: int = RUN_CONFIG.max_batch_tokens
    shard_tokens: int = RUN_CONFIG.shard_tokens
    threads: int = 1  # OMP_NUM_THREADS per rank: what rank_command gives CPU ranks
    ranks: int = 2  # for (b) and (c)
    repeats: int = 1  # passes over the whole sequence (odd passes in reverse order); ratios: median over passes
    timeout_s: float = 900.0  # per launch or baseline

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, records=48, mean_len=128.0, max_len=1024, records_per_part=16, shard_tokens=2048)
