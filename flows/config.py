"""Typed run config: the one place every setting of a run is declared and documented.

A config is YAML validated by pydantic v2 with unknown keys rejected, so a misspelled key fails
before any GPU hour is spent. `load_config` turns every problem into a `ConfigError` whose lines
name the file, the key path (`datasets[2].token_budget`) and what is expected.
"""

from __future__ import annotations

import difflib
import re
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class Section(BaseModel):
    """Base of every config section: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic takes true/false as 1/0 for an int or float, so `max_concurrency: true` would
        # quietly mean 1; every number field of every section (present and future) refuses them.
        problem = _bool_for_number(value, cls.model_fields[info.field_name].annotation)
        if problem:
            raise ValueError(problem)
        return value


class TargetConfig(Section):
    """The target model whose responses and hidden states the draft learns from."""

    path: str = Field(
        description="Hugging Face repo id or local directory of the target: its tokenizer and chat "
        "template build the prompts; its weights are loaded by the capture stage."
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Pass trust_remote_code=True to transformers (Kimi-K2.5's tokenizer needs it).",
    )
    build_tiny_target: bool = Field(
        default=False,
        description="Build the deterministic tiny demo target at `path` if it is not there yet "
        "(demo and tests only).",
    )


class ServerConfig(Section):
    """The SGLang server (or router) that the generate stage sends /generate requests to."""

    url: str = Field(
        default="http://127.0.0.1:30000",
        description="Base URL of SGLang's native HTTP API: scheme://host:port with no path (not .../generate, "
        "not .../v1). https is allowed; without a port the scheme's default (80, 443) is used, as behind a proxy.",
    )
    max_concurrency: int = Field(
        default=64,
        ge=1,
        le=4096,
        description="Most requests in flight to this server at once, over all datasets together.",
    )
    request_timeout_s: float = Field(
        default=1800.0,
        gt=0,
        description="Seconds one /generate request may take before it is cancelled and retried; "
        "long enough for max_new_tokens at the slowest expected decode speed.",
    )

    outage_window_s: float = Field(
        default=900.0,
        gt=0,
        description="How long the server may stay unreachable (connect errors, 5xx, 429) before "
        "the generate task fails cleanly; Prefect task retries then resume it.",
    )
    health_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="How long to wait for /health_generate at the start of the generate stage "
        "(a 1T model takes minutes to load).",
    )
    api_key_env: str | None = Field(
        default=None,
        description="Name of the environment variable holding the server's API key (sent as a "
        "Bearer token). The key itself never goes into the config, logs or artifacts.",
    )

    launch: Literal["none", "dev", "command"] = Field(
        default="none",
        description="Who runs the server during the generate stage. `none`: it is already running at `url`. "
        "`dev`: the pipeline starts the built-in dev server on the target (demo, tests). `command`: the pipeline "
        "starts `command` (e.g. SGLang's launch_server), waits for /health_generate, and stops it after generation, "
        "also on failure or cancellation, so the GPUs are free for capture and training.",
    )
    command: list[str] | None = Field(
        default=None,
        description="launch: command: the server command as a list of arguments; its log goes to RUN_DIR/logs/server.log.",
    )

    @field_validator("command", mode="before")
    @classmethod
    def _command_words(cls, value: Any) -> Any:
        # YAML reads `--tp, 8` as a number: every argument is a string on the command line anyway
        if isinstance(value, list):
            return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
        return value

    @model_validator(mode="after")
    def _command_for_launch(self) -> ServerConfig:
        if self.launch == "command" and not self.command:
            raise ValueError("launch: command needs `command` (e.g. [python, -m, sglang.launch_server, --model-path, ...])")
        return self

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        return _server_url(value)


class SamplingConfig(Section):
    """Sampling parameters sent with every /generate request (SGLang's `sampling_params`)."""

    max_new_tokens: int = Field(
        default=16384,
        ge=1,
        description="Most completion tokens per response. Set it explicitly: SGLang's own default "
        "is 128, which silently truncates reasoning responses.",
    )
    temperature: float = Field(default=1.0, ge=0, description="0 means greedy decoding.")
    top_p: float = Field(default=0.95, gt=0, le=1, description="Nucleus sampling mass.")
    top_k: int = Field(default=-1, ge=-1, description="-1 disables top-k filtering.")
    stop_token_ids: list[int] | None = Field(
        default=None,
        description="Token ids that end a response (kept in output_ids). Default: the target "
        "tokenizer's eos token.",
    )

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


class GenerateConfig(Section):
    """Checkpointing, progress and retries of the generate stage."""

    flush_every: int = Field(default=256, ge=1, description="Write a checkpoint part every this many responses.")
    flush_interval_s: float = Field(
        default=60.0, gt=0, description="...and at least this often (seconds): a kill loses at most this window."
    )
    log_interval_s: float = Field(
        default=30.0, gt=0, description="Seconds between progress log lines and progress-artifact updates."
    )
    throughput_window_s: float = Field(
        default=120.0, gt=0, description="Tokens/s and the ETA are measured over this recent window."
    )
    compact_min_parts: int = Field(
        default=64, ge=2, description="Merge small checkpoint parts once this many have been written."
    )
    retries: int = Field(
        default=3, ge=0, description="Prefect retries of a dataset task that failed (e.g. server outage)."
    )
    retry_delay_s: float = Field(
        default=60.0, ge=0, description="First delay before a retry; doubles each time, with jitter."
    )


class RecordsConfig(Section):
    """How responses and passthrough rows become training records (input_ids + loss_mask)."""

    max_seq_len: int | None = Field(
        default=8192, ge=16, description="Longest record in tokens; longer ones are cut or dropped (see overflow). null: no limit."
    )
    overflow: Literal["truncate", "drop"] = Field(
        default="truncate", description="`truncate`: keep the first max_seq_len tokens. `drop`: leave the record out."
    )
    min_loss_tokens: int = Field(
        default=1, ge=1, description="Records with fewer loss tokens than this are left out."
    )
    keep_truncated: bool = Field(
        default=False,
        description="Also train on responses that ended by length (cut off by max_new_tokens) or abort.",
    )
    on_rewrite: Literal["split", "reject"] = Field(
        default="split",
        description="Passthrough conversations whose chat template rewrites earlier turns (e.g. drops "
        "their reasoning): `split` makes one record per assistant turn, exactly as the model saw it; "
        "`reject` sends the row to rejects.",
    )


class CaptureConfig(Section):
    """The DeepSpeed job that captures the target's hidden states for every training record."""

    num_gpus: int = Field(
        default=8, ge=1, description="Ranks of the capture job: one per GPU (on a CPU-only machine, CPU processes)."
    )
    mode: Literal["replicate", "zero3"] = Field(
        default="replicate",
        description="`replicate`: every rank holds the whole target (data parallel; the target must "
        "fit one GPU). `zero3`: parameters partitioned over the ranks with DeepSpeed ZeRO-3 "
        "(targets larger than one GPU; see offload).",
    )
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = Field(
        default="auto", description="Dtype the target runs and the hidden states are stored in; auto: the checkpoint's."
    )
    aux_layers: list[int] | None = Field(
        default=None,
        description="0-based decoder layers whose outputs are captured; default [1, L//2-1, L-4] (EAGLE-3).",
    )
    max_batch_tokens: int = Field(default=16384, ge=1, description="Padded tokens per forward pass on one rank.")
    shard_tokens: int = Field(
        default=16384, ge=1, description="Tokens per safetensors shard (a kill loses at most one unfinished shard per rank)."
    )
    max_tokens: int | None = Field(
        default=None, ge=1, description="Capture at most this many tokens in total (one way to fit a disk: the remaining records are not captured)."
    )
    offload: Literal["none", "cpu", "nvme"] = Field(
        default="none", description="zero3 only: where partitioned parameters live between uses."
    )
    nvme_path: Path | None = Field(default=None, description="zero3 with offload: nvme: a fast local directory.")
    out_dir: Path | None = Field(
        default=None, description="Where the hidden states go; default RUN_DIR/hidden. Put it on a big disk."
    )
    disk_margin: float = Field(
        default=0.05, ge=0, lt=1, description="Share of the free space kept free: the job must fit in the rest."
    )
    launcher: Literal["auto", "torchrun", "deepspeed"] = Field(
        default="auto", description="auto: the deepspeed launcher on a CUDA machine, torchrun (gloo, DS_ACCELERATOR=cpu) otherwise."
    )
    retries: int = Field(
        default=2, ge=0, description="Prefect retries of a capture job whose rank crashed or was killed; a retry "
        "resumes (complete shards are skipped). A full disk, a damaged file or a refused job is not retried."
    )
    retry_delay_s: float = Field(default=60.0, ge=0, description="Seconds to wait before each retry of the capture job.")

    @model_validator(mode="after")
    def _nvme_needs_a_path(self) -> CaptureConfig:
        if self.offload == "nvme" and self.nvme_path is None:
            raise ValueError("offload: nvme needs nvme_path (a fast local directory for the parameters)")
        if self.offload != "none" and self.mode != "zero3":
            raise ValueError("offload applies to mode: zero3 only")
        return self


class TrainConfig(Section):
    """The DeepSpeed job that trains the EAGLE-3 draft (ZeRO-2, training-time test)."""

    num_gpus: int = Field(default=8, ge=1, description="Ranks of the training job: one per GPU (CPU processes on a CPU-only machine).")
    mode: Literal["offline", "online"] = Field(
        default="offline",
        description="`offline`: train on the captured hidden states (RUN_DIR/hidden). `online`: every rank runs the "
        "target itself on the records (no capture, no disk; only for a target that fits one device).",
    )
    launcher: Literal["auto", "torchrun", "deepspeed"] = Field(
        default="auto", description="auto: the deepspeed launcher on a CUDA machine, torchrun (gloo, DS_ACCELERATOR=cpu) otherwise."
    )
    precision: Literal["auto", "bf16", "fp32"] = Field(
        default="auto", description="auto: bf16 on GPUs (fp32 master weights in the optimizer), fp32 on CPU."
    )
    draft_vocab_size: int = Field(
        default=32000, ge=1,
        description="Tokens the draft can propose: the most frequent loss tokens of the records (capped by the target vocab).",
    )
    ttt_steps: int = Field(default=7, ge=1, le=16, description="Training-time-test steps unrolled per position (EAGLE-3: 7).")
    epochs: int = Field(default=1, ge=1, description="Passes over the training samples.")
    max_steps: int | None = Field(default=None, ge=1, description="Stop after this many optimizer steps (overrides epochs).")
    max_batch_tokens: int = Field(
        default=16384, ge=16, description="Padded tokens per micro batch on one rank; longer samples are cut to this length."
    )
    grad_accum: int = Field(default=1, ge=1, description="Micro batches per optimizer step on each rank.")
    lr: float = Field(default=1e-4, gt=0, description="Peak AdamW learning rate.")
    warmup_ratio: float = Field(default=0.015, ge=0, lt=1, description="Share of the steps with linear warmup; cosine decay after.")
    min_lr_ratio: float = Field(default=0.0, ge=0, le=1, description="Learning rate at the last step, as a share of lr.")
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay.")
    grad_clip: float = Field(default=0.5, gt=0, description="Gradient norm clipping (DeepSpeed gradient_clipping).")
    checkpoint_every: int = Field(default=500, ge=1, description="Optimizer steps between checkpoints (also one at the end).")
    keep_checkpoints: int = Field(default=2, ge=1, description="Complete checkpoints kept; older ones are deleted.")
    eval_every: int = Field(default=500, ge=1, description="Optimizer steps between evaluations on the held-out split (also one at the end).")
    eval_fraction: float = Field(
        default=0.02, ge=0, lt=1, description="Share of the samples held out (a stable hash of dataset and id): never trained on; "
        "the training eval and `eagle3 eval` use them."
    )
    log_every: int = Field(default=10, ge=1, description="Optimizer steps per metrics.jsonl / TensorBoard line.")
    seed: int = Field(default=0, description="Seed of the draft's initial weights and of the data order.")
    draft_overrides: dict[str, int | float] = Field(
        default_factory=dict,
        description="Draft shape settings that differ from the target's (head_dim, num_attention_heads, num_key_value_heads, "
        "intermediate_size, rope_theta, rms_norm_eps); e.g. head_dim: 128 for an MLA target.",
    )
    out_dir: Path | None = Field(default=None, description="Checkpoints, metrics and the exported draft; default RUN_DIR/draft.")
    retries: int = Field(
        default=2, ge=0, description="Prefect retries of a training job whose rank crashed or was killed; a retry resumes "
        "from the last checkpoint. A failed write, a checkpoint of other data or settings, or a refused job is not retried."
    )
    retry_delay_s: float = Field(default=60.0, ge=0, description="Seconds to wait before each retry of the training job.")

    @field_validator("draft_overrides")
    @classmethod
    def _known_overrides(cls, value: dict[str, int | float]) -> dict[str, int | float]:
        allowed = {"head_dim", "num_attention_heads", "num_key_value_heads", "intermediate_size", "rope_theta", "rms_norm_eps"}
        unknown = sorted(set(value) - allowed)
        if unknown:
            raise ValueError(f"unknown draft setting(s) {unknown}; allowed: {sorted(allowed)}")
        return value


class EvalConfig(Section):
    """`eagle3 eval`: speculative decoding with the HF target (greedy) and the exported draft on held-out prompts."""

    prompts: int = Field(default=32, ge=1, description="Held-out records whose prompts are decoded.")
    max_new_tokens: int = Field(default=128, ge=1, description="Tokens generated per prompt.")
    num_steps: int = Field(
        default=3, ge=1, le=16, description="Draft tokens per verify round (SGLang --speculative-num-steps; top-k 1, num-draft-tokens = this + 1)."
    )
    device: Literal["auto", "cpu", "cuda"] = Field(default="auto", description="Where the target and draft run; auto: cuda if available.")
    compare_untrained: bool = Field(
        default=True, description="Also measure the draft as training starts it (same seed, untrained): the baseline the trained one must beat."
    )


class DatasetConfig(Section):
    """One input dataset: a file or directory of prompt rows (generate) or finished rows (passthrough)."""

    name: str = Field(
        description="Unique name; used as the directory name under responses/, records/, rejects/."
    )
    kind: Literal["passthrough", "generate"] = Field(
        description="`generate`: prompts sent to the target through SGLang. `passthrough`: rows "
        "that already hold the responses (`messages` with assistant turns, or `input_ids` + "
        "`loss_mask`)."
    )
    path: Path = Field(
        description="JSONL file, Parquet file or directory, or a local Hugging Face `datasets` "
        "directory (save_to_disk). Relative paths resolve against the config's base directory."
    )
    token_budget: int | None = Field(
        default=None,
        ge=1,
        description="Generate datasets: stop once the server has spent this many completion "
        "tokens on this dataset. Omitted: no token limit.",
    )
    max_prompts: int | None = Field(
        default=None,
        ge=1,
        description="Use at most this many prompts of the dataset (in file order).",
    )
    on_bad_row: Literal["fail", "skip"] = Field(
        default="fail",
        description="`fail`: a malformed row stops the run with its file and row. `skip`: the row "
        "and the reason go to RUN_DIR/rejects/<name>/ and the rest is used.",
    )

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, value: str) -> str:
        if not DATASET_NAME.match(value):
            raise ValueError(
                f"{value!r} cannot be a directory name: use letters, digits, '_', '.', '-' "
                "and start with a letter or digit"
            )
        return value

    @model_validator(mode="after")
    def _budget_only_for_generate(self) -> DatasetConfig:
        if self.kind == "passthrough" and self.token_budget is not None:
            raise ValueError(
                "token_budget applies to generate datasets only; a passthrough dataset already "
                "holds its responses (remove token_budget or set kind: generate)"
            )
        return self


