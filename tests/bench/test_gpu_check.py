"""bench/gpu_check.py: its --cpu-smoke run takes the GPU check's path end to end and reports every figure."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# The GPU machine has no Prefect or httpx (docs/gpu-check.md): the check process must not import them, even lazily.
WITHOUT_PREFECT = """
import importlib.abc, runpy, sys
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("prefect", "httpx"):
            raise ImportError(f"{name} is not on the GPU machine")
sys.meta_path.insert(0, Refuse())
sys.argv = ["bench/gpu_check.py", *sys.argv[1:]]
runpy.run_path("bench/gpu_check.py", run_name="__main__")
"""


@pytest.mark.slow
@pytest.mark.multiprocess
def test_cpu_smoke_runs_every_phase_and_reports_its_figures(tmp_path):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "-c", WITHOUT_PREFECT, "--cpu-smoke", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    figures = json.loads(out.read_text())
    phases = figures["phases"]
    assert figures["ok"] is True and list(phases) == ["target", "records", "capture", "train", "export", "eval"]
    assert all(p["ok"] and p["wall_s"] >= 0 for p in phases.values())
    assert phases["records"]["records"] == 24 and phases["records"]["generate_tokens_per_s"] > 0
    capture, train = phases["capture"], phases["train"]
    assert capture["tokens"] == phases["records"]["tokens"]  # every record ends with a loss token: nothing trimmed
    assert capture["tokens_per_s"] > 0 and capture["stored_gb"] > 0 and capture["host_peak_rss_gib"] > 0
    assert train["steps"] == 6 and train["steps_per_s"] > 0 and train["tokens_per_s"] > 0
    assert math.isfinite(train["first_loss"]) and math.isfinite(train["final_loss"]) and train["host_peak_rss_gib"] > 0
    assert "gpu_peak_allocated_gib" not in train  # no CUDA on this machine
    assert phases["export"]["export_mb"] > 0 and phases["export"]["draft_vocab_size"] > 0
    assert phases["eval"]["acceptance_length"] >= 1 and phases["eval"]["untrained_acceptance_length"] >= 1
    assert figures["machine"]["deepspeed"] and figures["machine"]["cuda_available"] is False
    assert (tmp_path / "gpu_check.log").read_text().count("RANK_MEMORY") == 3  # capture, train, eval
    assert "every phase passed" in proc.stdout
