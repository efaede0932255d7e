"""One entry of `datasets:`: where a dataset's rows are, how to read them and what it may spend, each key once.

`RowFormat` holds the row format keys (format, roles, id_field, prompt_field, response_field, system_field), what every
loader of a dataset reads its rows through (tasks/datasets/formats.py `Shape`); `DatasetGenerateSettings` what a
generate dataset may spend, which its generate job carries (models/common/jobs.py `GenerateJob`). `DatasetConfig`, the
entry, composes them with the dataset's name, kind, path and Hub settings; the reader of its path is the caller's
(tasks/datasets/hub.py `dataset_source`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, StringConstraints, field_validator, model_validator

from settings.base import Section, StrictModel
from settings.hub_paths import hub_repo_id, is_hub_path

DATASET_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
FormatName = Literal["auto", "messages", "sharegpt", "alpaca", "columns", "ultrachat", "glaive"]
Role = Literal["system", "user", "assistant", "tool"]
FieldName = Annotated[str, StringConstraints(min_length=1)]  # a row's field or a table's column, by name


class RowFormat(StrictModel):
    """How a dataset's rows spell a conversation; every loader of a dataset reads its rows through it."""

    format: FormatName = "auto"
    """The rows' shape: `messages` (`messages` [{role, content}] or `prompt`; passthrough also `input_ids` +
    `loss_mask`), `sharegpt` (`conversations` [{from, value}]), `alpaca` (`instruction`, `input`, `output`),
    `columns` (prompt_field, response_field, system_field), `ultrachat` (`data` [user, assistant, ...]), `glaive`
    (`system` + `chat`, one string of USER:/ASSISTANT:/FUNCTION RESPONSE: turns). `auto`: detected from the columns
    (Parquet, Arrow) or the first row (JSONL), one format per dataset; an unknown or ambiguous shape is an error that
    says what to set."""
    roles: dict[str, Role] = Field(default_factory=dict)
    """Role names of the rows (`messages` role, ShareGPT `from`) mapped to system, user, assistant or tool, e.g. {bot:
    assistant}; on top of the built-in ones (human -> user; gpt, chatgpt, bing, bard, model -> assistant)."""
    id_field: FieldName = "id"
    """The field holding each row's id (string or int, kept as given); a row without one gets a hash of its messages."""
    prompt_field: FieldName | None = None
    """format: columns: the column holding the user turn (e.g. `problem`)."""
    response_field: FieldName | None = None
    """format: columns: the column holding the assistant turn (e.g. `solution`); needed for passthrough, cut for
    generate (the target answers instead)."""
    system_field: FieldName | None = None
    """format: columns: a column holding a system prompt; null or empty in a row: no system turn."""

    @model_validator(mode="after")
    def _columns_fields_with_format_columns(self) -> RowFormat:
        named = [k for k in ("prompt_field", "response_field", "system_field") if getattr(self, k) is not None]
        if self.format != "columns" and named:
            raise ValueError(
                f"{', '.join(named)} apply to format: columns only (this dataset has format: {self.format})"
            )
        if self.format == "columns" and self.prompt_field is None:
            raise ValueError("format: columns needs prompt_field (the column holding the user turn)")
        return self


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


class DatasetConfig(RowFormat, DatasetGenerateSettings, Section):
    """One input dataset: a file or directory of prompt rows (generate) or finished rows (passthrough).

    Its row format settings (format, roles, id_field, prompt_field, response_field, system_field) are RowFormat's,
    declared above; `row_format` hands them to the loader. What a generate dataset may spend
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