class RunConfig(Section):
    """A whole run: where it lives, the target, the server, sampling, stage settings, the datasets."""

    run_dir: Path = Field(
        description="Directory of this run (config, responses, records, hidden states, draft). "
        "Relative paths resolve against the config's base directory."
    )
    target: TargetConfig
    server: ServerConfig = Field(default_factory=ServerConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    generate: GenerateConfig = Field(default_factory=GenerateConfig)
    records: RecordsConfig = Field(default_factory=RecordsConfig)
    capture: CaptureConfig = Field(default_factory=CaptureConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    datasets: list[DatasetConfig] = Field(min_length=1, description="The input datasets, in order.")

    @model_validator(mode="after")
    def _unique_dataset_names(self) -> RunConfig:
        seen: set[str] = set()
        for dataset in self.datasets:
            if dataset.name in seen:
                raise ValueError(f"dataset name {dataset.name!r} is used twice; names must be unique")
            seen.add(dataset.name)
        return self

    def resolve_paths(self, base: Path) -> RunConfig:
        """Return a copy whose relative paths are made absolute against `base`."""
        out = self.model_copy(deep=True)
        out.run_dir = _absolute(out.run_dir, base)
        if out.capture.out_dir is not None:
            out.capture.out_dir = _absolute(out.capture.out_dir, base)
        if out.train.out_dir is not None:
            out.train.out_dir = _absolute(out.train.out_dir, base)
        if out.capture.nvme_path is not None:
            out.capture.nvme_path = _absolute(out.capture.nvme_path, base)
        for dataset in out.datasets:
            dataset.path = _absolute(dataset.path, base)
        if out.target.build_tiny_target or not _looks_like_hub_id(out.target.path):
            out.target.path = str(_absolute(Path(out.target.path), base))
        return out

    @property
    def hidden_dir(self) -> Path:
        """Where the capture stage writes hidden states."""
        return self.capture.out_dir or self.run_dir / "hidden"

    @property
    def draft_dir(self) -> Path:
        """Where the train stage writes checkpoints, metrics and the exported draft (final/)."""
        return self.train.out_dir or self.run_dir / "draft"

    def dataset(self, name: str) -> DatasetConfig:
        """The dataset called `name`; KeyError lists the names there are."""
        for dataset in self.datasets:
            if dataset.name == name:
                return dataset
        raise KeyError(f"no dataset {name!r} in this config (there are: {', '.join(d.name for d in self.datasets)})")


class ConfigError(ValueError):
    """A config that cannot be used; `problems` holds one line per problem."""

    def __init__(self, source: str, problems: list[str]):
        self.source = source
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source}: invalid config ({len(problems)} problem(s)):\n{lines}")


def load_config(path: str | Path, base: Path | None = None) -> RunConfig:
    """Read, validate and resolve a YAML run config; raise ConfigError naming every problem."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(str(path), [f"no such file {str(path)!r} (give the path of a YAML run config)"])
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(str(path), [f"not UTF-8 text ({exc})"]) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = getattr(exc, "problem", None) or str(exc)
        raise ConfigError(str(path), [f"{where}YAML syntax error: {problem}"]) from None
    return parse_config(data, source=str(path), base=base if base is not None else Path.cwd())


def parse_config(data: Any, *, source: str = "<config>", base: Path | None = None) -> RunConfig:
    """Validate an already-parsed mapping; relative paths resolve against `base` (default cwd)."""
    if not isinstance(data, dict):
        raise ConfigError(source, [f"the top level must be a mapping of keys (run_dir, target, ...), got {type(data).__name__}"])
    try:
        config = RunConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(source, [_describe(err) for err in exc.errors()]) from None
    config = config.resolve_paths(base if base is not None else Path.cwd())
    problems = _directory_problems(config)
    if problems:
        raise ConfigError(source, problems)
    return config


def dump_config(config: RunConfig) -> str:
    """The config as YAML, the form saved as RUN_DIR/config.yaml."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)


def save_run_config(config: RunConfig) -> Path:
    """RUN_DIR/config.yaml: the config as run, paths resolved (names of secrets only, never values)."""
    config.run_dir.mkdir(parents=True, exist_ok=True)
    path = config.run_dir / "config.yaml"
    tmp = path.with_suffix(".yaml.tmp")
    try:
        tmp.write_text(dump_config(config))
        tmp.replace(path)
    except OSError as exc:  # the first write of every stage: a full disk shows here first
        tmp.unlink(missing_ok=True)
        from models.write_failure import WriteFailed

        raise WriteFailed(path, exc, kept="everything the run wrote before", resume="free space there, then run the same command again") from None
    return path


def _describe(err: dict[str, Any]) -> str:
    """One line for one pydantic error: key path, what is wrong, what is expected."""
    loc = err["loc"]
    key = _key_path(loc)
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(loc[:-1])
        hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
        suggestion = f"did you mean {hint[0]!r}? " if hint else ""
        return f"{key}: unknown key; {suggestion}allowed keys here: {', '.join(allowed)}"
    if err["type"] == "missing":
        return f"{key}: required key is missing"
    message = err["msg"].removeprefix("Value error, ")
    value = err.get("input")
    shown = "" if isinstance(value, (dict, list)) or value is None else f" (got {value!r})"
    return f"{key or '<top level>'}: {message}{shown}"


def _key_path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _allowed_keys(loc: tuple[Any, ...]) -> list[str]:
    """Field names of the section at `loc` (for 'did you mean')."""
    model: type[BaseModel] = RunConfig
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(str(part))
        if field is None:
            return []
        annotation = field.annotation
        inner = getattr(annotation, "__args__", None)
        candidates = [annotation, *(inner or [])]
        model = next((c for c in candidates if isinstance(c, type) and issubclass(c, BaseModel)), None)
        if model is None:
            return []
    return list(model.model_fields)


SERVER_URL_FORM = "scheme://host:port, e.g. http://127.0.0.1:30000"
_NETLOC = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\[\]@]+)(?::(?P<port>[^:]*))?")


