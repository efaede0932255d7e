"""The reader of a Hugging Face Hub dataset (`path: hf:ORG/NAME`): one snapshot of the repo, the commit it is recorded
in the run, its split read with `datasets`.

huggingface_hub's `snapshot_download` resolves the revision to a commit and fetches the repo into the Hub cache (with
HF_HUB_OFFLINE=1 it only looks in the cache: refs/<revision> or snapshots/<commit>), and `datasets.load_dataset` reads
the snapshot directory (its data files, and the configs and splits its README declares). `datasets` is not asked for
the Hub id itself: offline, it refuses a Hub id before looking at the Hub cache (datasets 5.x `dataset_module_factory`
raises OfflineModeIsEnabled and falls back only to its own cache of an earlier load).

The commit read is written to the run's record (RUN_DIR/datasets/<name>.json) by the first load and read back by
every later one, so a rerun reads the same rows even after the repo moved on; a `revision` setting wins over it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from settings.dataset import DatasetConfig
from settings.hub_paths import HUB_PREFIX, hub_repo_id, is_hub_path
from settings.layout import RunLayout
from tasks.datasets.errors import DatasetError, DatasetNotFoundError
from tasks.datasets.raw import Raw, SelectColumns

_BATCH_ROWS = 1024


@dataclass(frozen=True)
class HubDataset:
    """A Hub dataset as a run reads it: repo, config, split, pinned revision, and where the commit read is recorded."""

    repo_id: str
    split: str = "train"
    config: str | None = None
    revision: str | None = None  # the dataset's `revision` setting; None: the record's, else main
    record: Path | None = None  # RUN_DIR/datasets/<name>.json; None (a sample, a check) records nothing
    cache_only: bool = False  # read the local Hub cache only, never download (a check that must take seconds)

    @property
    def path(self) -> Path:
        """The dataset's `path` (hf:ORG/NAME), what errors and LoadedDataset name it by."""
        return Path(HUB_PREFIX + self.repo_id)

    def for_a_check(self) -> HubDataset:
        """The revision the run reads (its setting, else the run's record), from the local cache only, recording
        nothing: what `eagle3 doctor` samples. DatasetError for a record that cannot be read."""
        revision, _ = _revision_to_read(self)
        return replace(self, revision=revision, record=None, cache_only=True)


def dataset_source(dataset: DatasetConfig, layout: RunLayout) -> Path | HubDataset:
    """What the loader reads for a dataset of the run config: its path, or for `hf:` the Hub dataset with its settings
    and the run's record."""
    if not is_hub_path(dataset.path):
        return dataset.path
    return HubDataset(
        hub_repo_id(dataset.path),
        split=dataset.split or "train",
        config=dataset.config,
        revision=dataset.revision,
        record=layout.hub_record(dataset.name),
    )


def read_hub(source: HubDataset, select: SelectColumns) -> Iterator[Raw]:
    """Rows of the dataset's split at the pinned, recorded or newest commit; the record is written before the first
    row, the columns checked too."""
    revision, recorded = _revision_to_read(source)
    commit, snapshot = _snapshot(source, revision, recorded)
    dataset = _load_split(source, snapshot, commit)
    columns = select(source.path, dataset.features.arrow_schema)
    if source.record is not None:
        _write_record(source, commit)
    return _hub_rows(source.path, dataset, columns)


def _hub_rows(label: Path, dataset: Any, columns: list[str]) -> Iterator[Raw]:
    row = 0
    for table in dataset.select_columns(columns).with_format("arrow").iter(batch_size=_BATCH_ROWS):
        for data in table.to_pylist():
            row += 1
            yield Raw(label, row, "row", data=data)


