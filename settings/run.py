"""The whole run config, `RunConfig`: run_dir and the sections, each declared in its own module of settings/.

    run_dir        here
    target         settings/target.py       Target (also carried whole by every job file)
    server         settings/server.py       ServerConfig (ServerSettings)
    sampling       settings/sampling.py     SamplingConfig
    generate       settings/generate.py     GenerateConfig (GenerateSettings)
    records        settings/records.py      RecordsConfig (RecordSettings)
    capture        settings/capture.py      CaptureConfig (CaptureSettings, AuxLayers; launch: settings/launch.py),
                                            capture.engine: EngineConfig (VllmCaptureSettings)
    train          settings/train.py        TrainConfig (TrainSettings, HeldOut; launch: settings/launch.py)
    eval           settings/eval.py         EvalConfig (EvalSettings, ServedEvalSettings), eval.benchmarks[]
    distributed    settings/distributed.py  DistributedConfig (Nodes)
    datasets[]     settings/dataset.py      DatasetConfig (RowFormat, DatasetGenerateSettings)

A section's `*Settings` classes are what a stage's job carries (models/common/jobs.py, models/common/job_files.py);
tests/models/common/test_jobs.py keeps any setting from being declared twice. Unknown keys are rejected, so a misspelled
key fails before any GPU hour is spent. Reading a YAML file with every problem named: flows/config/file.py; the page
of every key: settings/keys.py (`make config-keys`).
"""

from __future__ import annotations

import re
from pathlib import Path

from pydantic import Field, model_validator

from settings.base import Section
from settings.capture import CaptureConfig
from settings.dataset import DatasetConfig
from settings.distributed import DistributedConfig
from settings.eval import EvalConfig
from settings.generate import GenerateConfig
from settings.hub_paths import is_hub_path
from settings.launch import LaunchConfig
from settings.layout import RUN_DRAFTS, RunLayout
from settings.records import RecordsConfig
from settings.sampling import SamplingConfig
from settings.server import ServerConfig
from settings.stages import Stage
from settings.target import Target
from settings.train import TrainConfig


class RunConfig(Section):
    """A whole run: where it lives, the target, the server, sampling, stage settings, the datasets."""

    run_dir: Path
    """Directory of this run (config, responses, records, hidden states, draft). Relative paths resolve against the
    config's base directory."""
    target: Target
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
