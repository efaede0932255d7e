"""Typed job specs of the draft's own stages, train and eval (models/common/jobs.py has the rest and says how
specs are declared and read). Pydantic only: no torch, prefect or httpx.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from models.common.jobs import ServerUrl
from settings.base import StrictModel

# --- train ------------------------------------------------------------------------------------

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


# --- eval -------------------------------------------------------------------------------------

PROBES = "context_probes"  # the benchmark the context probes are decoded as (models/eval/probes.py)
BENCHMARK_FORMATS = ("mt_bench", "gsm8k", "humaneval", "chat", "ids")
BENCHMARK_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class BenchmarkSpec(StrictModel):
    """A published benchmark the eval also decodes, in its published format (models/eval/benchmarks.py), reported on its
    own beside the published acceptance length for the target."""

    name: str
    """Its name in eval.json and the tables, e.g. mt_bench (letters, digits, '_', '.', '-')."""
    path: str
    """The benchmark's rows as published: a local JSONL (.jsonl, .jsonl.gz) or Parquet file (relative paths resolve like
    the datasets'), or `hf:ORG/NAME`, a Hub dataset read from the local Hugging Face cache only, never downloaded (`hf
    download --repo-type dataset ORG/NAME` beforehand), with `split` and `config`."""
    format: Literal["mt_bench", "gsm8k", "humaneval", "chat", "ids"] | None = None
    """mt_bench (FastChat's question.jsonl: question_id, category, turns), gsm8k (openai/gsm8k: question, answer),
    humaneval (openai/openai_humaneval: task_id, prompt, ...), chat (a set of one's own: id, messages, each
    conversation asked as it is, e.g. data/eval/long_context.jsonl) or ids (id, input_ids: token ids sent as they are,
    no chat template). Omitted: told from the first row's keys."""
    limit: int | None = Field(default=80, ge=1)
    """Questions decoded, the first ones in file order (MT-bench has 80); null: all of them."""
    max_new_tokens: int | None = Field(default=None, ge=1)
    """Tokens generated per question. Omitted: eval.max_new_tokens. SpecForge's benchmarks allow 2048 (MT-bench),
    512 (GSM8K), 1024 (HumanEval)."""
    anchor: float | None = Field(default=None, ge=1)
    """A published acceptance length to print beside ours (completion tokens / verify rounds, as SpecForge's
    bench_eagle3 counts). Omitted: the one data/benchmarks/anchors.json holds for the target (matched on target.path's
    last part) and this format, if any."""
    split: str | None = None
    """`hf:` benchmarks: the split to read. Omitted: test."""
    config: str | None = None
    """`hf:` benchmarks: the dataset's config (subset), e.g. main for openai/gsm8k. Omitted: its default."""

    @field_validator("name")
    @classmethod
    def _name_is_a_word(cls, value: str) -> str:
        if not BENCHMARK_NAME.match(value):
            raise ValueError(f"{value!r}: a benchmark name is letters, digits, '_', '.', '-', from a letter or digit")
        return value

    @model_validator(mode="after")
    def _hub_settings_only_for_hub_paths(self) -> BenchmarkSpec:
        given = [key for key in ("split", "config") if getattr(self, key) is not None]
        if given and not self.path.startswith("hf:"):
            raise ValueError(f"{', '.join(given)}: for hf: benchmarks only; {self.path} is a local file")
        return self


class EvalSettings(StrictModel):
    """`eagle3 eval`: speculative decoding with the HF target (greedy) and the exported draft on held-out prompts."""

    prompts: int = Field(default=32, ge=1)
    """Prompts decoded: held-out records' prompts first, then prompt_files' prompts, up to this many."""
    prompt_files: list[Path] = Field(default_factory=list)
    """JSONL prompt sets for the eval beside the held-out records (e.g. data/eval/prompts.jsonl): rows with `id` and
    `messages` ([{role, content}]) or `prompt` (a string), rendered with the target's chat template and the
    generation prompt. Relative paths are resolved like the datasets' paths."""
    max_new_tokens: int = Field(default=128, ge=1)
    """Tokens generated per prompt."""
    num_steps: int = Field(default=3, ge=1, le=16)
    """Draft tokens per verify round (SGLang --speculative-num-steps; top-k 1, num-draft-tokens = this + 1)."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the target and draft run; auto: cuda if available."""
    compare_untrained: bool = True
    """Also measure the draft as training starts it (same seed, untrained): the baseline the trained one must beat."""
    benchmarks: list[BenchmarkSpec] = Field(default_factory=list)
    """Published benchmarks (MT-bench, GSM8K, HumanEval) decoded with the trained draft after the eval prompts, each
    reported on its own in eval.json and a table, beside the published acceptance length for the target where one is
    known (docs/acceptance.md, Benchmarks and published anchors)."""
    context_buckets: list[int] = Field(default_factory=lambda: [512, 1024, 2048, 4096, 8192, 16384, 32768])
    """Edges of the context-position buckets the eval reports acceptance in (models/eval/context.py), in-process and
    in the engine: a verify round falls in [0, e1), [e1, e2), ... or [e_last, inf) by the tokens before its first draft
    token (prompt and answer so far). Ascending positive token counts; [] reports one bucket."""

    context_probes: int = Field(default=0, ge=0)
    """Context probes (models/eval/probes.py): up to this many held-out records cut at each edge of context_buckets,
    inside the target's answer (its own recorded text up to exactly that many tokens), each continued for
    context_probe_tokens and reported as the benchmark `context_probes`. Every engine places a probe's rounds in the
    bucket it starts (SGLang too, which reports a request's totals only). 0: none."""
    context_probe_tokens: int = Field(default=64, ge=2)
    """Tokens each context probe generates. Fewer than the narrowest bucket is wide (512 with the default edges) keeps
    each probe's rounds in one bucket."""

    @field_validator("context_buckets")
    @classmethod
    def _ascending_edges(cls, value: list[int]) -> list[int]:
        if any(e < 1 for e in value) or any(b <= a for a, b in zip(value, value[1:])):
            raise ValueError(
                f"{value}: context_buckets are the buckets' edges in tokens, ascending and positive, e.g. [512, 1024, "
                "2048]"
            )
        return value

    @field_validator("benchmarks")
    @classmethod
    def _unique_benchmark_names(cls, value: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        names = [b.name for b in value]
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ValueError(f"benchmark name(s) {repeated} given more than once: each name once")
        return value


class ServedEvalSettings(StrictModel):
    """How the eval is measured: in-process with HF transformers, through the serving engine, or both side by side."""

    backend: Literal["hf", "engine", "both"] = "hf"
    """hf: speculative decoding in-process with the HF target (the whole target in this process's GPUs: small targets,
    the demo). engine: the eval starts the server (server.launch dev|command) with the exported draft (SGLang's
    --speculative-* flags from num_steps), decodes the prompts greedily through /generate and reads the acceptance
    from meta_info, then again without the draft for the speedup (a 1T target). both: each, on the same prompts, side
    by side in eval.json."""
    concurrency: int = Field(default=1, ge=1, le=1024)
    """engine: eval requests in flight at once (1: batch-size-1 latency, where speculative decoding gains most)."""
    baseline: bool = True
    """engine: also decode the prompts without the draft, for the speedup in tokens/s."""
    baseline_url: ServerUrl | None = None
    """engine with server.launch: none: a running server of the same target WITHOUT the draft, for the speedup
    (server.url must then serve the draft). Unset: no speedup is measured with launch: none."""
