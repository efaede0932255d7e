"""Capture runs through the REAL vLLM (capture.backend: vllm, launch: command): a config over records built here.

The records are random token ids of varied lengths (the states of a random prompt are as good a check as any), built
by the records stage from generated responses, so the capture reads them exactly as the pipeline does.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import yaml

from models.common.jobs import RecordsJob
from tasks.records.build import build_records
from tasks.responses.checkpoints import responses_table, write_part
from tasks.runtime.ports import free_port
from tasks.serving.vllm import capture_cpu_command
from tests.generate_runs import response_row

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def vocab_size(target: Path) -> int:
    config = json.loads((target / "config.json").read_text())
    return int((config.get("text_config") or config)["vocab_size"])


def write_vllm_capture_run(
    tmp_path: Path,
    target: Path,
    *,
    records: int = 24,
    seed: int = 0,
    dtype: str = "float32",
    **capture: object,
) -> Path:
    """A run config whose capture goes through a real vLLM the pipeline starts; `records` records of 12-160 tokens."""
    run = tmp_path / "run"
    rng = random.Random(seed)
    top = vocab_size(target) - 1
    rows = []
    for i in range(records):
        prompt = [rng.randint(3, top) for _ in range(rng.randint(8, 60))]
        answer = [rng.randint(3, top) for _ in range(rng.randint(4, 100))]
        rows.append(response_row(f"r{i}", prompt, answer))
    write_part(run / "responses/B1", responses_table(rows))
    build_records(
        "B1", "generate", run / "responses/B1", run / "records/B1", run / "rejects/B1", RecordsJob(vocab_size=top + 1)
    )
    engine = {
        "launch": "command",
        "url": f"http://127.0.0.1:{free_port()}",
        "command": capture_cpu_command(str(VLLM_PYTHON), str(target), max_model_len=512, dtype=dtype),
        "max_concurrency": 4,
        "health_timeout_s": 600,
    }
    config = {
        "run_dir": str(run),
        "target": {"path": str(target)},
        "server": {"url": "http://127.0.0.1:30000"},
        "capture": {"backend": "vllm", "dtype": "float32", "engine": engine, **capture},
        "datasets": [{"name": "B1", "kind": "generate", "path": str(REPO / "data/samples/gen_math.jsonl")}],
    }
    path = tmp_path / f"capture-real-vllm-{target.name}.yaml"  # artifact keys of its own
    path.write_text(yaml.safe_dump(config))
    return path


def recapture_with_vllm(config, run_dir: Path, *, dtype: str = "float32", max_model_len: int = 4096) -> Path:
    """The records of `config`'s run (a RunConfig whose records stage ran) captured again, through a real vLLM the
    pipeline starts, in `run_dir`; the new hidden directory."""
    import shutil

    from flows.capture import capture
    from flows.config.file import dump_config

    new = config.model_copy(deep=True)
    new.run_dir = run_dir
    for d in config.datasets:
        if config.layout.records(d.name).is_dir():
            shutil.copytree(config.layout.records(d.name), new.layout.records(d.name))
    engine = {
        **new.capture.engine.model_dump(),
        "launch": "command",
        "url": f"http://127.0.0.1:{free_port()}",
        "command": capture_cpu_command(str(VLLM_PYTHON), new.target.path, max_model_len=max_model_len, dtype=dtype),
        "health_timeout_s": 600,
        "shared_dir": None,  # RUN_DIR/engine of the new run
    }
    capture_section = {**new.capture.model_dump(), "backend": "vllm", "engine": engine, "out_dir": None}
    new.capture = type(new.capture).model_validate(capture_section)
    path = run_dir / "capture-vllm.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dump_config(new))
    capture(str(path))
    return new.layout.hidden_dir


def compare_captures(ours: Path, reference: Path, rtol: float, last_rtol: float) -> tuple[int, dict[str, float]]:
    """Every sample of `reference`'s shards has the same ids in `ours` and states equal within `rtol` (aux) and
    `last_rtol` (last), relative to the largest value of the reference state; (samples compared, the largest
    relative difference of each)."""
    import torch

    from models.capture.shards import iter_shard_index, read_sample

    def samples(hidden: Path) -> dict:
        return {(r["dataset"], r["id"]): r for r in iter_shard_index(hidden)}

    mine, theirs = samples(ours), samples(reference)
    assert set(mine) == set(theirs), sorted(set(mine) ^ set(theirs))[:5]
    worst = {"aux_hidden": 0.0, "last_hidden": 0.0}
    tolerance = {"aux_hidden": rtol, "last_hidden": last_rtol}
    for key, r in theirs.items():
        a = read_sample(ours / mine[key]["shard"], mine[key]["offset"], mine[key]["length"])
        b = read_sample(reference / r["shard"], r["offset"], r["length"])
        assert torch.equal(a["input_ids"], b["input_ids"]) and torch.equal(a["loss_mask"], b["loss_mask"]), key
        for name in ("aux_hidden", "last_hidden"):
            x, y = a[name].float(), b[name].float()
            d = ((x - y).abs().max() / y.abs().max()).item()
            worst[name] = max(worst[name], d)
            assert d < tolerance[name], (key, name, d)
    return len(theirs), worst
