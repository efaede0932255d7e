"""The run directory's layout: every path under RUN_DIR, and the output directories settings may move out of it.

    RUN_DIR/config.yaml                     the resolved config, as run
    RUN_DIR/.lock                           held by the one process writing the run dir (tasks/runtime/run_lock.py)
    RUN_DIR/generated-by.json               the engine and target that made the responses (tasks/generate/provenance.py)
    RUN_DIR/responses/<dataset>/            generation checkpoints (part-*.parquet)
    RUN_DIR/rejects/<dataset>/              prompts and rows that cannot succeed, with the reason
    RUN_DIR/passthrough/<dataset>/          passthrough rows, validated and copied in
    RUN_DIR/records/<dataset>/              training records
    RUN_DIR/records/token_counts.parquet    loss-token frequencies, for the draft vocabulary
    RUN_DIR/datasets/<dataset>.json         a Hub dataset's repo, config, split and the commit the run reads
    RUN_DIR/quarantine/                     damaged parts, moved aside by hand as the error says
    RUN_DIR/jobs/<stage>.json               the job the ranks of capture, train and eval read
    RUN_DIR/logs/                           the launched servers' output
    RUN_DIR/hidden/      (capture.out_dir)  capture shards, index.parquet, metadata.json (models/capture/shards.py)
    RUN_DIR/engine/      (capture.engine.shared_dir)  the vLLM connector's per-request files
    RUN_DIR/draft/       (train.out_dir)    checkpoints/, final/, best/, metrics.jsonl, train_summary.json, ...

Everything else asks a `RunLayout` (RunConfig.layout in a flow) for a path. The train ranks know only their
job's out_dir, so they join the names of the draft directory's entries (CHECKPOINTS, FINAL, ...) to it.
File names inside a stage's own format (shard names, index.parquet, part-*.parquet, the export's files,
the launchers' log names) stay with the module that writes that format.

Plain Python: the run config (`RunConfig.layout`), flows, tasks and the rank processes use it.
"""

from __future__ import annotations

import hashlib
from dataclasses import KW_ONLY, dataclass
from pathlib import Path
from typing import Literal, overload

LOCK_NAME = ".lock"  # the write lock, in RUN_DIR and in each output directory outside it (tasks/runtime/run_lock.py)

# Entries of the draft directory, which the train ranks write into their job's out_dir.
CHECKPOINTS = "checkpoints"
FINAL = "final"
BEST = "best"
RUN_DRAFTS = (FINAL, BEST)  # the train stage's own exports, as eval.draft and --draft name them
BEST_MARKER = "best.json"  # in best/: the step, epoch, acceptance length and loss of its eval
METRICS = "metrics.jsonl"
TRAIN_SUMMARY = "train_summary.json"
EVAL_REPORT = "eval.json"
EVAL_RAW = ".eval-raw.json"
TRAINING_PLOT = "training.png"
DS_CONFIG = "ds_config.json"
TENSORBOARD = "tensorboard"


class _Entry:
    """One entry of a layout directory, read as a property: `layout.metrics` is `layout.draft_dir / "metrics.jsonl"`."""

    def __init__(self, directory: str, name: str, doc: str) -> None:
        self.directory, self.name, self.__doc__ = directory, name, doc

    @overload
    def __get__(self, layout: None, owner: type) -> _Entry: ...
    @overload
    def __get__(self, layout: RunLayout, owner: type) -> Path: ...
    def __get__(self, layout: RunLayout | None, owner: type) -> Path | _Entry:
        return self if layout is None else getattr(layout, self.directory) / self.name