def _revision_to_read(source: HubDataset) -> tuple[str | None, bool]:
    """The revision to ask for, and whether it is the record's (for the error when it is not in the cache)."""
    if source.revision is not None:
        return source.revision, False
    if source.record is None or not source.record.is_file():
        return None, False
    try:
        record = json.loads(source.record.read_text(encoding="utf-8"))
        same = (record["repo"], record.get("config"), record.get("split")) == (
            source.repo_id,
            source.config,
            source.split,
        )
        commit = str(record["revision"])
    except (ValueError, KeyError, TypeError) as e:
        raise DatasetError(
            source.record,
            None,
            f"is not a Hub dataset record ({e})",
            expected=f"delete it to read {source.path} at its newest revision (and record that one)",
        ) from None
    # A record of another repo, config or split (the config changed since) pins nothing: that read starts afresh.
    return (commit, True) if same else (None, False)


def _snapshot(source: HubDataset, revision: str | None, recorded: bool) -> tuple[str, Path]:
    """The commit and the local snapshot directory of the repo at `revision` (None: main), fetched if online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import (
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    try:
        # cache_only, or HF_HUB_OFFLINE set (which the library reads itself): the cache's refs/ and snapshots/ only
        local = source.cache_only
        snapshot = Path(
            snapshot_download(source.repo_id, repo_type="dataset", revision=revision, local_files_only=local)
        )
    except LocalEntryNotFoundError as e:
        offline = hub_offline()
        at = f"revision {revision}" if revision else "its main revision"
        if recorded:
            at += f" (recorded in {source.record} by the run's first load, so that a rerun reads the same rows)"
        where = (
            "is not in the local Hugging Face cache and HF_HUB_OFFLINE is set"
            if offline
            else "is not in the local Hugging Face cache (a check reads the cache only)"
            if source.cache_only
            else f"cannot be read ({e})"
        )
        fix = (
            f"download it on a machine with network: hf download --repo-type dataset {source.repo_id}"
            + (f" --revision {revision}" if revision else "")
            + " (into the same HF_HOME / HF_HUB_CACHE)"
        )
        if recorded:
            fix += f", or delete {source.record} to read the newest revision in the cache (other rows, perhaps)"
        raise DatasetNotFoundError(source.path, None, f"{at} {where}", expected=fix) from None
    except (RepositoryNotFoundError, RevisionNotFoundError) as e:
        raise DatasetNotFoundError(
            source.path,
            None,
            f"not found on the Hub ({type(e).__name__})",
            expected="check the ORG/NAME after hf: and the revision; a gated or private dataset needs HF_TOKEN",
        ) from None
    except HfHubHTTPError as e:
        raise DatasetError(source.path, None, f"could not be downloaded ({e})") from None
    return snapshot.name, snapshot  # snapshots/<commit>


def _load_split(source: HubDataset, snapshot: Path, commit: str) -> Any:
    try:
        import datasets
    except ImportError:
        raise DatasetError(
            source.path,
            None,
            "needs the `datasets` library to read a Hub dataset",
            expected="pip install datasets (or point the path at a local file)",
        ) from None
    try:
        return datasets.load_dataset(str(snapshot), source.config, split=source.split)
    except ValueError as e:  # an unknown config or split: datasets lists the ones there are
        raise DatasetError(
            source.path, None, f"at commit {commit}: {e}", expected="set the dataset's split / config to one it has"
        ) from None
    except (FileNotFoundError, datasets.exceptions.DatasetGenerationError) as e:
        cause = f": {e.__cause__}" if e.__cause__ else ""  # the generation error's cause says which file, and why
        raise DatasetError(
            source.path, None, f"at commit {commit} could not be read by datasets ({e}{cause})"
        ) from None


def _write_record(source: HubDataset, commit: str) -> None:
    assert source.record is not None
    record = {"repo": source.repo_id, "config": source.config, "split": source.split, "revision": commit}
    text = json.dumps(record, indent=2) + "\n"
    if source.record.is_file() and source.record.read_text(encoding="utf-8") == text:
        return
    source.record.parent.mkdir(parents=True, exist_ok=True)
    tmp = source.record.with_name(source.record.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, source.record)


def hub_offline() -> bool:
    """Whether HF_HUB_OFFLINE is set (as huggingface_hub read it): a dataset not in the cache cannot be fetched."""
    from huggingface_hub import constants

    return bool(constants.HF_HUB_OFFLINE)
