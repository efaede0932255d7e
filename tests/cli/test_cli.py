"""The `eagle3` console script, run as a user runs it (a subprocess of the installed entry point)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.run_locks import lock_held_elsewhere

REPO = Path(__file__).resolve().parents[2]
EAGLE3 = Path(sys.executable).parent / "eagle3"

pytestmark = pytest.mark.multiprocess  # every test here starts processes of its own


def eagle3(*args: str, cwd: Path = REPO, api_url: str | None = None) -> subprocess.CompletedProcess[str]:
    """`api_url`: run the flow against that Prefect server instead of a temporary one of its own."""
    env = {**os.environ, "COLUMNS": "220", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1"}
    if api_url:
        env["PREFECT_API_URL"] = api_url
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


def test_validate_kimi_demo_preset_is_valid():
    result = eagle3("validate", "configs/demo-kimi.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid" in result.stdout and "B4_chat" in result.stdout


def test_an_unknown_shape_or_demo_target_is_refused_before_anything_is_built(tmp_path):
    result = eagle3("tiny-target", str(tmp_path / "t"), "--shape", "qwen")
    assert result.returncode == 2 and "--shape must be one of llama, kimi, kimi-long, got 'qwen'" in result.stderr
    assert not (tmp_path / "t").exists()
    result = eagle3("demo", "--target", "qwen", "--run-dir", str(tmp_path / "run"))
    said = "--target must be one of llama, kimi, kimi-long, kimi-int4, got 'qwen'"
    assert result.returncode == 2 and said in result.stderr
    assert "Prefect" not in result.stderr  # refused before a Prefect server is started for it
    assert not (tmp_path / "run").exists()
    result = eagle3("demo", "--engine", "tgi", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "--engine must be dev, sglang, vllm, got 'tgi'" in result.stderr
    result = eagle3("demo", "--draft-arch", "mla", "--run-dir", str(tmp_path / "run"))  # the llama target
    assert result.returncode == 2 and "--draft-arch mla: the MLA draft takes the target's" in result.stderr
    result = eagle3("demo", "--target", "kimi-int4", "--engine", "sglang", "--run-dir", str(tmp_path / "run"))
    assert result.returncode == 2 and "the real SGLang here does not serve the INT4 target" in result.stderr
    assert "--target kimi" in result.stderr.replace("\n", "")
    assert not (tmp_path / "run").exists()


def test_serve_dev_without_a_model_says_how_to_build_one(tmp_path):
    result = eagle3("serve-dev", "--model", str(tmp_path))
    assert result.returncode == 2
    assert "eagle3 tiny-target" in result.stderr


def test_import_jsonl_then_stats(tmp_path, tiny_target_dir):
    legacy = tmp_path / "raw_responses.jsonl"
    lines = [
        {
            "id": "a",
            "prompt_ids": [5, 6, 7],
            "output_ids": [9, 10, 1],
            "completion_tokens": 3,
            "prompt_tokens": 3,
            "finish_reason": "stop",
        },
        {
            "id": "b",
            "messages": [{"role": "user", "content": "hi"}],
            "choices": [{"message": {"content": "hello there"}, "finish_reason": "length"}],
            "usage": {"prompt_tokens": 4, "completion_tokens": 2},
        },
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
    assert (
        result.returncode == 2
        and "trian" in result.stderr
        and "available: generate, records, capture, train, eval" in result.stderr
    )


def _write_config(tmp_path: Path, datasets: list[dict], **sections) -> Path:
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": str(tmp_path / "t")},
        "datasets": datasets,
        **sections,
    }
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"server": {"url": "http://127.0.0.1:99999", "max_concurrency": True}},
            [
                "server.url: port '99999' is not a number from 1 to 65535; the form is scheme://host:port, e.g. http://127.0.0.1:30000",
                "server.max_concurrency: must be a whole number, not true/false (got True)",
            ],
        ),
        (
            {"server": {"url": "http://127.0.0.1:30000/generate"}},
            [
                "server.url: must be the server's base URL, scheme://host:port with no path: use 'http://127.0.0.1:30000'"
            ],
        ),
        ({"run_dir": "FILE"}, ["run_dir: FILE exists and is not a directory; it must be a directory or absent"]),
    ],
    ids=["port-and-bool", "url-path", "run-dir-file"],
)
def test_validate_rejects_bad_config_values_with_exit_2(tmp_path, change, expected):
    data = tmp_path / "p.jsonl"
    data.write_text('{"prompt": "hi"}\n')
    afile = tmp_path / "notes.txt"
    afile.write_text("not a run dir")
    change = json.loads(json.dumps(change).replace("FILE", str(afile)))
    path = _write_config(tmp_path, [{"name": "B1", "kind": "generate", "path": str(data)}])
    path.write_text(yaml.safe_dump({**yaml.safe_load(path.read_text()), **change}))
    result = eagle3("validate", str(path))
    assert result.returncode == 2, result.stdout + result.stderr
    errors = result.stderr.replace("\n", " ")  # rich wraps long lines at a space
    assert f"{path}: invalid config ({len(expected)} problem(s))" in errors
    for line in expected:
        assert line.replace("FILE", str(afile)) in errors


def test_validate_rejects_repeated_ids_and_empty_datasets_with_exit_1(tmp_path):
    conflict = tmp_path / "conflict.jsonl"
    conflict.write_text(
        '{"id": "x", "prompt": "a"}\n{"id": 7, "prompt": "b"}\n{"id": "x", "prompt": "c"}\n'
        '{"id": "7", "prompt": "b"}\n{"id": "x", "prompt": "a"}\n'
    )
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    all_bad = tmp_path / "bad.jsonl"
    all_bad.write_text('{"prompt": ""}\n')
    path = _write_config(
        tmp_path,
        [
            {"name": "B1", "kind": "generate", "path": str(conflict)},
            {"name": "B2", "kind": "generate", "path": str(conflict), "on_bad_row": "skip"},
            {"name": "B3", "kind": "generate", "path": str(empty)},
            {"name": "A1", "kind": "passthrough", "path": str(empty)},
            {"name": "B4", "kind": "generate", "path": str(all_bad), "on_bad_row": "skip"},
        ],
    )
    result = eagle3("validate", str(path))
    assert result.returncode == 1, result.stdout + result.stderr
    out = result.stdout
    rows = {
        line.split("│")[2].strip(): [c.strip() for c in line.split("│")[3:-1]]
        for line in out.splitlines()
        if line.count("│") == 10
    }
    # kind, rows, bad rows, duplicates, token budget, max prompts, status
    assert rows["B1"] == ["generate", "2", "2", "1", "-", "-", "bad rows"]
    assert rows["B2"] == ["generate", "2", "2", "1", "-", "-", "ok, 2 to rejects"]
    assert rows["B3"] == ["generate", "0", "0", "0", "-", "-", "empty"]
    assert rows["A1"] == ["passthrough", "0", "0", "0", "-", "-", "empty"]
    assert rows["B4"] == ["generate", "0", "1", "0", "-", "-", "no usable rows"]
    text = out.replace("\n", " ")
    assert f"{conflict} line 3: id 'x' repeats line 1 with different content" in text
    assert f'{conflict} line 4: id "7" collides with id 7 at line 2' in text
    assert f"datasets[2] B3: {empty}: has no rows — a dataset needs at least one row" in text
    assert f"datasets[3] A1: {empty}: has no rows" in text
    assert f"datasets[4] B4: {all_bad}: has no usable row: all 1 row(s) are bad" in text
    assert "is valid" not in out


def test_generate_refuses_an_empty_dataset_with_exit_1(tmp_path, harness_api_url):
    # Against the session's test server: a temporary server of its own is the fault drill's first run
    # (test_fault_drill.py).
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    path = _write_config(
        tmp_path,
        [{"name": "B1", "kind": "generate", "path": str(empty)}],
        server={"url": "http://127.0.0.1:9", "health_timeout_s": 1},  # never reached: loading fails first
        generate={"retries": 0},
    )
    # --skip-checks: the stage's own refusal (the preflight refuses it before, as `no valid row`: test_doctor.py)
    result = eagle3("generate", str(path), "--skip-checks", api_url=harness_api_url)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"pipeline failed: generate failed for B1: {empty}: has no rows" in result.stderr.replace("\n", " ")
    assert "preflight checks skipped" in result.stderr
    assert not list((tmp_path / "run").glob("responses/B1/*.parquet"))


def _legacy_lines(n: int) -> list[dict]:
    return [
        {"id": f"r{i}", "prompt_ids": [5, 6, 7], "output_ids": [9, 10, 1], "finish_reason": "stop"} for i in range(n)
    ]


def _imported_ids(run_dir: Path, dataset: str = "B1") -> list[str]:
    import pyarrow.parquet as pq

    return [
        i
        for p in sorted((run_dir / "responses" / dataset).glob("part-*.parquet"))
        for i in pq.read_table(p, columns=["id"]).column("id").to_pylist()
    ]


def test_import_jsonl_bad_line_imports_nothing_then_skip_then_fix(tmp_path, tiny_target_dir):
    legacy, run_dir = tmp_path / "raw_responses.jsonl", tmp_path / "run"
    lines = [json.dumps(x) for x in _legacy_lines(6)]
    lines[3] = '{"id": "r3", "prompt_ids": [5], "output_ids": "oops"}'
    legacy.write_text("\n".join(lines) + "\n")
    target = ("--target", str(tiny_target_dir))

    failed = eagle3("import-jsonl", str(run_dir), "B1", str(legacy), *target)
    assert failed.returncode == 2, failed.stderr
    assert failed.stderr.startswith(f"error: {legacy} line 4: 'output_ids' must be a list of token ids, got string")
    assert "Nothing of this file was imported" in failed.stderr and "--on-bad-line skip" in failed.stderr
    assert len(failed.stderr.strip().splitlines()) == 1 and "Traceback" not in failed.stderr
    assert _imported_ids(run_dir) == []

    skipped = eagle3("import-jsonl", str(run_dir), "B1", str(legacy), *target, "--on-bad-line", "skip")
    assert skipped.returncode == 0, skipped.stderr
    assert "6 line(s); 5 imported into 1 part(s)" in skipped.stdout and "1 bad line(s) skipped" in skipped.stdout
    assert sorted(_imported_ids(run_dir)) == ["r0", "r1", "r2", "r4", "r5"]
    stats = {r["dataset"]: r for r in json.loads(eagle3("stats", str(run_dir), "--json").stdout)["responses"]}
    assert (stats["B1"]["responses"], stats["B1"]["rejects"]) == (5, 1)

    legacy.write_text("\n".join(json.dumps(x) for x in _legacy_lines(6)) + "\n")  # line 4 fixed
    fixed = eagle3("import-jsonl", str(run_dir), "B1", str(legacy), *target)
    assert fixed.returncode == 0, fixed.stderr
    assert "1 imported into 1 part(s), 5 already there" in fixed.stdout
    ids = _imported_ids(run_dir)
    assert sorted(ids) == [f"r{i}" for i in range(6)] and len(ids) == 6
    stats = {r["dataset"]: r for r in json.loads(eagle3("stats", str(run_dir), "--json").stdout)["responses"]}
    assert (stats["B1"]["responses"], stats["B1"]["rejects"]) == (6, 0)

    # A damaged part: named, with where to move it, exit 1, nothing imported meanwhile.
    part = sorted((run_dir / "responses" / "B1").glob("part-*.parquet"))[0]
    part.write_bytes(part.read_bytes()[:50])
    damaged = eagle3("import-jsonl", str(run_dir), "B1", str(legacy), *target)
    assert damaged.returncode == 1
    assert damaged.stderr.startswith(f"error: {part} is damaged (50 bytes, not a readable Parquet file")
    assert f"mv {part} {run_dir / 'quarantine' / 'responses' / 'B1'}/" in damaged.stderr
    assert len(damaged.stderr.strip().splitlines()) == 1 and "Traceback" not in damaged.stderr


def test_import_jsonl_refuses_a_second_writer(tmp_path):
    legacy, run_dir = tmp_path / "raw_responses.jsonl", tmp_path / "run"
    legacy.write_text("\n".join(json.dumps(x) for x in _legacy_lines(2)) + "\n")
    with lock_held_elsewhere(run_dir, "generate B1") as holder:
        # A tokenizer path that does not exist: the lock is refused before the tokenizer is loaded.
        result = eagle3(
            "import-jsonl", str(run_dir), "B1", str(legacy), "--target", str(tmp_path / "no-such-tokenizer")
        )
    assert result.returncode == 1, result.stderr
    assert result.stderr.startswith(f"refused: {run_dir} is in use by another writer: pid {holder.pid} on ")
    assert "writing generate B1" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert _imported_ids(run_dir) == []


def test_import_jsonl_clean_errors_for_bad_arguments(tmp_path):
    legacy = tmp_path / "raw_responses.jsonl"
    legacy.write_text(json.dumps(_legacy_lines(1)[0]) + "\n")
    a_file = tmp_path / "notes.txt"
    a_file.write_text("not a run dir")
    cases = [
        (
            (str(tmp_path / "run"), "B1", str(tmp_path / "missing.jsonl"), "--target", "x"),
            f"error: {tmp_path / 'missing.jsonl'}: no such file",
        ),
        (
            (str(a_file), "B1", str(legacy), "--target", "x"),
            f"error: {a_file} is not a directory: give the run directory to import into",
        ),
        (
            (str(tmp_path / "nope"), "B1", str(legacy)),
            f"error: {tmp_path / 'nope'} does not exist: check the path, or pass --target PATH",
        ),
        (
            (str(tmp_path / "run"), "../B1", str(legacy), "--target", "x"),
            "error: dataset '../B1' cannot be a directory name",
        ),
        (
            (str(tmp_path / "run"), "B1", str(legacy), "--target", "x", "--on-bad-line", "ignore"),
            "error: --on-bad-line must be fail or skip, got 'ignore'",
        ),
    ]
    for args, message in cases:
        result = eagle3("import-jsonl", *args)
        assert result.returncode == 2, (args, result.stderr)
        assert result.stderr.startswith(message), (args, result.stderr)
        assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "nope").exists()


def test_import_jsonl_write_failure_is_one_clean_message(tmp_path, tiny_target_dir):
    import resource
    import signal

    legacy, run_dir = tmp_path / "raw_responses.jsonl", tmp_path / "run"
    # Random ids do not compress: the part is far bigger than the 64 KB the process may write.
    lines = [
        {
            "id": f"big{i}",
            "prompt_ids": [5, 6, 7],
            "output_ids": [(i * 7919 + j * 104729) % 30000 for j in range(20_000)],
            "finish_reason": "length",
        }
        for i in range(4)
    ]
    legacy.write_text("".join(json.dumps(x) + "\n" for x in lines))

    def limit_file_size():  # the storage refuses the write (EFBIG) the way a full disk does (ENOSPC)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (64_000, 64_000))

    env = {**os.environ, "COLUMNS": "220", "NO_COLOR": "1", "HF_HUB_OFFLINE": "1", "PYTHONDONTWRITEBYTECODE": "1"}
    result = subprocess.run(
        [str(EAGLE3), "import-jsonl", str(run_dir), "B1", str(legacy), "--target", str(tiny_target_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        preexec_fn=limit_file_size,
    )
    assert result.returncode == 1, result.stderr
    directory = run_dir / "responses" / "B1"
    assert result.stderr.startswith(f"error: cannot write {directory}: file too large for this file system: ")
    assert f"kept: nothing of {legacy} was imported; {directory} is as it was. to resume: " in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr
    assert sorted(p.name for p in directory.iterdir()) == []  # no part, no temp file

    again = eagle3("import-jsonl", str(run_dir), "B1", str(legacy), "--target", str(tiny_target_dir))
    assert again.returncode == 0, again.stderr
    assert sorted(_imported_ids(run_dir)) == [f"big{i}" for i in range(4)]


def test_validate_kimi_long_demo_preset_is_valid():
    result = eagle3("validate", "configs/demo-kimi-long.yaml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert "is valid" in result.stdout and "B5_chapters" in result.stdout
