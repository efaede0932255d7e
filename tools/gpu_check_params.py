"""The GPU check's parameters: every knob of one check, the GPU run's defaults and the CPU smoke preset."""

from __future__ import annotations

from dataclasses import dataclass

from bench import harness


@dataclass
class Params(harness.TargetParams):
    """Every knob of one check (printed and saved with the figures). Defaults: the GPU run."""

    quick: bool = False  # --cpu-smoke: the small CPU preset
    device: str = "cuda"  # cuda: deepspeed launcher, NCCL, bf16; cpu: torchrun, gloo, fp32
    precision: str = "auto"  # auto: bf16 on cuda, fp32 on cpu; bf16 / fp32 to choose (bf16 on CPU: the dtype path here)
    # auto: deepspeed on cuda, torchrun on cpu; `--cpu-smoke --rank-launcher deepspeed`: the GPU run's launcher on CPU
    rank_launcher: str = "auto"
    seed: int = 0
    # the target (models/target/tiny.py); vocab_size is an upper bound: the BPE trainer decides
    hidden_size: int = 1024
    num_layers: int = 16
    num_heads: int = 16
    num_kv_heads: int = 4
    intermediate_size: int = 2816
    vocab_size: int = 2048
    target_train_steps: int = harness.tiny_target_default("train_steps")  # the target's own training when built
    # records: the target's greedy continuations of random prompts
    prompts: int = 512
    prompt_tokens: int = 64
    new_tokens: int = 448
    gen_batch: int = 512  # prompts per generate() call
    # capture
    capture_batch_tokens: int = 32768
    shard_tokens: int = 65536
    # train
    steps: int = 300
    skip_steps: int = 20  # train steps left out of the throughput (warmup: allocator, kernels); a multiple of log_every
    log_every: int = 10
    train_batch_tokens: int = 8192
    ttt_steps: int = 7
    lr: float = 3e-3
    warmup_ratio: float = 0.05
    draft_vocab_size: int = 32000  # capped by the target's vocab
    eval_fraction: float = 0.1
    # eval
    eval_prompts: int = 32
    eval_new_tokens: int = 96
    eval_num_steps: int = 3
    # time: the whole run, then each phase (cut to what is left of the whole)
    budget_s: float = 420.0
    target_s: float = 120.0
    records_s: float = 120.0
    capture_s: float = 150.0
    train_s: float = 240.0
    export_s: float = 60.0
    eval_s: float = 150.0

    @classmethod
    def quick_preset(cls) -> Params:
        """--cpu-smoke: the same path on CPU at toy sizes (a target half the demo's width, random weights)."""
        # by stage, as the fields above
        target = dict(hidden_size=64, num_layers=8, num_heads=2, num_kv_heads=1, intermediate_size=128)
        records = dict(prompts=24, prompt_tokens=16, new_tokens=40, gen_batch=24)
        capture = dict(capture_batch_tokens=2048, shard_tokens=4096)
        train = dict(steps=6, skip_steps=2, log_every=1, train_batch_tokens=512, lr=2e-3, eval_fraction=0.25)
        evaluate = dict(eval_prompts=2, eval_new_tokens=12)
        return cls(
            quick=True,
            device="cpu",
            budget_s=240.0,
            target_train_steps=0,  # a random target: the smoke only shows the path works
            **target,
            **records,
            **capture,
            **train,
            **evaluate,
        )

    @property
    def launcher(self) -> str:
        if self.rank_launcher != "auto":
            return self.rank_launcher
        return "deepspeed" if self.device == "cuda" else "torchrun"

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")

    def validate(self) -> None:
        if self.device not in ("cuda", "cpu"):
            raise SystemExit(f"--device must be cuda or cpu, got {self.device!r}")
        if self.precision not in ("auto", "bf16", "fp32"):
            raise SystemExit(f"--precision must be auto, bf16 or fp32, got {self.precision!r}")
        if self.rank_launcher not in ("auto", "deepspeed", "torchrun"):
            raise SystemExit(f"--rank-launcher must be auto, deepspeed or torchrun, got {self.rank_launcher!r}")
        if not 0 <= self.skip_steps < self.steps or self.skip_steps % self.log_every:
            raise SystemExit(
                f"--skip-steps must be in [0, --steps) and a multiple of --log-every, "
                f"got {self.skip_steps} (steps {self.steps}, log every {self.log_every})"
            )