def _server_url(value: str) -> str:
    """`value` as scheme://host[:port] without a trailing slash; ValueError showing the right form."""
    parts = urlsplit(value)
    if "@" in parts.netloc:
        # Credentials in the URL would end up in logs and RUN_DIR/config.yaml.
        raise ValueError(
            f"must not hold a user or password; the form is {SERVER_URL_FORM}"
            " (put the API key in the environment variable named by server.api_key_env)"
        )
    netloc = _NETLOC.fullmatch(parts.netloc)
    if parts.scheme not in ("http", "https") or netloc is None or re.search(r"\s", value):
        raise ValueError(f"must be an http(s) URL of the form {SERVER_URL_FORM}")
    port = netloc["port"]
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not a number from 1 to 65535; the form is {SERVER_URL_FORM}")
    base = f"{parts.scheme}://{parts.netloc}"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        # The client appends /generate, /health_generate and /abort_request to this base itself.
        raise ValueError(
            f"must be the server's base URL, scheme://host:port with no path: use {base!r}"
            " (SGLang's native API is at the root; the pipeline adds /generate itself)"
        )
    return base


def _union_members(annotation: Any) -> tuple[Any, ...]:
    if get_origin(annotation) in (Union, types.UnionType):
        return get_args(annotation)
    return (annotation,)


