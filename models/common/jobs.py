"""Typed job specs: every setting of a stage declared once, with its default, range and meaning.

Each stage has a `*Settings` class holding what a user chooses for it. The run config's section
(flows/config/schema.py) extends it with what only the pipeline needs (ranks, launcher, retries, where
outputs go); the stage's `*Job` extends it with what the pipeline fills in (the target, paths, the
device). A flow builds a job from the run config in one call (`StrictModel.pick`); a rank process reads
its JSON job through the same class (`load_job`, models/common/strict.py), so an unknown key or a bad value in a job
file fails with its name, and no default can drift between the config and the job.

This module is the bottom layer: pydantic only (no torch, prefect or httpx), importable by
flows/, tasks/ and models/ alike.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from models.common.server_access import api_key_from_env, server_url
from models.common.strict import StrictModel

# A server's base URL (server.url, capture.engine.url, eval.baseline_url), checked and without a trailing slash.
ServerUrl = Annotated[str, AfterValidator(server_url)]
# The two settings every server section has (server, capture.engine), declared once.
OutageWindow = Annotated[
    float,
    Field(
        gt=0,
        description="How long the server may stay unreachable (connect errors, 5xx, 408, 429) before the stage "
        "fails cleanly; a Prefect retry of the stage (generate.retries, capture.retries) then resumes it.",
    ),
]
ApiKeyEnv = Annotated[
    str | None,
    Field(
        description="Name of the environment variable holding the server's API key (SGLang's or vLLM's --api-key), "
        "sent as a Bearer token. The key itself never goes into the config, logs or artifacts.",
    ),
]


class KeyFromEnv:
    """The API key of a server section with an `api_key_env` setting, read from the environment at use."""

    if TYPE_CHECKING:  # the section's own field (not a field here: pydantic would put it first in the section)
        api_key_env: str | None
    KEY_SETTING: ClassVar[str] = "server.api_key_env"  # the setting's path, for the error when the variable is not set

    def api_key(self) -> str | None:
        """The key from the environment (None when no variable is named); RuntimeError when it is not set."""
        return api_key_from_env(self.api_key_env, self.KEY_SETTING)


# --- the target -------------------------------------------------------------------------------


class TargetCode(StrictModel):
    """Whether the target's own modelling code may run."""

    trust_remote_code: bool = False
    """Pass trust_remote_code=True to transformers (Kimi-K2.5's tokenizer needs it)."""


class TargetSpec(TargetCode):
    """The target model whose responses and hidden states the draft learns from."""

    path: str
    """Hugging Face repo id or local directory of the target: its tokenizer and chat template build the prompts; its
    weights are loaded by the capture stage."""


class DatasetRecords(StrictModel):
    """One dataset's training records: RUN_DIR/records/<name>/part-*.parquet."""

    name: str
    records_dir: str


class RecordsRef(StrictModel):
    """The records a job reads, per dataset."""

    datasets: list[DatasetRecords] = Field(default_factory=list)
    """Each dataset's records directory."""

    @field_validator("datasets")
    @classmethod
    def _unique_names(cls, value: list[DatasetRecords]) -> list[DatasetRecords]:
        names = [d.name for d in value]
        if len(names) != len(set(names)):
            raise ValueError(f"duplicate dataset names in {names}")
        return value


