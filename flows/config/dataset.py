"""One input dataset of the run config (`datasets:` in the YAML): where its rows are and how to read them."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

from pydantic import field_validator, model_validator

from models.common.jobs import DatasetGenerateSettings
from settings.base import Section
from settings.hub_paths import hub_repo_id, is_hub_path
from settings.layout import RunLayout
from tasks.datasets.formats import RowFormat
from tasks.datasets.hub import HubDataset

DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class DatasetConfig(RowFormat, DatasetGenerateSettings, Section):
    """One input dataset: a file or directory of prompt rows (generate) or finished rows (passthrough).

    Its row format settings (format, roles, id_field, prompt_field, response_field, system_field) are RowFormat's,
    declared in tasks/datasets/formats.py; `row_format` hands them to the loader. What a generate dataset may spend
    (token_budget, max_prompts, max_in_flight, turns) is DatasetGenerateSettings', which its GenerateJob carries.
    """

    name: str
    """Unique name; used as the directory name under responses/, records/, rejects/."""
    kind: Literal["passthrough", "generate"]
    """`generate`: prompts sent to the target through SGLang. `passthrough`: rows that already hold the responses
    (`messages` with assistant turns, or `input_ids` + `loss_mask`)."""
    path: Path
    """JSONL file, Parquet file or directory, or a local Hugging Face `datasets` directory (save_to_disk). Relative
    paths resolve against the config's base directory. `hf:ORG/NAME`: a Hugging Face Hub dataset, read with
    `datasets` (split, config, revision below); the commit read is recorded in RUN_DIR/datasets/<name>.json and read
    again by every rerun."""
    split: str | None = None
    """`hf:` datasets: the split to read. Omitted: `train`."""
    config: str | None = None
    """`hf:` datasets: the dataset's config (subset) name, for a dataset that has several. Omitted: its default."""
    revision: str | None = None
    """`hf:` datasets: the branch, tag or commit to read. Omitted: the commit the run recorded in
    RUN_DIR/datasets/<name>.json, else the newest (main), which is then recorded."""
    on_bad_row: Literal["fail", "skip"] = "fail"
    """`fail`: a malformed row stops the run with its file and row. `skip`: the row and the reason go to
    RUN_DIR/rejects/<name>/ and the rest is used."""

    @field_validator("name")
    @classmethod
    def _name_is_a_directory_name(cls, value: str) -> str:
        if not DATASET_NAME.match(value):
            raise ValueError(
                f"{value!r} cannot be a directory name: use letters, digits, '_', '.', '-' "
                "and start with a letter or digit"
            )
        return value

    @field_validator("path", mode="before")
    @classmethod
    def _hub_path_has_its_form(cls, value: Any) -> Any:
        if isinstance(value, str | Path) and is_hub_path(value):
            hub_repo_id(value)  # ValueError naming the form; checked on the string, before Path folds '//'
        return value

    @model_validator(mode="after")
    def _hub_settings_only_for_hub_paths(self) -> DatasetConfig:
        given = [key for key in ("split", "config", "revision") if getattr(self, key) is not None]
        if given and not is_hub_path(self.path):
            raise ValueError(
                f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to Hub datasets only"
                f" (path: hf:ORG/NAME); {self.path} is a local path"
                " (remove them, or point path at the Hub dataset)"
            )
        return self

    @model_validator(mode="after")
    def _budget_only_for_generate(self) -> DatasetConfig:
        for key, unset in (("token_budget", None), ("max_in_flight", None), ("turns", "last")):
            if self.kind == "passthrough" and getattr(self, key) != unset:
                raise ValueError(
                    f"{key} applies to generate datasets only; a passthrough dataset already "
                    f"holds its responses (remove {key} or set kind: generate)"
                )
        if self.kind == "passthrough" and self.format == "columns" and self.response_field is None:
            raise ValueError(
                "format: columns needs response_field for a passthrough dataset (the column holding the "
                "response it trains on)"
            )
        return self

    @property
    def row_format(self) -> RowFormat:
        """This dataset's row format settings, what load_dataset and iter_rows take."""
        return RowFormat(**self.pick(RowFormat))

    def source(self, layout: RunLayout) -> Path | HubDataset:
        """What the loader reads: the path, or for `hf:` the Hub dataset with its settings and the run's record."""
        if not is_hub_path(self.path):
            return self.path
        return HubDataset(
            hub_repo_id(self.path),
            split=self.split or "train",
            config=self.config,
            revision=self.revision,
            record=layout.hub_record(self.name),
        )
