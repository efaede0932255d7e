"""Session-wide fixtures shared by every test directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tests never touch the network: the hub client reads these once, at import time.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(scope="session", autouse=True)
def _one_torch_thread():
    """The tests' models are tiny: one intra-op thread is faster than two spin-waiting on a busy 2-core box."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The deterministic tiny target (tokenizer + Llama weights), built once per session."""
    # Imported here so test sessions that never ask for a model do not pay for torch/transformers.
    from models.tiny_target import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("tiny_target") / "model")