def _bool_for_number(value: Any, annotation: Any) -> str | None:
    """Why `value` holds a bool where `annotation` wants a number (also inside lists and dicts), or None."""
    members = _union_members(annotation)
    if isinstance(value, bool):
        if bool in members or not {int, float} & set(members):
            return None
        number = "a number" if float in members else "a whole number"
        return f"must be {number}, not true/false"
    for member in members:
        origin = get_origin(member)
        if origin is list and isinstance(value, list):
            (item,) = get_args(member)
            for i, v in enumerate(value):
                problem = _bool_for_number(v, item)
                if problem:
                    return f"item {i} {problem} (got {v!r})"
        elif origin is dict and isinstance(value, dict):
            item = get_args(member)[1]
            for k, v in value.items():
                problem = _bool_for_number(v, item)
                if problem:
                    return f"{k!r} {problem} (got {v!r})"
    return None


def _directory_problems(config: RunConfig) -> list[str]:
    """One line per directory setting that names a file (or lies under one): it could never be created."""
    problems = []
    settings = {
        "run_dir": config.run_dir,
        "capture.out_dir": config.capture.out_dir,
        "capture.nvme_path": config.capture.nvme_path,
        "train.out_dir": config.train.out_dir,
    }
    for key, path in settings.items():
        if path is None:
            continue
        existing = next((p for p in (path, *path.parents) if p.exists() or p.is_symlink()), None)
        if existing is None or existing.is_dir():
            continue
        if existing == path:
            problems.append(
                f"{key}: {path} exists and is not a directory; it must be a directory or absent"
                " (point it at a new or existing directory, or move the file away)"
            )
        else:
            problems.append(
                f"{key}: {path} cannot be a directory because {existing} is a file;"
                " it must be a directory or absent (point it elsewhere)"
            )
    return problems


def _absolute(path: Path, base: Path) -> Path:
    path = path.expanduser()
    return path if path.is_absolute() else (base / path)


def _looks_like_hub_id(value: str) -> bool:
    """`org/name` with no local directory of that name is a Hub id, not a relative path."""
    if value.startswith((".", "/", "~")) or Path(value).exists():
        return False
    return bool(re.fullmatch(r"[\w-][\w.-]*/[\w.-]+", value))
