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


REPO = Path(__file__).resolve().parents[1]


def write_demo_config(tmp_path: Path, target: Path, **sections: Any) -> Path:
    """configs/demo.yaml for a run in tmp_path on `target` (already built), with `sections` merged over it."""
    data = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())
    data["run_dir"] = str(tmp_path / "run")
    data["target"] = {"path": str(target)}
    for d in data["datasets"]:
        d["path"] = str(REPO / d["path"])
    data["eval"]["prompt_files"] = [str(REPO / p) for p in data["eval"]["prompt_files"]]
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(data))
    return path
