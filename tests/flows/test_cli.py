"""The `eagle3` console script, run as a user runs it (a subprocess of the installed entry point)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = Path(sys.executable).parent / "eagle3"


def eagle3(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "COLUMNS": "220", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    return subprocess.run([str(EAGLE3), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_help_lists_the_commands():
    result = eagle3("--help")
    assert result.returncode == 0
    for command in ("demo", "validate", "tiny-target", "serve-dev"):
        assert command in result.stdout


def test_validate_kimi_preset_names_every_missing_file():
    result = eagle3("validate", "configs/kimi-k25.yaml")
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    assert "10 data file(s) missing" in out
    for name in ("A1_deepswekimi", "A2_kimik25", "B1_glaive", "B4_mixturethoughts", "B8_toolcalls"):
        assert f"{name}: {REPO / 'data' / 'kimi'}" in out
    assert "datasets[i].path" in out


def test_validate_demo_preset_is_valid_and_counts_rows():
    result = eagle3("validate", "configs/demo.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    rows = {}
    for line in (REPO / "data/samples/gen_math.jsonl").read_text().splitlines():
        if line.strip():
            rows.setdefault(json.loads(line).get("id", line), 1)
    assert "B2_math" in result.stdout
    assert f" {len(rows)} " in result.stdout.split("B2_math", 1)[1].splitlines()[0]
    assert "is valid" in result.stdout


def test_validate_misspelled_key_fails_naming_it(tmp_path):
    config = yaml.safe_load((REPO / "configs/demo.yaml").read_text())
    config["sampling"]["max_new_token"] = 5
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(config))
    result = eagle3("validate", str(path), cwd=REPO)
    assert result.returncode == 2
    assert "sampling.max_new_token: unknown key; did you mean 'max_new_tokens'?" in result.stderr


def test_validate_reports_bad_rows_with_file_and_line(tmp_path):
    data = tmp_path / "prompts.jsonl"
    data.write_text('{"prompt": "fine"}\n{"prompt": 5}\n{not json\n')
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": str(tmp_path / "t")},
        "datasets": [{"name": "B1", "kind": "generate", "path": str(data)}],
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    result = eagle3("validate", str(path))
    assert result.returncode == 1
    assert "2 bad row(s)" in result.stdout
    assert f"{data} line 2" in result.stdout.replace("\n    ", " ")
    assert "line 3" in result.stdout
    assert "on_bad_row: skip" in result.stdout

    config["datasets"][0]["on_bad_row"] = "skip"
    path.write_text(yaml.safe_dump(config))
    result = eagle3("validate", str(path))
    assert result.returncode == 0, result.stdout
    assert "ok, 2 to rejects" in result.stdout


def test_tiny_target_refuses_too_few_layers(tmp_path):
    result = eagle3("tiny-target", str(tmp_path / "t"), "--num-layers", "4")
    assert result.returncode == 2
    assert "8" in result.stderr


def test_serve_dev_without_a_model_says_how_to_build_one(tmp_path):
    result = eagle3("serve-dev", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "eagle3 tiny-target" in result.stderr


def test_import_jsonl_then_stats(tmp_path, tiny_target_dir):
    legacy = tmp_path / "raw_responses.jsonl"
    lines = [
        {"id": "a", "prompt_ids": [5, 6, 7], "output_ids": [9, 10, 1], "completion_tokens": 3, "prompt_tokens": 3, "finish_reason": "stop"},
        {"id": "b", "messages": [{"role": "user", "content": "hi"}], "choices": [{"message": {"content": "hello there"}, "finish_reason": "length"}],
         "usage": {"prompt_tokens": 4, "completion_tokens": 2}},
    ]
    legacy.write_text("\n".join(json.dumps(x) for x in lines) + '\n{"id": "c", "output_')  # killed mid-write
    run_dir = tmp_path / "run"
    result = eagle3("import-jsonl", str(run_dir), "B1_glaive", str(legacy), "--target", str(tiny_target_dir))
    assert result.returncode == 0, result.stderr
    again = eagle3("import-jsonl", str(run_dir), "B1_glaive", str(legacy), "--target", str(tiny_target_dir))
    assert again.returncode == 0  # idempotent
    result = eagle3("stats", str(run_dir), "--json")
    assert result.returncode == 0, result.stderr
    rows = {r["dataset"]: r for r in json.loads(result.stdout)["responses"]}
    assert rows["B1_glaive"]["responses"] == 2
    assert rows["B1_glaive"]["completion_tokens"] == 3 + 2
    assert rows["B1_glaive"]["finish_reasons"] == {"stop": 1, "length": 1}


def test_stats_on_a_missing_dir_explains(tmp_path):
    result = eagle3("stats", str(tmp_path / "nope"))
    assert result.returncode == 2 and "not a directory" in result.stderr


def test_run_rejects_unknown_stages():
    result = eagle3("run", "configs/demo.yaml", "--stages", "generate,trian")
    assert result.returncode == 2 and "trian" in result.stderr and "available: generate, records, capture, train, eval" in result.stderr
