"""Typed job specs: every setting of a stage declared once, with its default, range and meaning.

Each stage has a `*Settings` class holding what a user chooses for it. The run config's section
(flows/config/schema.py) extends it with what only the pipeline needs (ranks, launcher, retries, where
outputs go); what the pipeline fills in (the target, paths, the device) extends it too: `GenerateJob` and
`RecordsJob` here, handed to the stage's tasks in the pipeline's process, and the job files a launched process
reads, `CaptureJobFile`, `TrainJobFile` and `EvalJobFile` (models/common/job_files.py). A flow builds a job from the
run config in one call (`StrictModel.pick`); a rank process reads its JSON job through the same class (`load_job`,
models/common/job_files.py), so an unknown key or a bad value in a job file fails with its name, and no default can
drift between the config and the job.

This module is the bottom layer: pydantic only (no torch, prefect or httpx), importable by
flows/, tasks/ and models/ alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from models.common.server_access import api_key_from_env, server_url
from settings.base import StrictModel

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
    """The serving engine of generate and the engine eval (tasks/serving/): sglang (its native /generate) or vllm (its
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


class VllmCaptureSettings(KeyFromEnv, StrictModel):
    """How the capture reaches a vLLM server that extracts hidden states (capture.backend: vllm; docs/kimi-k25.md).

    The server runs the target with `speculative_config.method = extract_hidden_states` and our connector
    (deploy/vllm-plugins/eagle3_hidden_states.py; vLLM's ExampleHiddenStatesConnector writes the same files), which
    writes one safetensors file per request into `shared_dir`; the capture sends each record's token ids to
    /v1/completions with max_tokens 1, reads the file the reply names, and deletes it once the shard holding the
    record is on disk.
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