@dataclass(frozen=True, init=False)  # the __init__ below: a field given as None is set, never left None
class RunLayout:
    """Where everything of one run lives: RUN_DIR's entries, and hidden/, engine/, draft/ where settings move them."""

    run_dir: Path
    _: KW_ONLY
    hidden_dir: Path
    """capture.out_dir, else RUN_DIR/hidden: the capture's shards, index.parquet and metadata.json."""
    draft_dir: Path
    """train.out_dir, else RUN_DIR/draft: the train stage's checkpoints, metrics and exported draft."""
    engine_dir: Path
    """capture.engine.shared_dir, else RUN_DIR/engine: the vLLM connector's request files (capture.backend: vllm)."""

    def __init__(
        self,
        run_dir: Path | str,
        *,
        hidden_dir: Path | str | None = None,
        draft_dir: Path | str | None = None,
        engine_dir: Path | str | None = None,
    ) -> None:  # an unset output directory is the one inside RUN_DIR
        run_dir = Path(run_dir)
        object.__setattr__(self, "run_dir", run_dir)
        object.__setattr__(self, "hidden_dir", run_dir / "hidden" if hidden_dir is None else Path(hidden_dir))
        object.__setattr__(self, "draft_dir", run_dir / "draft" if draft_dir is None else Path(draft_dir))
        object.__setattr__(self, "engine_dir", run_dir / "engine" if engine_dir is None else Path(engine_dir))

    @classmethod
    def of_dataset_dir(cls, directory: Path) -> RunLayout:
        """The layout of the run whose RUN_DIR/<responses|rejects|records|passthrough>/<dataset> is `directory`."""
        return cls(Path(directory).parent.parent)

    # entries of RUN_DIR
    config = _Entry(
        "run_dir",
        "config.yaml",
        "RUN_DIR/config.yaml: the resolved config, as run (flows/config/file.py save_run_config).",
    )
    demo_config = _Entry(
        "run_dir",
        "demo-config.yaml",
        "RUN_DIR/demo-config.yaml: the resolved demo config, the input of `eagle3 demo`'s pipeline flow.",
    )
    lock = _Entry("run_dir", LOCK_NAME, "RUN_DIR/.lock: held by the one process writing the run directory.")
    generated_by = _Entry(
        "run_dir",
        "generated-by.json",
        "RUN_DIR/generated-by.json: the engine and target that made the responses, written by the first generate and "
        "checked by every later one (tasks/generate/provenance.py).",
    )
    responses_root = _Entry(
        "run_dir", "responses", "RUN_DIR/responses: a directory per dataset of generation checkpoints."
    )
    rejects_root = _Entry(
        "run_dir", "rejects", "RUN_DIR/rejects: a directory per dataset of the prompts and rows that cannot succeed."
    )
    records_root = _Entry(
        "run_dir", "records", "RUN_DIR/records: a directory per dataset of training records, and the token counts."
    )
    token_counts = _Entry(
        "records_root",
        "token_counts.parquet",
        "RUN_DIR/records/token_counts.parquet: loss-token frequencies over every dataset, for the draft vocabulary.",
    )
    logs = _Entry(
        "run_dir",
        "logs",
        "RUN_DIR/logs: the output of the servers the stages launch (names: tasks/serving/launch.py and the launchers).",
    )
    # entries of the draft directory
    checkpoints = _Entry(
        "draft_dir",
        CHECKPOINTS,
        "draft/checkpoints: the train stage's DeepSpeed checkpoints "
        "(step-NNNNNNNN/, latest; models/train/checkpoint.py).",
    )
    final = _Entry(
        "draft_dir", FINAL, "draft/final: the exported draft SGLang and vLLM load (config.json, model.safetensors)."
    )
    best = _Entry(
        "draft_dir",
        BEST,
        "draft/best: the draft of the best held-out eval, exported like final/, with best.json (models/train/best.py).",
    )
    metrics = _Entry(
        "draft_dir", METRICS, "draft/metrics.jsonl: one line per training log interval and per held-out eval."
    )
    train_summary = _Entry(
        "draft_dir", TRAIN_SUMMARY, "draft/train_summary.json: the last and the best eval, where each draft is."
    )
    eval_report = _Entry(
        "draft_dir",
        EVAL_REPORT,
        "draft/eval.json: the eval stage's result, each backend's acceptance length beside the estimates.",
    )
    eval_raw = _Entry(
        "draft_dir",
        EVAL_RAW,
        "draft/.eval-raw.json: the HF eval job's own result, before the eval stage folds it into eval.json.",
    )
    training_plot = _Entry(
        "draft_dir", TRAINING_PLOT, "draft/training.png: the training report's plot of metrics.jsonl."
    )
    ds_config = _Entry("draft_dir", DS_CONFIG, "draft/ds_config.json: the DeepSpeed config the training ran with.")
    tensorboard = _Entry("draft_dir", TENSORBOARD, "draft/tensorboard: metrics.jsonl's scalars as TensorBoard events.")

    # a directory per dataset, per stage
    def responses(self, dataset: str) -> Path:
        """RUN_DIR/responses/<dataset>: its generation checkpoints (part-*.parquet)."""
        return self.responses_root / dataset

    def rejects(self, dataset: str) -> Path:
        """RUN_DIR/rejects/<dataset>: its rejected prompts and rows, each with the reason
        (tasks/responses/rejects.py)."""
        return self.rejects_root / dataset

    def passthrough(self, dataset: str) -> Path:
        """RUN_DIR/passthrough/<dataset>: a passthrough dataset's rows, validated and copied into the run."""
        return self.run_dir / "passthrough" / dataset

    def records(self, dataset: str) -> Path:
        """RUN_DIR/records/<dataset>: its training records (input_ids, loss_mask)."""
        return self.records_root / dataset

    def hub_record(self, dataset: str) -> Path:
        """RUN_DIR/datasets/<dataset>.json: a Hub dataset's repo, config, split and the commit the run reads (written by
        the first load, read by every later one; tasks/datasets/hub.py)."""
        return self.run_dir / "datasets" / f"{dataset}.json"

    def quarantine(self, directory: Path) -> Path:
        """RUN_DIR/quarantine/<directory's path under RUN_DIR>: where a damaged part of `directory` is moved aside."""
        root = self.run_dir / "quarantine"
        try:
            return root / Path(directory).relative_to(self.run_dir)
        except ValueError:  # not under RUN_DIR
            return root

    def exported_as(self, fmt: str) -> Path:
        """draft/<fmt>: `eagle3 export`'s default output, the draft written in format `fmt` (sglang, speculators)."""
        return self.draft_dir / fmt

    def eval_of(self, draft: str) -> tuple[Path, Path, Path]:
        """(the draft, its eval.json, the HF eval job's raw result) for eval.draft `draft`: `final` and `best` are
        the train stage's exports, reported in draft/eval.json; any other value is a draft directory, reported in
        RUN_DIR/evals/<its name>-<8 hex digits of its resolved path>/, so that two drafts of the same name (two
        trainers' `final`) keep a report each."""
        if draft in RUN_DRAFTS:
            return self.draft_dir / draft, self.eval_report, self.eval_raw
        where = Path(draft).resolve()
        tag = hashlib.sha256(str(where).encode("utf-8", "surrogateescape")).hexdigest()[:8]
        folder = self.run_dir / "evals" / f"{where.name}-{tag}"
        return Path(draft), folder / EVAL_REPORT, folder / EVAL_RAW

    def benchmark_rows(self) -> Path:
        """RUN_DIR/jobs/benchmarks: the rows of each `hf:` eval benchmark (<name>.jsonl), read from the Hub cache and
        written beside the eval job that names them (tasks/eval/benchmarks.py)."""
        return self.run_dir / "jobs" / "benchmarks"

    def job(self, stage: Literal["capture", "train", "eval"]) -> Path:
        """RUN_DIR/jobs/<stage>.json: the job the stage's ranks read (on every node)."""
        return self.run_dir / "jobs" / f"{stage}.json"
