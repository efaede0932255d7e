"""The generate bench's parameters: every knob of one run (printed and saved with the figures), the quick preset, and
what follows from them (slots, capacity, token budget, the simulated server's config, the sampling params)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from emulators.sim import SimConfig

EOS = 1


@dataclass
class Params:
    """Every knob of one bench run (printed and saved with the figures)."""

    quick: bool = False
    seed: int = 0
    # simulated server
    max_running: int = 16
    decode_ms: float = 2.0
    mean_len: float = 200.0
    sigma: float = 1.0
    max_new_tokens: int = 1200  # 6x the mean, as the real config (8192) is ~6x its mean response
    prompt_mean_len: float = 200.0
    # throughput
    prompts: int = 2400  # (a); 150 per slot keeps the end-of-run drain of the long tail small
    slots_factor: float = 2.0  # (a): slots = factor x max_running
    barrier_batches: int = 15  # (b): this many batches of max_running, a prefix of the prompts
    sequential_prompts: int = 30  # (c)
    # budget
    budget_rounds: float = 40.0  # budget = rounds x mean_len x max_running
    budget_trials: int = 3  # the waste hangs on the few long requests running at the end: repeat
    # checkpoints
    resume_rows: int = 100_000
    stats_datasets: int = 10
    stats_rows_per_dataset: int = 10_000
    ckpt_mean_len: float = (
        1400.0  # completion tokens per checkpointed response (mean, lognormal): the seed run's B1 mean
    )
    ckpt_prompt_len: float = 64.0
    ckpt_max_ratio: float = 6.0  # completion lengths capped at this x ckpt_mean_len (max_new_tokens)
    flush_every: int = 256  # as ResponseWriter: parts of this many rows, compaction every 64 parts
    compact_min_parts: int = 64
    repeats: int = 3  # ours (fast): best of
    # several servers (5)
    pool_sizes: str = "1,2,4"  # servers per pool run
    pool_prompts: int = 1200  # per server: 150 per running slot, so the drain of the long tail at the end stays small
    pool_max_running: int = 8
    pool_decode_ms: float = 2.0  # 8 x 500 = 4,000 tok/s per server, 16,000 for 4 (one client on 2 cores)
    pool_kill_servers: int = 3
    jsonl_repeats: int = 2  # the JSONL baselines (seconds each)

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(
            quick=True,
            max_running=8,
            decode_ms=1.0,
            prompts=640,
            barrier_batches=8,
            sequential_prompts=10,
            budget_rounds=40.0,
            budget_trials=1,
            resume_rows=20_000,
            stats_datasets=10,
            stats_rows_per_dataset=2_000,
            repeats=2,
            jsonl_repeats=1,
            pool_prompts=400,
        )

    @property
    def slots(self) -> int:
        return max(self.max_running, int(round(self.slots_factor * self.max_running)))

    @property
    def capacity_tok_s(self) -> float:
        return self.max_running / (self.decode_ms / 1e3)

    @property
    def token_budget(self) -> int:
        return int(self.budget_rounds * self.mean_len * self.max_running)

    def sim_config(self) -> SimConfig:
        return SimConfig(
            max_running=self.max_running,
            decode_s_per_token=self.decode_ms / 1e3,
            mean_len=self.mean_len,
            sigma=self.sigma,
            seed=self.seed,
            eos_token_id=EOS,
        )

    def sampling_params(self) -> dict[str, Any]:
        # What tasks.generate.prompts.request_sampling_params sends for a typical config.
        return {
            "max_new_tokens": self.max_new_tokens,
            "temperature": 0.6,
            "top_p": 0.95,
            "stop_token_ids": [EOS],
            "skip_special_tokens": False,
            "no_stop_trim": True,
        }
