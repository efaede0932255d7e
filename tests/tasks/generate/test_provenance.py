"""tasks/generate/provenance.py: a run directory records the engine and target that made its responses, and refuses
another; a run directory from before the record is adopted; what a server says it is decides which engine it is."""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
from pathlib import Path

import pytest

from models.common.file_errors import DamagedFile
from settings.layout import RunLayout
from tasks.generate.provenance import (
    OtherEngine,
    Provenance,
    check_record,
    declared_engine,
    differences,
    last_run_provenance,
    read_record,
    reported_engine,
    settle,
    target_fingerprint,
)
from tasks.responses.checkpoints import responses_table, write_part

log = logging.getLogger("test.provenance")


def fake_target(directory: Path, weights: bytes = b"\x01" * 300_000) -> Path:
    """A target directory as the fingerprint reads it: config, tokenizer and one weights file."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    (directory / "tokenizer.json").write_text('{"version": "1.0"}')
    (directory / "model.safetensors").write_bytes(weights)
    return directory


def add_response(layout: RunLayout, dataset: str = "B1_code") -> None:
    row = {
        "id": "p1",
        "prompt_ids": [1, 2],
        "output_ids": [3, 4],
        "prompt_tokens": 2,
        "completion_tokens": 2,
        "finish_reason": "stop",
        "text": "hi",
        "latency": 0.1,
        "cached_tokens": 0,
        "reasoning_tokens": 0,
        "finished_at": 1.0,
    }
    write_part(layout.responses(dataset), responses_table([row]))


@pytest.fixture
def target(tmp_path) -> Path:
    return fake_target(tmp_path / "tiny-target")


def made_by(engine: str, target: Path, **kw) -> Provenance:
    return Provenance(engine, str(target), target_fingerprint(str(target)), **kw)


def test_a_run_made_by_the_dev_server_refuses_vllm_naming_both_and_the_ways_on(tmp_path, target):
    layout = RunLayout(tmp_path / "run")
    dev = made_by("dev", target, engine_version="0.1.0-eagle3-dev", served_model=str(target), launch="dev")
    assert settle(layout, dev, log) == dev  # the first generate records it
    add_response(layout)
    vllm = made_by("vllm", target, engine_version="0.11.0", served_model=str(target), launch="command")

    with pytest.raises(OtherEngine) as refused:
        settle(layout, vllm, log)
    message = str(refused.value)
    assert f"{layout.run_dir} holds responses made by the dev server (an SGLang emulation) on {target}" in message
    assert "this run asks for a real vLLM 0.11.0" in message
    assert "engine: the dev server (an SGLang emulation), now a real vLLM" in message
    assert "give a new run_dir" in message and "run it with server.launch: dev" in message
    assert str(layout.generated_by) in message
    assert read_record(layout) == dev  # the refusal changed nothing
    with pytest.raises(OtherEngine):  # the demo's check before anything starts says the same
        check_record(layout, Provenance("vllm", str(target), target_fingerprint(str(target))))
    assert settle(layout, dev, log) == dev  # the same engine resumes


def test_another_target_is_refused_and_a_moved_copy_of_the_same_one_is_not(tmp_path, target):
    layout = RunLayout(tmp_path / "run")
    settle(layout, made_by("dev", target), log)
    add_response(layout)
    moved = tmp_path / "elsewhere" / "tiny-target"
    shutil.copytree(target, moved)
    assert settle(layout, made_by("dev", moved), log).target_path == str(target)  # same files: the same target

    retrained = fake_target(tmp_path / "retrained", weights=b"\x01" * 299_000 + b"\x02" * 1_000)  # the tail differs
    (retrained / "config.json").write_bytes((target / "config.json").read_bytes())
    with pytest.raises(OtherEngine, match=f"target: {target}, now {retrained}") as refused:
        settle(layout, made_by("dev", retrained), log)
    assert f"and target.path: {target}" in str(refused.value)


def test_a_record_without_responses_binds_nothing(tmp_path, target):
    layout = RunLayout(tmp_path / "run")
    settle(layout, made_by("dev", target), log)  # a generate that stopped before its first response
    vllm = made_by("vllm", target)
    assert settle(layout, vllm, log) == vllm
    assert read_record(layout) == vllm


def test_a_run_from_before_the_record_is_adopted_with_a_log_line_then_held_to_it(tmp_path, target, caplog):
    layout = RunLayout(tmp_path / "run")
    add_response(layout)  # responses, no generated-by.json: written before this change
    dev = made_by("dev", target, launch="dev")
    with caplog.at_level(logging.WARNING, logger=log.name):
        assert settle(layout, dev, log) == dev
    assert "has responses from before runs recorded their engine: adopted as made by the dev server" in caplog.text
    written = json.loads(layout.generated_by.read_text())
    assert written["adopted"] is True and written["engine"] == "dev" and written["target_fingerprint"]
    with pytest.raises(OtherEngine, match="now a real vLLM"):
        settle(layout, made_by("vllm", target), log)


def test_before_anything_starts_an_old_run_is_judged_by_its_last_config(tmp_path, target):
    """A run written before the record: its RUN_DIR/config.yaml (the stages' last config, as `make demo` left it)
    says the dev server made it, so a check before the stages overwrite that file refuses vLLM."""
    layout = RunLayout(tmp_path / "run")
    add_response(layout)
    layout.config.write_text(f"run_dir: {layout.run_dir}\ntarget: {{path: {target}}}\nserver: {{launch: dev}}\n")
    last = last_run_provenance(layout)
    assert last == Provenance("dev", str(target), launch="dev")
    with pytest.raises(OtherEngine) as refused:
        check_record(layout, made_by("vllm", target), fallback=last)
    assert f"as {layout.config} says: the run is older than generated-by.json" in str(refused.value)
    assert check_record(layout, made_by("dev", target), fallback=last) is None  # the same: the generate adopts it
    assert not layout.generated_by.exists()


def test_a_damaged_record_says_what_to_do(tmp_path, target):
    layout = RunLayout(tmp_path / "run")
    layout.run_dir.mkdir()
    layout.generated_by.write_text('{"engine": "dev", "target_pa')
    with pytest.raises(DamagedFile, match="move it aside: the next generate adopts the run again"):
        settle(layout, made_by("dev", target), log)


def test_what_each_side_does_not_know_is_not_compared(target):
    known = Provenance("vllm", str(target), "f" * 64, "0.11.0", "/models/tiny-target")
    assert differences(known, Provenance(None, str(target))) == []  # a running server, before it answers
    assert differences(known, Provenance("vllm", str(target), "f" * 64, "0.12.0", "tiny-target")) == []  # upgrade
    assert differences(known, Provenance("vllm", str(target), "f" * 64, "0.11.0", "/models/Llama-3-8B")) == [
        "served model: /models/tiny-target, now /models/Llama-3-8B"
    ]


def test_the_declared_engine_of_each_launch():
    assert declared_engine("dev", "sglang") == "dev"
    assert declared_engine("command", "vllm", ["python", "-m", "vllm.entrypoints.openai.api_server"]) == "vllm"
    assert declared_engine("command", "sglang", ["python", "-m", "sglang.launch_server"]) == "sglang"
    assert declared_engine("command", "sglang", ["eagle3", "serve-dev", "--model", "m"]) == "dev"
    assert declared_engine("none", "sglang") is None  # only the server can say


class SaysClient:
    """An engine client whose GETs answer from a table (None: 404 or no answer, as EngineClient.get_json)."""

    def __init__(self, answers: dict[str, object]):
        self.answers = answers

    async def get_json(self, path: str) -> object:
        return self.answers.get(path)


def test_what_a_server_says_decides_the_engine():
    async def said(answers: dict, engine: str):
        return await reported_engine(SaysClient(answers), engine)

    dev = {"/server_info": {"version": "0.1.0-eagle3-dev", "model_path": "/t"}}
    assert asyncio.run(said(dev, "sglang")) == ("dev", "0.1.0-eagle3-dev", "/t")
    assert asyncio.run(said(dev, "vllm")) == ("dev", "0.1.0-eagle3-dev", "/t")  # the emulator, whatever the config
    real = {"/server_info": {"version": "0.5.23", "model_path": "/models/Kimi-K2.5"}}
    assert asyncio.run(said(real, "sglang")) == ("sglang", "0.5.23", "/models/Kimi-K2.5")
    old = {"/get_server_info": {"version": "0.4.6", "model_path": "/m"}}  # older servers and routers
    assert asyncio.run(said(old, "sglang")) == ("sglang", "0.4.6", "/m")
    # vLLM 0.11: no /server_info outside its dev mode; /version and /v1/models (root: the --model it was given)
    vllm = {
        "/version": {"version": "0.11.0"},
        "/v1/models": {"data": [{"id": "tiny", "root": "/t", "owned_by": "vllm"}]},
    }
    assert asyncio.run(said(vllm, "vllm")) == ("vllm", "0.11.0", "/t")
    assert asyncio.run(said({}, "sglang")) is None and asyncio.run(said({}, "vllm")) is None
    # a server that lies is believed: a dev server that says it is SGLang 0.5.23 is taken for one
    liar = {"/server_info": {"version": "0.5.23", "model_path": "/t"}}
    assert asyncio.run(said(liar, "sglang"))[0] == "sglang"


def test_the_simulated_server_says_what_it_is():
    from emulators.sim import SimServer
    from tasks.serving.sglang import SGLangClient

    async def ask(url: str):
        async with SGLangClient(url) as client:
            return await reported_engine(client, "sglang")

    with SimServer(max_running=2, vocab_size=64) as srv:
        kind, version, _ = asyncio.run(ask(srv.url))
    assert (kind, version) == ("sim", "0.1.0-eagle3-sim")


def test_the_fingerprint_reads_config_tokenizer_and_weights_and_is_none_for_nothing_here(tmp_path, target):
    before = target_fingerprint(str(target))
    assert before is not None and before == target_fingerprint(str(target))
    (target / "tokenizer.json").write_text('{"version": "1.1"}')
    assert target_fingerprint(str(target)) != before
    assert target_fingerprint(str(tmp_path / "no-such-target")) is None
    assert target_fingerprint("no-org/no-such-model-in-the-cache") is None
