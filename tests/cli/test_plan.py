"""`eagle3 plan` (and the doctor's memory check) on Kimi-K2.5's config: at once offline, both backends' memory."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import yaml
from rich.console import Console

from cli.plan import print_plan
from flows.config.file import load_config
from flows.preflight import doctor_findings
from tests.hub_cache import offline_hub_cache
from tests.kimi_k25 import CONFIG_JSON

REPO = Path(__file__).resolve().parents[2]


def kimi_config(tmp_path: Path, target: str, **distributed) -> Path:
    """configs/kimi-k25.yaml's capture (vLLM, TP 8, the INT4 checkpoint) with `target` and one dataset."""
    capture = yaml.safe_load((REPO / "configs/kimi-k25.yaml").read_text())["capture"]
    capture["engine"]["shared_dir"] = str(tmp_path / "shm")
    config = {
        "run_dir": str(tmp_path / "run"),
        "target": {"path": target, "trust_remote_code": True},
        "capture": capture,
        "distributed": distributed,
        "datasets": [{"name": "B1", "kind": "generate", "path": str(REPO / "data/samples/gen_math.jsonl")}],
    }
    path = tmp_path / "kimi.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def plan_text(path: Path) -> tuple[bool, str]:
    console = Console(record=True, width=400)
    ok = print_plan(load_config(path), console)
    return ok, console.export_text()


def test_a_hub_id_not_in_the_cache_is_said_at_once_without_the_network(tmp_path, monkeypatch):
    offline_hub_cache(tmp_path, monkeypatch)
    import huggingface_hub
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)  # online as far as it knows
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda *a, **k: (_ for _ in ()).throw(AssertionError))
    started = time.monotonic()
    ok, text = plan_text(kimi_config(tmp_path, "moonshotai/Kimi-K2.5"))
    assert ok and time.monotonic() - started < 10
    assert "moonshotai/Kimi-K2.5 is not a local directory and its config.json is not in the Hugging Face cache" in text
    assert "huggingface-cli download moonshotai/Kimi-K2.5 config.json" in text


def test_kimi_k25_shows_both_backends_and_refuses_what_does_not_fit(tmp_path):
    target = tmp_path / "kimi"
    target.mkdir()
    shutil.copy(CONFIG_JSON, target / "config.json")  # config.json is all the plan needs
    ok, text = plan_text(kimi_config(tmp_path, str(target)))
    assert ok, text
    # the figures of tests/tasks/capture/test_memory.py, on the reference box (140 GiB GPUs, 2 TiB)
    assert "vllm, TP 8 (configured)" in text and "vllm, TP 8: GPU 87.5 GiB of 126.0 GiB per rank" in text
    assert "deepspeed zero3, offload cpu, 8 ranks: GPU 45.8 GiB of 140.0 GiB per rank" in text
    assert "host 1,911.8 GiB of 2,048.0 GiB per node (pinned partitions 1,911.8 GiB)" in text
    assert "deepspeed zero3, offload none, 8 ranks: GPU 284.8 GiB of 140.0 GiB" in text
    findings = {f.name: f for g, f in doctor_findings(load_config(kimi_config(tmp_path, str(target))), ["capture"])}
    assert findings["memory: capture"].status == "PASS"

    h100 = kimi_config(tmp_path, str(target), gpu_memory_gib=80)
    ok, text = plan_text(h100)
    assert not ok
    assert "capture would not fit in memory: vllm, TP 8: GPU 87.5 GiB of 72.0 GiB per rank" in text
    assert "each GPU needs 87.5 GiB but has 72.0 GiB (distributed.gpu_memory_gib)" in text
    memory = {f.name: f for g, f in doctor_findings(load_config(h100), ["capture"])}["memory: capture"]
    assert memory.status == "FAIL" and "each GPU needs 87.5 GiB but has 72.0 GiB" in memory.detail
    assert "--tensor-parallel-size" in memory.advice and "--max-model-len" in memory.advice


def test_the_doctor_fails_a_deepspeed_capture_without_offload_and_passes_it_with_cpu_offload(tmp_path):
    target = tmp_path / "kimi"
    target.mkdir()
    shutil.copy(CONFIG_JSON, target / "config.json")
    path = kimi_config(tmp_path, str(target))
    config = yaml.safe_load(path.read_text())
    config["capture"] |= {"backend": "deepspeed", "mode": "zero3", "num_gpus": 8}
    path.write_text(yaml.safe_dump(config))
    memory = {f.name: f for g, f in doctor_findings(load_config(path), ["capture"])}["memory: capture"]
    assert memory.status == "FAIL" and "each GPU needs 284.8 GiB but has 140.0 GiB" in memory.detail
    assert "capture.offload: cpu or nvme" in memory.advice
    config["capture"]["offload"] = "cpu"
    path.write_text(yaml.safe_dump(config))
    memory = {f.name: f for g, f in doctor_findings(load_config(path), ["capture"])}["memory: capture"]
    assert memory.status == "PASS" and "pinned partitions 1,911.8 GiB" in memory.detail