class AuxLayers(StrictModel):
    """Which decoder layers' outputs EAGLE-3 reads (the capture writes them, the draft is built for them)."""

    aux_layers: list[int] | None = None
    """0-based decoder layers whose outputs are captured; default [1, L//2-1, L-4] (EAGLE-3)."""

    @field_validator("aux_layers")
    @classmethod
    def _three_layers(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (len(value) != 3 or len(set(value)) != 3 or min(value) < 0):
            raise ValueError(f"must be 3 distinct non-negative layer indices (or omitted), got {value}")
        if value is not None and (value[0] != 1 or value != sorted(value)):
            # the export refuses these (models/export/sglang.py): SGLang versions read a first id other
            # than 1 differently, and both engines concatenate the aux hidden states in layer order
            raise ValueError(
                f"must be increasing and start at layer 1 so that every SGLang version and vLLM "
                f"read them as trained, got {value}"
            )
        return value


# --- generate ---------------------------------------------------------------------------------


class ServerSettings(KeyFromEnv, StrictModel):
    """How to reach the serving engine's servers (the API key is read from `api_key_env` at use, never stored)."""

    engine: Literal["sglang", "vllm"] = "sglang"
    """The serving engine of generate and the engine eval (tasks/engines/): sglang (its native /generate) or vllm (its
    OpenAI-compatible /v1/completions with token ids; `make vllm` installs the CPU build). The dev server emulates
    SGLang only."""
    url: ServerUrl = "http://127.0.0.1:30000"
    """Base URL of the server: scheme://host:port with no path (not .../generate, not .../v1). https is allowed; without
    a port the scheme's default (80, 443) is used, as behind a proxy."""
    urls: list[str] | None = Field(default=None, min_length=1)
    """Several servers already running (launch: none), e.g. one per box or two TP-4 servers on one 8-GPU box: each
    request goes to the least-loaded healthy one, each gets max_concurrency, and a server that fails is left for the
    others. When given, `url` is not used. For one server (or a router) use `url`."""
    max_req_input_len: int | None = Field(default=None, ge=2)
    """Longest prompt + 1 that a server accepts, when it does not say (an SGLang router whose workers cannot be asked);
    a server's own max_req_input_len wins where it is smaller."""
    request_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds one request may take before it is cancelled and retried; long enough for max_new_tokens at the slowest
    expected decode speed."""
    outage_window_s: OutageWindow = 900.0
    health_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the server's health path (SGLang's /health_generate, vLLM's /health) at the start of the
    generate stage (a 1T model takes minutes to load)."""
    api_key_env: ApiKeyEnv = None

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        urls = []
        for i, url in enumerate(value):
            try:
                urls.append(server_url(url))
            except ValueError as e:
                raise ValueError(f"urls[{i}] {e}") from None
        repeated = sorted({u for u in urls if urls.count(u) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} given more than once: each server once")
        return urls

    @property
    def endpoints(self) -> list[str]:
        """The servers requests go to (already running ones; a launched pool is in the pipeline's ServerConfig)."""
        return list(self.urls) if self.urls else [self.url]


class GenerateSettings(StrictModel):
    """Checkpointing and progress of the generate stage."""

    flush_every: int = Field(default=256, ge=1)
    """Write a checkpoint part every this many responses."""
    flush_interval_s: float = Field(default=60.0, gt=0)
    """...and at least this often (seconds): a kill loses at most this window."""
    log_interval_s: float = Field(default=30.0, gt=0)
    """Seconds between progress log lines and progress-artifact updates."""
    throughput_window_s: float = Field(default=120.0, gt=0)
    """Tokens/s and the ETA are measured over this recent window."""
    compact_min_parts: int = Field(default=64, ge=2)
    """Merge small checkpoint parts once this many have been written."""


class DatasetGenerateSettings(StrictModel):
    """What one generate dataset may spend and which turns it answers: a dataset's config, carried by its job."""

    token_budget: int | None = Field(default=None, ge=1)
    """Generate datasets: stop once the server has spent this many completion tokens on this dataset. Omitted: no token
    limit."""
    max_prompts: int | None = Field(default=None, ge=1)
    """Use at most this many prompts of the dataset (in file order)."""
    max_in_flight: int | None = Field(default=None, ge=1)
    """Generate datasets: at most this many of the dataset's requests at once, over the whole pool (within
    generate.max_concurrency). 1 makes a budget stop exact: the prompts answered are the first ones, in file order,
    whose tokens reach token_budget, the same on every run with sampling.seed. Omitted: no limit of its own."""
    turns: Literal["last", "all"] = "last"
    """Generate datasets: `last`: the target answers each conversation's last user turn, after the dataset's own earlier
    turns. `all`: it answers every user turn in order, each prompt holding its own earlier answers; one response per
    turn, id `<id>#t<k>`, regenerated up to the first tool call (docs/run-a-pipeline.md, Multi-turn conversations)."""


class GenerateJob(GenerateSettings, DatasetGenerateSettings):
    """How one dataset is generated: the stage's settings plus what the pipeline fills in."""

    dataset: str
    sampling_params: dict[str, Any]
    """SGLang sampling_params sent with every request."""
    sampling_seed: int | None = None
    """sampling.seed: each request's sampling_seed is derived from it, the dataset and the prompt id."""
    max_requeues: int = Field(default=2, ge=0)
    """A request the server aborted on its own is sent again this often."""
    retry_rejects: bool = False
    """Also send again prompts the server refused (400) in earlier runs."""


# --- records ----------------------------------------------------------------------------------


class RecordSettings(StrictModel):
    """How responses and passthrough rows become training records (input_ids + loss_mask)."""

    max_seq_len: int | None = Field(default=8192, ge=16)
    """Longest record in tokens; longer ones are cut or dropped (see overflow). null: no limit."""
    overflow: Literal["truncate", "drop"] = "truncate"
    """`truncate`: keep the first max_seq_len tokens. `drop`: leave the record out."""
    min_loss_tokens: int = Field(default=1, ge=1)
    """Records with fewer loss tokens than this are left out."""
    keep_truncated: bool = False
    """Also train on responses that ended by length (cut off by max_new_tokens) or abort."""
    on_rewrite: Literal["split", "reject"] = "split"
    """Passthrough conversations whose chat template rewrites earlier turns (e.g. drops their reasoning): `split` makes
    one record per assistant turn, exactly as the model saw it; `reject` sends the row to rejects."""


class RecordsJob(RecordSettings):
    """How records are cut and filtered, with the target vocabulary every token id must be below."""

    vocab_size: int = Field(ge=1)
    stop_token_ids: list[int] = Field(default_factory=list)
    """The stop ids generate sent. A response that ends with one is whole, whether the server said `stop` or `length`
    for it: SGLang 0.5 checks the stop token first, 0.4 the length cap first, so an end token exactly at
    max_new_tokens is `stop` on one and `length` on the other."""

    def digest(self) -> str:
        """A short hash of the settings: a records part built with other settings is built again."""
        import hashlib

        return hashlib.sha256(json.dumps(self.model_dump(), sort_keys=True).encode()).hexdigest()[:16]


# --- capture ----------------------------------------------------------------------------------


class CaptureSettings(AuxLayers):
    """How the target's hidden states are captured for every training record."""

    mode: Literal["replicate", "zero3"] = "replicate"
    """`replicate`: every rank holds the whole target (data parallel; the target must fit one GPU). `zero3`: parameters
    partitioned over the ranks with DeepSpeed ZeRO-3 (targets larger than one GPU; see offload)."""
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"
    """Dtype the target runs in (and the hidden states are stored in, storage native); auto: its own."""
    storage: Literal["native", "fp8"] = "native"
    """native: hidden states stored in `dtype`. fp8: float8 e4m3 with a float32 scale per token and feature, half of
    bf16's bytes (models/capture/shards.py); one kind per capture.out_dir."""
    max_batch_tokens: int = Field(default=16384, ge=1)
    """Padded tokens per forward pass on one rank."""
    shard_tokens: int = Field(default=16384, ge=1)
    """Tokens per safetensors shard (a kill loses at most one unfinished shard per rank)."""
    offload: Literal["none", "cpu", "nvme"] = "none"
    """zero3 only: where partitioned parameters live between uses."""
    nvme_path: Path | None = None
    """zero3 with offload: nvme: a fast local directory."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _fp8_is_a_storage(cls, value: object) -> object:
        if isinstance(value, str) and value.lower().startswith(("fp8", "float8")):
            raise ValueError(f"{value!r}: capture.dtype is what the target runs in; for fp8 set capture.storage: fp8")
        return value

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> CaptureSettings:
        if self.offload == "nvme" and self.nvme_path is None:
            raise ValueError("offload: nvme needs nvme_path (a fast local directory for the parameters)")
        if self.offload != "none" and self.mode != "zero3":
            raise ValueError("offload applies to mode: zero3 only")
        return self


class TargetRef(TargetCode):
    """The target a job loads (the run config's `target`)."""

    target_path: str
    """The target's checkpoint directory or hub id (target.path)."""


class RankJob(TargetRef):
    """What every DeepSpeed rank job names: the target, and the device its ranks run on."""

    device: Literal["cpu", "cuda"] = "cuda"
    """cuda under the deepspeed launcher, cpu (gloo) otherwise."""


class CaptureJob(CaptureSettings, RecordsRef, RankJob):
    """The JOB.json a capture launch reads (written by the capture task)."""

    out_dir: str
    """Shards + index.parquet go here (RUN_DIR/hidden)."""
    launch_tokens: int | None = Field(ge=0)
    """Most tokens THIS launch captures: capture.max_tokens less what complete shards hold (null: no cap). Always stated
    by the task: no default."""


class VllmCaptureSettings(KeyFromEnv, StrictModel):
    """How the capture reaches a vLLM server that extracts hidden states (capture.backend: vllm; docs/kimi-k25.md).

    The server runs the target with `speculative_config.method = extract_hidden_states` and the
    `ExampleHiddenStatesConnector`, which writes one safetensors file per request into
    `shared_dir`; the capture sends each record's token ids to /v1/completions with max_tokens 1,
    reads the file the reply names, and deletes it once the shard holding the record is on disk.
    """

    url: ServerUrl = "http://127.0.0.1:8000"
    """Base URL of the vLLM server (scheme://host:port, no path; the capture adds /v1/completions)."""
    model: str | None = None
    """The served model name sent in every request; default: target.path (vLLM's default name)."""
    shared_dir: Path | None = None
    """The connector's shared_storage_path: where vLLM writes a file per request, read and deleted by the capture. Must
    be this machine's view of the server's directory and used by this capture alone. Default RUN_DIR/engine; a RAM
    disk (/dev/shm/...) is fastest (vLLM's advice)."""
    max_concurrency: int = Field(default=32, ge=1, le=4096)
    """Requests in flight at once; each holds a file of n x 4 x hidden x 2 bytes in shared_dir until its shard is
    written."""
    request_timeout_s: float = Field(default=600.0, gt=0)
    """Seconds one request (a prefill of one record) and the wait for its file may take."""
    outage_window_s: OutageWindow = 900.0
    api_key_env: ApiKeyEnv = None

    KEY_SETTING: ClassVar[str] = "capture.engine.api_key_env"


# --- train ------------------------------------------------------------------------------------

DRAFT_OVERRIDES = (
    "head_dim",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "rope_theta",
    "rms_norm_eps",
)


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
    # the optimizer and DeepSpeed: each rank derives its DeepSpeed config from these (models/train/job.py
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
    ttt_step_weight: float = Field(default=0.8, gt=0, le=1)
    """The loss of training-time-test step k weighs this to the k-th power: 0.8 as EAGLE-3 and SpecForge, 1.0 (every
    step alike) as vLLM's speculators."""
    norm_before_fc: bool = False
    """One RMSNorm over the concatenated aux hidden states before fc (`input_norm`), as vLLM's speculators trains;
    served by vLLM 0.32 and SGLang 0.5.23. Exclusive with draft_variant eagle3.1 (one RMSNorm per aux feature)."""
    norm_before_residual: bool = False
    """The draft layer's residual is hidden_norm(h) instead of h, as vLLM's speculators trains; served by vLLM 0.32
    only (SGLang 0.5.23's LlamaDecoderLayer always keeps h)."""
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

    @field_validator("draft_overrides")
    @classmethod
    def _known_overrides(cls, value: dict[str, int | float]) -> dict[str, int | float]:
        unknown = sorted(set(value) - set(DRAFT_OVERRIDES))
        if unknown:
            raise ValueError(f"unknown draft setting(s) {unknown}; allowed: {sorted(DRAFT_OVERRIDES)}")
        return value


class TrainJob(TrainSettings, AuxLayers, RecordsRef, RankJob):
    """The JOB.json a training launch reads (written by the train task)."""

    out_dir: str
    """RUN_DIR/draft: checkpoints, metrics, the export."""
    token_counts: str
    """RUN_DIR/records/token_counts.parquet (the draft vocabulary)."""
    hidden_dir: str | None = None
    """offline: the capture shards (online: `datasets`, the records)."""

    @model_validator(mode="after")
    def _data_for_the_mode(self) -> TrainJob:
        if self.mode == "offline" and not self.hidden_dir:
            raise ValueError("mode offline needs hidden_dir")
        if self.mode == "online" and not self.datasets:
            raise ValueError("mode online needs datasets")
        return self

    @property
    def bf16(self) -> bool:
        """Whether the draft trains in bf16: `precision`, with auto meaning bf16 on GPUs."""
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")


# --- eval -------------------------------------------------------------------------------------

BENCHMARK_FORMATS = ("mt_bench", "gsm8k", "humaneval")
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
    format: Literal["mt_bench", "gsm8k", "humaneval"] | None = None
    """mt_bench (FastChat's question.jsonl: question_id, category, turns), gsm8k (openai/gsm8k: question, answer) or
    humaneval (openai/openai_humaneval: task_id, prompt, ...). Omitted: told from the first row's keys."""
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


class EvalJob(EvalSettings, HeldOut, RecordsRef, TargetRef):
    """The JOB.json of an eval launch (written by the eval task): held-out prompts come from `datasets`."""

    draft_dir: str
    """The export: config.json + model.safetensors."""
    out: str
    """Where the result JSON goes."""
