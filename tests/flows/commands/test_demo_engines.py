"""`eagle3 demo --engine E --target T`: a run directory of its own per engine and target, and a run directory made by
another engine (the dev demo's, given as --run-dir) refused with the reason, before anything starts and again by the
generate stage once the real server says what it is."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flows.commands.demo import DEMO_TARGETS, demo_config, run_demo
from flows.config.file import dump_config
from models.common.run_layout import RunLayout
from tasks.generate.provenance import OtherEngine
from tests.tasks.generate.test_provenance import add_response, fake_target

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"


def test_each_target_and_engine_has_a_run_directory_of_its_own():
    runs = REPO / "runs"
    dirs = {
        (target, engine): demo_config(None, target, engine).run_dir
        for target in DEMO_TARGETS
        for engine in ("dev", "sglang", "vllm")
    }
    assert dirs[("llama", "dev")] == runs / "demo"  # `make demo`'s, as the README quotes it
    assert dirs[("llama", "vllm")] == runs / "demo-vllm" and dirs[("llama", "sglang")] == runs / "demo-sglang"
    assert dirs[("kimi", "vllm")] == runs / "demo-kimi" and dirs[("kimi", "dev")] == runs / "demo-kimi-dev"
    assert dirs[("kimi-long", "vllm")] == runs / "demo-kimi-long"
    assert len(set(dirs.values())) == len(dirs)
    assert demo_config(None, "kimi").run_dir == runs / "demo-kimi"  # no engine: the target's own
    assert demo_config(Path("elsewhere"), "kimi", "dev").run_dir == Path("elsewhere").resolve()  # --run-dir wins


@pytest.mark.parametrize("recorded", [True, False], ids=["recorded", "from-before-the-record"])
def test_the_vllm_demo_refuses_the_dev_demo_s_run_dir_before_anything_starts(tmp_path, recorded):
    """`eagle3 demo --engine vllm --run-dir runs/demo` after `make demo`: refused in seconds, the run directory
    unchanged; whether the dev demo recorded its engine or ran before the record (its config.yaml then says)."""
    target = fake_target(tmp_path / "tiny-target")
    run = tmp_path / "runs" / "demo"
    dev = demo_config(run)
    dev.target.path = str(target)
    layout = RunLayout(run)
    run.mkdir(parents=True)
    layout.config.write_text(dump_config(dev))  # as the dev demo's stages left it
    add_response(layout)
    if recorded:
        from tasks.generate.provenance import Provenance, settle, target_fingerprint
        from tests.tasks.generate.test_provenance import log

        settle(layout, Provenance("dev", str(target), target_fingerprint(str(target)), launch="dev"), log)
    before = sorted(p.relative_to(run) for p in run.rglob("*"))

    with pytest.raises(OtherEngine) as refused:
        run_demo(run_dir=run, target_dir=target, engine="vllm")
    message = str(refused.value)
    assert f"{run} holds responses made by the dev server (an SGLang emulation)" in message
    assert "this run asks for a real vLLM" in message
    assert "give a new run_dir" in message and "run it with server.launch: dev (the demo: --engine dev)" in message
    assert sorted(p.relative_to(run) for p in run.rglob("*")) == before  # no server log, no demo config: nothing ran
    # what run_demo checks with --engine dev on the same run directory: it goes on
    from flows.commands.demo import demo_provenance
    from tasks.generate.provenance import check_record, last_run_provenance

    same = check_record(layout, demo_provenance(dev, "dev"), fallback=last_run_provenance(layout))
    assert (same is not None) == recorded  # the record; or none yet, and its next generate adopts the run


@pytest.mark.vllm
@pytest.mark.multiprocess
def test_after_the_dev_demo_vllm_generates_in_its_own_run_dir_and_is_refused_in_the_dev_one(tmp_path, tiny_target_dir):
    """The demo's generate stage (2 prompts a dataset) through the dev server into runs/demo, as `make demo` runs it;
    then through a real vLLM: refused in runs/demo by the generate stage itself (after asking vLLM what it is), and
    generated in runs/demo-vllm, whose record says vLLM and its version."""
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no real vLLM: {VLLM_PYTHON} is missing (`make vllm` installs it; CI does)")
    from flows.commands.demo import demo_server
    from flows.pipeline import pipeline
    from tasks.engines import vllm
    from tasks.launch_servers import ServerProcess, fill_placeholders
    from tasks.ports import free_port

    def generate(run_dir: Path, engine: str, url: str) -> None:
        config = demo_config(run_dir)
        config.target.path, config.target.build_tiny_target = str(tiny_target_dir), False
        config.server = demo_server(config, "dev", url)
        if engine == "vllm":  # the server below: started once for both runs
            server = {**config.server.model_dump(), "engine": "vllm", "launch": "none", "command": None}
            config.server = type(config.server).model_validate(server)
        for dataset in config.datasets:
            dataset.max_prompts = 2 if dataset.kind == "generate" else None
        path = tmp_path / f"{run_dir.name}.yaml"
        path.write_text(dump_config(config))
        pipeline(str(path), stages="generate", skip_checks=True)

    def made_by(run_dir: Path) -> dict:
        return json.loads(RunLayout(run_dir).generated_by.read_text())

    demo, demo_vllm = tmp_path / "runs" / "demo", tmp_path / "runs" / "demo-vllm"
    generate(demo, "dev", f"http://127.0.0.1:{free_port()}")
    assert made_by(demo)["engine"] == "dev" and made_by(demo)["engine_version"].endswith("-eagle3-dev")
    responses = sorted(RunLayout(demo).responses_root.rglob("part-*.parquet"))
    assert responses

    port = free_port()
    words = [
        fill_placeholders(w, {"host": "127.0.0.1", "port": str(port)})
        for w in vllm.cpu_command(str(VLLM_PYTHON), str(tiny_target_dir))
    ]
    with ServerProcess(words, f"http://127.0.0.1:{port}", log_path=tmp_path / "vllm.log", engine="vllm") as server:
        server.wait_healthy(timeout_s=600)
        with pytest.raises(OtherEngine) as refused:
            generate(demo, "vllm", server.url)
        generate(demo_vllm, "vllm", server.url)
    message = str(refused.value)
    assert "holds responses made by the dev server (an SGLang emulation)" in message
    assert "this run asks for a real vLLM 0." in message  # its version, from its /version
    assert sorted(RunLayout(demo).responses_root.rglob("part-*.parquet")) == responses  # the dev demo's, unchanged
    assert made_by(demo)["engine"] == "dev"
    record = made_by(demo_vllm)
    assert record["engine"] == "vllm" and record["engine_version"] and record["served_model"] == str(tiny_target_dir)
    assert record["target_fingerprint"] == made_by(demo)["target_fingerprint"]  # the same target, another engine
    assert list(RunLayout(demo_vllm).responses_root.rglob("part-*.parquet"))
    assert yaml.safe_load(RunLayout(demo_vllm).config.read_text())["server"]["engine"] == "vllm"
