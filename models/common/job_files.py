"""The job files: what a stage writes as JOB.json for the process it launches, which reads it back (`load_job`).

A capture launch (DeepSpeed ranks), a training launch (DeepSpeed ranks) and an eval launch (one process) each read
one. Each extends its stage's settings (settings/capture.py, settings/train.py, settings/eval.py) with what the
pipeline fills in: the target, paths, the device. The generate and records stages run in the pipeline's process and
write no job file: their settings go to their tasks as `GenerateJob`/`RecordsJob` objects (models/common/jobs.py).
Pydantic only: no torch, prefect or httpx.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TypeVar

from pydantic import Field, ValidationError, field_validator, model_validator

from settings.base import StrictModel
from settings.capture import AuxLayers, CaptureSettings
from settings.eval import EvalSettings
from settings.target import Target
from settings.train import HeldOut, TrainSettings

if TYPE_CHECKING:  # a rank process reads its job file without the whole run config
    from settings.run import RunConfig

J = TypeVar("J", bound="JobFile")


def load_job(cls: type[J], path: str | Path) -> J:
    """A JSON job file read through its spec; ValueError naming the file and every bad key."""
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: cannot read the {cls.__name__}: {e}") from e
    try:
        return cls.model_validate(raw)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<top level>'}: {err['msg']}" for err in e.errors())
        raise ValueError(f"{path}: not a valid {cls.__name__}: {problems}") from None


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


def dataset_records(config: RunConfig) -> list[DatasetRecords]:
    """Every dataset's records directory (RUN_DIR/records/<name>), as the capture, train and eval jobs name them."""
    return [DatasetRecords(name=d.name, records_dir=str(config.layout.records(d.name))) for d in config.datasets]


class JobFile(StrictModel):
    """Base of every job file: what the pipeline writes for a process it launches, read back with `load`."""

    target: Target
    """The run config's `target` section, whole: the process loads job.target.path, trusting its code as
    job.target.trust_remote_code says."""

    @classmethod
    def load(cls: type[J], path: str | Path) -> J:
        """This job file read from its JSON (`load_job`)."""
        return load_job(cls, path)


class RankJob(JobFile):
    """What every DeepSpeed rank job names: the target, and the device its ranks run on."""

    device: Literal["cpu", "cuda"] = "cuda"
    """cuda under the deepspeed launcher, cpu (gloo) otherwise."""


class CaptureJobFile(CaptureSettings, RecordsRef, RankJob):
    """The JOB.json a capture launch reads (written by the capture task)."""

    out_dir: str
    """Shards + index.parquet go here (RUN_DIR/hidden)."""
    launch_tokens: int | None = Field(ge=0)
    """Most tokens THIS launch captures: capture.max_tokens less what complete shards hold (null: no cap). Always stated
    by the task: no default."""


class TrainJobFile(TrainSettings, AuxLayers, RecordsRef, RankJob):
    """The JOB.json a training launch reads (written by the train task)."""

    out_dir: str
    """RUN_DIR/draft: checkpoints, metrics, the export."""
    token_counts: str
    """RUN_DIR/records/token_counts.parquet (the draft vocabulary)."""
    hidden_dir: str | None = None
    """offline: the capture shards (online: `datasets`, the records)."""

    @model_validator(mode="after")
    def _data_for_the_mode(self) -> TrainJobFile:
        if self.mode == "offline" and not self.hidden_dir:
            raise ValueError("mode offline needs hidden_dir")
        if self.mode == "online" and not self.datasets:
            raise ValueError("mode online needs datasets")
        return self

    @property
    def bf16(self) -> bool:
        """Whether the draft trains in bf16: `precision`, with auto meaning bf16 on GPUs."""
        return self.precision == "bf16" or (self.precision == "auto" and self.device == "cuda")


class EvalJobFile(EvalSettings, HeldOut, RecordsRef, JobFile):
    """The JOB.json of an eval launch (written by the eval task): held-out prompts come from `datasets`."""

    draft_dir: str
    """The export: config.json + model.safetensors."""
    out: str
    """Where the result JSON goes."""
