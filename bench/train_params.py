"""The train bench's parameters: every knob of one run (printed and saved with the figures), the quick preset and
their checks; the target's shape is harness.TargetParams'."""

from __future__ import annotations

from dataclasses import dataclass

from bench import harness
from settings.train import TrainConfig

DATASET = "bench"
RUN_CONFIG = TrainConfig()  # the run config's train section as declared: its defaults (ttt_steps, grad_accum, ...)


@dataclass
class Params(harness.TargetParams):
    """Every knob of one bench run (printed and saved with the figures); the target: harness.TargetParams."""

    quick: bool = False
    # records: every sample conversation, cut to max_prompt_tokens, + its greedy continuation
    max_prompt_tokens: int = 768
    max_new_tokens: int = 96
    # the training job (the demo config's draft vocab and lr; the run config's defaults elsewhere)
    draft_vocab_size: int = 1024
    ttt_steps: int = RUN_CONFIG.ttt_steps
    max_batch_tokens: int = 1024  # padded tokens per micro batch per rank (the demo config's)
    grad_accum: int = RUN_CONFIG.grad_accum
    lr: float = 2e-3
    weight_decay: float = RUN_CONFIG.weight_decay
    grad_clip: float = RUN_CONFIG.grad_clip
    warmup_ratio: float = 0.05  # lr warmup (schedule), not the measurement's skip
    zero_stage: int = RUN_CONFIG.zero_stage  # train.zero_stage: 2 as the flow runs it; 0 or 1 to take ZeRO-2 apart
    eval_fraction: float = RUN_CONFIG.eval_fraction
    steps: int = 30  # optimizer steps per run (max_steps)
    skip: int = 5  # steps left out of the measurement at the start (a multiple of log_every)
    log_every: int = 1  # the job's metrics line interval: per-step times for the paired ratio (run config default: 10)
    threads: int = 1  # OMP_NUM_THREADS per rank (what rank_command gives CPU ranks) and per baseline process
    ranks: str = "1,2"  # comma-separated rank counts, each a row
    repeats: int = 3  # passes over the whole sequence (odd passes in reverse order); ratios: median over passes
    baseline_here: bool = False  # the 1-process baseline in this process instead of a fresh spawned one
    in_process_steps: int = 30  # the interleaved in-process comparison (1 rank; once per run); 0: skip it
    timeout_s: float = 900.0  # per launch or baseline

    @classmethod
    def quick_preset(cls) -> Params:
        return cls(quick=True, max_new_tokens=32, steps=8, skip=2, repeats=1, in_process_steps=8)

    def rank_list(self) -> list[int]:
        return [int(x) for x in self.ranks.split(",") if x.strip()]

    def validate(self) -> None:
        if not 0 < self.skip < self.steps:
            raise SystemExit(f"--skip must be in [1, --steps), got {self.skip} with --steps {self.steps}")
        if self.skip % self.log_every:
            raise SystemExit(f"--skip ({self.skip}) must be a multiple of --log-every ({self.log_every})")
        if not self.rank_list() or min(self.rank_list()) < 1:
            raise SystemExit(f"--ranks: comma-separated positive rank counts, got {self.ranks!r}")
