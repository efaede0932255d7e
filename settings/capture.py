"""The `capture:` section and its `capture.engine`: how the target's hidden states are captured, each key once.

`CaptureSettings` (with `AuxLayers`, which the train job also carries) is what the capture's job file carries
(models/common/job_files.py `CaptureJobFile`); `VllmCaptureSettings` is what the vLLM capture reaches its server with.
`CaptureConfig` and `EngineConfig`, the sections, add the launch (settings/launch.py), the output directory and who
runs the vLLM server.
"""

from __future__ import annotations

from pathlib import Path
from typing import ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from settings.base import Section, StrictModel
from settings.launch import LaunchConfig
from settings.server import ApiKeyEnv, CommandWords, KeyFromEnv, OutageWindow, ServerUrl, check_command


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


class EngineConfig(VllmCaptureSettings, Section):
    """capture.backend: vllm: the vLLM server that extracts hidden states, and who runs it (docs/kimi-k25.md)."""

    launch: Literal["none", "dev", "command"] = "none"
    """Who runs the vLLM server during the capture stage. `none`: it is already running at `url`, started with the
    extraction config the capture logs (and docs/kimi-k25.md shows), deploy/vllm-plugins on its PYTHONPATH. `dev`:
    the built-in dev server emulates it on the target (tests). `command`: each attempt of the capture starts
    `command` (PYTHONPATH set for our connector), waits for /health, and stops it after; one that dies is restarted
    by the next attempt (capture.retries)."""
    command: CommandWords = None
    """launch: command: the vLLM command as a list of arguments; its log goes to RUN_DIR/logs/capture-server.log.
    Placeholders: {host}, {port} (from url), {speculative_config} and {kv_transfer_config} (the extraction config as
    JSON, with the layer ids and shared_dir this capture reads), {shared_dir}."""
    health_timeout_s: float = Field(default=3600.0, gt=0)
    """How long to wait for the server's /health at the start (a 1T model loads for many minutes)."""

    @model_validator(mode="after")
    def _command_for_launch(self) -> EngineConfig:
        check_command(
            self.launch,
            self.command,
            ENGINE_PLACEHOLDERS,
            "[vllm, serve, MODEL, --port, '{port}', --speculative-config, '{speculative_config}', "
            "--kv-transfer-config, '{kv_transfer_config}']",
        )
        return self


ENGINE_PLACEHOLDERS = ("host", "port", "speculative_config", "kv_transfer_config", "shared_dir")


class CaptureConfig(CaptureSettings, LaunchConfig):
    """The capture of the target's hidden states for every training record: a DeepSpeed job, or a vLLM server."""

    backend: Literal["deepspeed", "vllm"] = "deepspeed"
    """`deepspeed`: ranks run the HF target (mode, num_gpus, launcher; small and medium targets, the demo). `vllm`: a
    vLLM server running the target (INT4 Kimi-K2.5 on 8 GPUs needs no BF16 copy) extracts them; see `engine`. Both
    write the same shards, index and metadata."""
    engine: EngineConfig = Field(default_factory=EngineConfig)
    """backend: vllm: the server and how to reach it."""

    max_tokens: int | None = Field(default=None, ge=1)
    """Capture at most this many tokens in total (one way to fit a disk: the remaining records are not captured)."""
    out_dir: Path | None = None
    """Where the hidden states go; default RUN_DIR/hidden. Put it on a big disk."""
    disk_margin: float = Field(default=0.05, ge=0, lt=1)
    """Share of the free space kept free: the job must fit in the rest."""
