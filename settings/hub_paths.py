"""The form of a Hugging Face Hub path, `hf:ORG/NAME` (a dataset's or a benchmark's `path`), checked where declared.

Plain Python: the config sections (settings/dataset.py, settings/eval.py, settings/run.py) and the Hub reader
(tasks/datasets/hub.py) use it.
"""

from __future__ import annotations

import re
from pathlib import Path

HUB_PREFIX = "hf:"
HUB_FORM = "hf:ORG/NAME (a Hub dataset id, e.g. hf:HuggingFaceH4/ultrachat_200k; split, config, revision are settings)"
_NAME = r"[A-Za-z0-9][A-Za-z0-9._-]*"
_REPO_ID = re.compile(rf"{_NAME}/{_NAME}")


def is_hub_path(path: Path | str) -> bool:
    """Whether a dataset path names a Hub dataset (`hf:...`) rather than a file."""
    return str(path).startswith(HUB_PREFIX)


def hub_repo_id(path: Path | str) -> str:
    """ORG/NAME of `hf:ORG/NAME`; ValueError naming the form for anything else after `hf:`."""
    repo_id = str(path)[len(HUB_PREFIX) :]
    if not _REPO_ID.fullmatch(repo_id) or ".." in repo_id:
        hint = (
            "; a revision or split goes in the dataset's `revision:` / `split:`" if re.search("[@:]", repo_id) else ""
        )
        raise ValueError(f"{str(path)!r} is not a Hub dataset path: expected {HUB_FORM}{hint}")
    return repo_id
