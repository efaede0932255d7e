"""The jobs of the stages that run in the pipeline's own process: `GenerateJob` (one dataset's generation) and
`RecordsJob` (how records are cut), handed to the stage's tasks as objects.

Each extends its section's settings (settings/generate.py, settings/dataset.py, settings/records.py) with what the
pipeline fills in; a flow builds it from the run config in one call (`StrictModel.pick`), so no default can drift
between the config and the job. The job files a launched process reads are models/common/job_files.py. Pydantic only
(no torch, prefect or httpx).
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import Field

from settings.dataset import DatasetGenerateSettings
from settings.generate import GenerateSettings
from settings.records import RecordSettings


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
