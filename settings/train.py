"""The `train:` section: how the EAGLE-3 draft is trained, each key once.

`TrainSettings` (with `HeldOut`, the held-out split and seed the eval job also carries) is what the train job file
carries (models/common/job_files.py `TrainJobFile`): each rank derives its DeepSpeed config from it
(models/train/optimizer.py). `TrainConfig`, the section, adds the launch (settings/launch.py) and the output directory.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from settings.base import StrictModel
from settings.launch import LaunchConfig

DRAFT_OVERRIDES = (
    "head_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rope_theta",
    "rms_norm_eps",
)


STEP_DECAY = 0.8  # EAGLE-3's weight of TTT step k's loss, STEP_DECAY**k: train.ttt_step_weight's default


class HeldOut(StrictModel):
    """The held-out split and the seed: training never sees the split, eval decodes its prompts."""

    eval_fraction: float = Field(default=0.02, ge=0, lt=1)
    """Share of the samples held out (a stable hash of dataset and id): never trained on; the training eval and `eagle3
    eval` use them."""
    seed: int = 0
    """Seed of the draft's initial weights and of the data order."""


class TrainSettings(HeldOut):
    """How the EAGLE-3 draft is trained (training-time test, schedule, checkpoints, evaluation)."""

    mode: Literal["offline", "online"] = "offline"
    """`offline`: train on the captured hidden states (RUN_DIR/hidden). `online`: every rank runs the target itself on
    the records (no capture, no disk; only for a target that fits one device)."""
    draft_vocab_size: int = Field(default=32000, ge=1)
    """Tokens the draft can propose: the most frequent loss tokens of the records (capped by the target vocab)."""
    ttt_steps: int = Field(default=7, ge=1, le=16)
    """Training-time-test steps unrolled per position (EAGLE-3: 7)."""
    epochs: int = Field(default=1, ge=1)
    """Passes over the training samples."""
    max_steps: int | None = Field(default=None, ge=1)
    """Stop after this many optimizer steps (overrides epochs)."""
    max_batch_tokens: int = Field(default=16384, ge=16)
    """Padded tokens per micro batch on one rank; longer samples are cut to this length."""
    lr: float = Field(default=1e-4, gt=0)
    """Peak learning rate (AdamW's; Muon's is derived from it, see optimizer)."""
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1)
    """Share of the steps with linear warmup; cosine decay after."""
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1)
    """Learning rate at the last step, as a share of lr."""
    checkpoint_every: int = Field(default=500, ge=1)
    """Optimizer steps between checkpoints (also one at the end)."""
    keep_checkpoints: int = Field(default=2, ge=1)
    """Complete checkpoints kept; older ones are deleted."""
    eval_every: int = Field(default=500, ge=1)
    """Optimizer steps between evaluations on the held-out split (also one at the end)."""
    log_every: int = Field(default=10, ge=1)
    """Optimizer steps per metrics.jsonl / TensorBoard line."""
    # the optimizer and DeepSpeed: each rank derives its DeepSpeed config from these (models/train/optimizer.py
    # ds_train_config)
    optimizer: Literal["adamw", "muon"] = "adamw"
    """adamw: AdamW on every trained weight. muon: DeepSpeed's Muon on the draft layer's and fc's matrices (learning
    rate lr * 0.2 * sqrt(hidden size): AdamW's update size, as vLLM's speculators runs it) with AdamW on the rest (the
    lm_head, norms). Needs zero_stage: 0."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """auto: bf16 on GPUs (fp32 master weights in the optimizer), fp32 on CPU."""
    grad_accum: int = Field(default=1, ge=1)
    """Micro batches per optimizer step on each rank."""
    weight_decay: float = Field(default=0.0, ge=0)
    """AdamW weight decay."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas (beta1, beta2), each in (0, 1): the EAGLE-3 recipes' [0.9, 0.95]."""
    adam_eps: float = Field(default=1e-8, gt=0)
    """AdamW epsilon."""
    torch_adam: bool = True
    """true: DeepSpeed runs torch's AdamW (nothing compiled); false: DeepSpeed's fused Adam (CUDA only, JIT-built on
    first use)."""
    grad_clip: float = Field(default=0.5, gt=0)
    """Gradient norm clipping (DeepSpeed gradient_clipping)."""
    lm_head_init: Literal["random", "target"] = "random"
    """The draft lm_head's initial weights: `random` (torch's default init), or `target`: the target lm_head's rows of
    the draft vocabulary's tokens (as vLLM's speculators trainer starts it), a head that already ranks tokens."""
    zero_stage: Literal[0, 1, 2] = 2
    """DeepSpeed ZeRO stage of the optimizer states and gradients: 2 partitions both over the ranks; 0 or 1 only to take
    ZeRO-2 apart (bench/train.py)."""
    ttt_step_weight: float = Field(default=STEP_DECAY, gt=0, le=1)
    """The loss of training-time-test step k weighs this to the k-th power: 0.8 as EAGLE-3 and SpecForge, 1.0 (every
    step alike) as vLLM's speculators."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated aux hidden states before fc (`input_norm`), as vLLM's speculators trains;
    served by vLLM 0.32 and SGLang 0.5.23. Exclusive with draft_variant eagle3.1 (one RMSNorm per aux feature)."""
    norm_before_residual: bool = False
    """The draft layer's residual is hidden_norm(h) instead of h, as vLLM's speculators trains; served by vLLM 0.32
    only (SGLang 0.5.23's LlamaDecoderLayer always keeps h)."""
    draft_arch: Literal["llama", "mla"] = "llama"
    """The draft layer's attention. llama: Llama attention with plain RoPE (every engine's EAGLE-3 draft). mla:
    DeepSeek's multi-head latent attention with the target's MLA widths (an MLA target only: Kimi-K2.x, DeepSeek-V3),
    as the published Kimi-K2.5 MLA draft; served by vLLM 0.32 (Eagle3DeepseekV2ForCausalLM) and SGLang 0.5.23
    (srt/models/kimi_k25_eagle3.py). Exclusive with norm_before_fc (neither engine's MLA draft has it)."""
    draft_rope: Literal["target", "plain"] = "target"
    """The draft's rope scaling. target: the target's when it is YaRN (Kimi: factor 64 over a 4k original context),
    applied as each engine applies it to that draft shape; plain: no scaling, at the target's rope base. A target
    scaling other than YaRN (Llama 3.1's llama3): plain for draft_arch llama, refused for mla."""
    draft_variant: Literal["eagle3", "eagle3.1"] = "eagle3"
    """eagle3.1: EAGLE 3.1's two changes (an RMSNorm per aux feature before fc, and each draft step reading the previous
    one's post-norm output), written as fc_norm/norm_output in the export's config.json; served by vLLM 0.32 and
    SGLang 0.5.23 (older engines ignore the keys and serve it wrong)."""
    draft_overrides: dict[str, int | float] = Field(default_factory=dict)
    """Draft shape settings that differ from the target's (head_dim, num_attention_heads, num_key_value_heads,
    intermediate_size, rope_theta, rms_norm_eps); e.g. head_dim: 128 for an MLA target."""

    @field_validator("adam_betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float]) -> tuple[float, float]:
        if not all(0 < b < 1 for b in value):
            raise ValueError(f"each AdamW beta must be in (0, 1), got {list(value)}")
        return value

    @model_validator(mode="after")
    def _muon_without_zero_partitions(self) -> TrainSettings:
        if self.optimizer == "muon" and self.zero_stage != 0:
            raise ValueError(
                f"optimizer muon needs zero_stage: 0 (got {self.zero_stage}): DeepSpeed 0.19's ZeRO-1/2 "
                "(runtime/zero/stage_1_and_2.py) write Muon's orthogonalized update into the gradient partitions and "
                "then clip that by grad_clip, shrinking Muon's steps about 50-fold here; without partitions DeepSpeed "
                "clips the gradient, as Muon expects (the draft's optimizer state fits each rank whole)"
            )
        return self

    @model_validator(mode="after")
    def _one_aux_norm(self) -> TrainSettings:
        if self.norm_before_fc and self.draft_variant == "eagle3.1":
            raise ValueError(
                "norm_before_fc and draft_variant eagle3.1 are exclusive: one RMSNorm over all aux features, or "
                "EAGLE-3.1's one per feature; set one of them"
            )
        return self

    @model_validator(mode="after")
    def _mla_without_input_norm(self) -> TrainSettings:
        if self.draft_arch == "mla" and self.norm_before_fc:
            raise ValueError(
                "draft_arch mla and norm_before_fc are exclusive: neither vLLM 0.32 "
                "(model_executor/models/deepseek_eagle3.py) nor SGLang 0.5.23 (srt/models/kimi_k25_eagle3.py) has an "
                "input_norm in its MLA draft; remove norm_before_fc"
            )
        return self

    @field_validator("draft_overrides")
    @classmethod
    def _known_overrides(cls, value: dict[str, int | float]) -> dict[str, int | float]:
        unknown = sorted(set(value) - set(DRAFT_OVERRIDES))
        if unknown:
            raise ValueError(f"unknown draft setting(s) {unknown}; allowed: {sorted(DRAFT_OVERRIDES)}")
        return value


class TrainConfig(TrainSettings, LaunchConfig):
    """The DeepSpeed job that trains the EAGLE-3 draft (ZeRO-2, training-time test)."""

    out_dir: Path | None = None
    """Checkpoints, metrics and the exported draft; default RUN_DIR/draft."""
