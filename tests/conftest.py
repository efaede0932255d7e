"""Session-wide fixtures shared by every test directory."""

from __future__ import annotations

import os
import subprocess
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

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


class Tmpfs:
    """Real small filesystems for full-disk tests: `with tmpfs(directory, size) as d:`, `tmpfs.remount(d, "size=4m")`."""

    def __init__(self) -> None:
        self.mounted: list[Path] = []

    @contextmanager
    def __call__(self, directory: Path, size: int | str) -> Iterator[Path]:
        """A tmpfs of `size` (bytes, or "160k"/"3m") at `directory`; skips the test where mounting is not allowed."""
        directory.mkdir(parents=True, exist_ok=True)
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(directory)], capture_output=True, text=True)
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs (needs root or CAP_SYS_ADMIN): {done.stderr.strip()}")
        self.mounted.append(directory)
        try:
            yield directory
        finally:
            self.unmount(directory)

    @staticmethod
    def remount(directory: Path, options: str) -> None:
        """E.g. "size=64m" (the disk grows) or "ro" (it turns read-only)."""
        subprocess.run(["mount", "-o", f"remount,{options}", str(directory)], check=True)

    def unmount(self, directory: Path) -> None:
        if directory in self.mounted:
            self.mounted.remove(directory)
            subprocess.run(["umount", "-l", str(directory)], capture_output=True)


@pytest.fixture
def tmpfs() -> Iterator[Tmpfs]:
    """Mounts tmpfs filesystems (root only) and unmounts whatever a failing test left mounted."""
    disks = Tmpfs()
    yield disks
    for directory in list(disks.mounted):
        disks.unmount(directory)
