"""A run config written as a test needs it: the YAML file a user would pass to `eagle3` or a deployment."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml


def write_run_config(path: Path, run_dir: Path, target: Path, datasets: list[dict], **sections: Any) -> Path:
    """RUN_DIR, the target, the datasets and any sections given (server=..., sampling=...), as YAML in `path`."""
    config = {"run_dir": str(run_dir), "target": {"path": str(target)}, **sections, "datasets": datasets}
    path.write_text(yaml.safe_dump(config))
    return path
