"""`eagle3 demo --engine E --target T`: a run directory of its own per engine and target, and a run directory made by
another engine (the dev demo's, given as --run-dir) refused with the reason, before anything starts (and by the
generate stage once the real server says what it is: tests/tasks/serving/test_vllm_real.py, against a real vLLM)."""

from __future__ import annotations

from pathlib import Path

import pytest

from cli.demo import demo_config, run_demo
from cli.demo_targets import DEMO_TARGETS
from flows.config.file import dump_config
from settings.layout import RunLayout
from tasks.generate.provenance import OtherEngine
from tests.tasks.generate.test_provenance import add_response, fake_target

REPO = Path(__file__).resolve().parents[2]


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
    assert dirs[("kimi-int4", "dev")] == runs / "demo-kimi-int4" and dirs[("kimi-int4", "vllm")] == runs / (
        "demo-kimi-int4-vllm"
    )
    int4 = demo_config(None, "kimi-int4")  # Kimi-K2.5's published format, from the kimi build
    assert int4.target.tiny_shape == "kimi" and int4.target.tiny_quantize == "int4"
    assert int4.target.path == str(runs / "tiny-kimi-int4") and DEMO_TARGETS["kimi-int4"].base == runs / "tiny-kimi"
    assert len(set(dirs.values())) == len(dirs)
    assert demo_config(None, "kimi").run_dir == runs / "demo-kimi"  # no engine: the target's own
    assert demo_config(Path("elsewhere"), "kimi", "dev").run_dir == Path("elsewhere").resolve()  # --run-dir wins
    # the MLA draft (--draft-arch mla): a run directory of its own, train.draft_arch set, the preset's otherwise
    mla = demo_config(None, "kimi", "sglang", "mla")
    assert mla.run_dir == runs / "demo-kimi-sglang-mla" and mla.train.draft_arch == "mla"
    assert demo_config(None, "kimi", None, "mla").run_dir == runs / "demo-kimi-mla"
    assert demo_config(None, "kimi", "sglang").train.draft_arch == "llama"


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
    from cli.demo import demo_provenance
    from tasks.generate.provenance import check_record, last_run_provenance

    same = check_record(layout, demo_provenance(dev, "dev"), fallback=last_run_provenance(layout))
    assert (same is not None) == recorded  # the record; or none yet, and its next generate adopts the run


def test_the_command_says_refused_and_exits_1_naming_the_engine_that_made_the_run(tmp_path):
    """`eagle3 demo --run-dir DIR` (the dev server) on a run directory a real vLLM made: `refused:`, the reason, exit 1,
    no traceback."""
    from typer.testing import CliRunner

    from cli.app import app
    from tasks.generate.provenance import Provenance, settle, target_fingerprint
    from tests.tasks.generate.test_provenance import log

    run = tmp_path / "runs" / "demo-vllm"
    path = demo_config(run).target.path  # the demo's own tiny target, as the command will use it
    layout = RunLayout(run)
    add_response(layout)
    settle(layout, Provenance("vllm", path, target_fingerprint(path), "0.32.0", launch="command"), log)
    result = CliRunner().invoke(app, ["demo", "--run-dir", str(run)])
    assert result.exit_code == 1, result.output
    said = " ".join(result.output.split())
    assert said.startswith("refused: ") and "holds responses made by a real vLLM 0.32.0" in said, said
    assert "Traceback" not in result.output
