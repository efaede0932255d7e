"""A hand-made, offline Hugging Face Hub cache for tests of Hub datasets (`path: hf:ORG/NAME`)."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest


def offline_hub_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty, offline Hub cache under tmp_path: the environment and the constants the libraries read at import."""
    import datasets
    import huggingface_hub.constants

    home = tmp_path / "hf"
    hub = home / "hub"
    hub.mkdir(parents=True)
    for key, value in {"HF_HOME": home, "HF_HUB_CACHE": hub, "HF_DATASETS_CACHE": home / "datasets"}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(hub))
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", home / "datasets")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    return hub


def publish(hub: Path, commit: str, rows: list[dict], *, repo: str = "org/chats", main: bool = True, split="train"):
    """A commit of a dataset repo as the Hub cache holds it: snapshots/<commit>/data/<split>-*.parquet, refs/main."""
    org, name = repo.split("/")
    root = hub / f"datasets--{org}--{name}"
    data = root / "snapshots" / commit / "data"
    data.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), data / f"{split}-00000-of-00001.parquet")
    if main:
        (root / "refs").mkdir(exist_ok=True)
        (root / "refs" / "main").write_text(commit)
