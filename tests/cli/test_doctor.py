"""`eagle3 doctor` and the pipeline's preflight: all PASS on the demo, and a FAIL naming the fault for a template
that masks nothing, a draft whose aux ids are off by one for vLLM, and a server that serves another model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from cli.app import app
from flows.config.file import load_config
from flows.preflight import PreflightFailed, doctor_findings, engine_checks
from models.common.findings import Finding
from models.ranks import environment
from tests.run_configs import write_demo_config

REPO = Path(__file__).resolve().parents[2]
# A template that renders the user's turns and drops every assistant turn's text: nothing to put loss on.
NO_ANSWERS = (
    "{% for m in messages %}{% if m['role'] != 'assistant' %}<|{{ m['role'] }}|>{{ m['content'] }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def by_name(findings: list[tuple[str, Finding]] | list[Finding]) -> dict[str, Finding]:
    """Findings by check name, from doctor_findings' (group, finding) pairs or a group's list."""
    return {f.name: f for f in (item[1] if isinstance(item, tuple) else item for item in findings)}


def test_the_demo_config_passes_every_check_and_says_cpu(tmp_path, tiny_target_dir):
    config = write_demo_config(tmp_path, tiny_target_dir)
    result = CliRunner().invoke(app, ["doctor", str(config)])
    assert result.exit_code == 0, result.output
    findings = by_name(doctor_findings(load_config(config)))
    # The only warnings: a Python or package version other than the tested one (environment.TESTED), as on the
    # GPU machine (Python 3.12, torch 2.11, transformers 5.17); every other check passes.
    warned = {name for name, f in findings.items() if f.status == "WARN"}
    assert {f.status for f in findings.values()} <= {"PASS", "WARN"}
    assert all(name in environment.TESTED and "; tested with " in findings[name].detail for name in warned), {
        name: findings[name].detail for name in warned
    }
    assert re.search(rf"\d+ passed, {len(warned)} warnings, 0 failed", result.output)
    assert "cpu" in findings["device"].detail and "no CUDA" in findings["device"].detail
    # every group that applies to a fresh demo run is there, each dataset's template included
    assert {
        "python",
        "torch",
        "deepspeed",
        "transformers",
        "prefect",
        "engine",
        "draft",
        "disk: capture",
        "run directory",
    } <= set(findings)
    assert {f"chat template: {n}" for n in ("A1_chat", "B1_code", "B2_math", "B3_long")} <= set(findings)
    assert findings["engine"].detail.startswith("server.launch: dev")


def test_a_hub_dataset_gets_its_chat_template_checked_from_the_cache(tmp_path, tiny_target_dir, monkeypatch):
    from tests.hub_cache import offline_hub_cache, publish

    hub = offline_hub_cache(tmp_path, monkeypatch)
    publish(hub, "1" * 40, [{"id": "h1", "conversations": [{"from": "human", "value": "Hi there"}]}])
    datasets = yaml.safe_load((REPO / "configs" / "demo.yaml").read_text())["datasets"][:1]
    datasets[0]["path"] = str(REPO / datasets[0]["path"])
    hubs = [
        {"name": "H1", "kind": "generate", "path": "hf:org/chats"},
        {"name": "H2", "kind": "generate", "path": "hf:org/absent"},
    ]
    findings = by_name(
        doctor_findings(load_config(write_demo_config(tmp_path, tiny_target_dir, datasets=datasets + hubs)))
    )
    assert findings["chat template: H1"].status == "PASS", findings["chat template: H1"].detail
    assert findings["chat template: H2"].status == "FAIL"  # HF_HUB_OFFLINE: the generate stage could not fetch it
    assert "hf download --repo-type dataset org/absent" in findings["chat template: H2"].advice
    assert not (tmp_path / "run" / "datasets").exists()  # the check records no commit


def test_shards_captured_with_other_settings_fail_before_the_capture_refuses_them(tmp_path, tiny_target_dir):
    """Shards as the capture writes them for this target (float32, its hidden size, EAGLE-3's default layers): the
    config that wrote them resumes; one that would capture fp8 into them fails, naming what differs."""
    import torch

    from models.capture.shards import ShardWriter
    from models.draft.config import default_aux_layers

    target = json.loads((tiny_target_dir / "config.json").read_text())
    h, layers = target["hidden_size"], default_aux_layers(target["num_hidden_layers"])
    hidden = tmp_path / "run" / "hidden"
    with ShardWriter(hidden, rank=0, shard_tokens=1, aux_layers=layers) as w:
        w.add("r1", "A1_chat", torch.ones(2, dtype=torch.long), torch.ones(2), torch.zeros(2, 3 * h), torch.zeros(2, h))
    same = by_name(doctor_findings(load_config(write_demo_config(tmp_path, tiny_target_dir))))["capture shards"]
    assert same.status == "PASS" and same.detail.endswith("with these settings: it resumes"), same.detail
    fp8 = write_demo_config(tmp_path, tiny_target_dir, capture={"storage": "fp8"})
    other = by_name(doctor_findings(load_config(fp8)))["capture shards"]
    assert other.status == "FAIL" and other.detail.endswith("captured with other settings: storage native -> fp8")
    # a launch without the capture stage (`eagle3 generate`) is not stopped by them
    assert "capture shards" not in by_name(doctor_findings(load_config(fp8), ["generate"]))


def test_a_run_made_by_another_engine_fails_before_generate_starts(tmp_path, tiny_target_dir):
    """A run directory whose responses a real vLLM made, and a config that generates through the dev server: the
    generate stage would refuse it (tasks/generate/provenance.py), so the doctor says so in seconds, naming both."""
    from settings.layout import RunLayout
    from tasks.generate.provenance import Provenance, target_fingerprint, write_record
    from tests.tasks.generate.test_provenance import add_response

    config = load_config(write_demo_config(tmp_path, tiny_target_dir))
    assert config.server.launch == "dev"
    layout = RunLayout(config.run_dir)
    fingerprint = target_fingerprint(config.target.path)
    write_record(layout, Provenance("vllm", config.target.path, fingerprint, "0.32.0", launch="command"))
    add_response(layout)
    found = by_name(doctor_findings(config))["run directory: generated by"]
    assert found.status == "FAIL" and "a real vLLM" in found.detail and "the dev server" in found.detail, found
    # a launch without generate (`eagle3 run --stages records,...`) is not stopped by it
    assert "run directory: generated by" not in by_name(doctor_findings(config, ["records"]))
    # the same engine passes
    write_record(layout, Provenance("dev", config.target.path, fingerprint, launch="dev"))
    assert by_name(doctor_findings(config))["run directory: generated by"].status == "PASS"


@pytest.fixture
def maskless_target(tmp_path, tiny_target_dir) -> Path:
    """The tiny target with a chat template that drops the assistant turns' text."""
    target = tmp_path / "maskless-target"
    shutil.copytree(tiny_target_dir, target)
    (target / "chat_template.jinja").write_text(NO_ANSWERS)
    return target


def test_a_kimi_target_without_trust_remote_code_fails_naming_the_setting(tmp_path, kimi_target_dir):
    """The kimi checkpoint's tokenizer is its own code (Kimi-K2.5's tiktoken tokenizer): without trust_remote_code
    transformers would load another tokenizer silently (models/target/tokenizer.py), so the target check FAILs saying
    what to set; with it, the target and each dataset's template pass."""
    untrusted = write_demo_config(tmp_path, kimi_target_dir, trust_remote_code=False)
    refused = by_name(doctor_findings(load_config(untrusted)))["target"]
    assert refused.status == "FAIL" and "tokenization_kimi.TikTokenTokenizer" in refused.detail
    assert refused.advice == "set target.trust_remote_code: true"
    trusted = write_demo_config(tmp_path, kimi_target_dir, trust_remote_code=True)
    findings = by_name(doctor_findings(load_config(trusted)))
    assert "target" not in findings or findings["target"].status == "PASS"
    assert findings["chat template: A1_chat"].status == "PASS"


def test_a_template_that_masks_nothing_fails_naming_the_dataset(tmp_path, maskless_target):
    config = write_demo_config(tmp_path, maskless_target)
    result = CliRunner().invoke(app, ["doctor", str(config)])
    assert result.exit_code == 1, result.output
    f = by_name(doctor_findings(load_config(config)))["chat template: A1_chat"]
    assert f.status == "FAIL" and f.detail.startswith("0% of the tokens get loss: row pt-001")
    assert "chat_template" in f.advice


def test_the_pipeline_stops_before_its_first_stage_on_a_fail_and_skip_checks_runs_it(tmp_path, maskless_target):
    from flows.pipeline import pipeline

    config = write_demo_config(
        tmp_path,
        maskless_target,
        server={"launch": "none"},
        datasets=[
            {"name": "A1_chat", "kind": "passthrough", "path": str(REPO / "data/samples/passthrough_chat.jsonl")}
        ],
    )
    with pytest.raises(PreflightFailed, match=r"chat template: A1_chat: 0% of the tokens get loss"):
        pipeline(str(config), "generate,records")
    assert not (tmp_path / "run" / "responses").exists()  # no stage was started
    pipeline(
        str(config), "generate,records", skip_checks=True
    )  # the same fault, found by the stage: every row a reject
    rejects = list((tmp_path / "run" / "rejects" / "A1_chat").glob("*"))
    assert rejects, "the records stage ran and rejected the rows the template cannot mask"


def test_a_draft_whose_vllm_aux_ids_are_off_by_one_fails(tmp_path, tiny_target_dir):
    from transformers import AutoModelForCausalLM

    from tests.drafts import export_random_draft

    config = load_config(write_demo_config(tmp_path, tiny_target_dir))
    export = config.layout.draft_dir / "final"
    export_random_draft(AutoModelForCausalLM.from_pretrained(tiny_target_dir), export, draft_vocab_size=1024)
    assert {f.status for g, f in doctor_findings(config, ["eval"]) if g == "draft"} == {"PASS"}

    cfg = json.loads((export / "config.json").read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]  # SGLang's ids
    (export / "config.json").write_text(json.dumps(cfg))
    found = by_name(doctor_findings(config, ["eval"]))
    aux = found["draft: aux layer ids"]
    assert aux.status == "FAIL"
    assert "vLLM would feed it capture indices [1, 3, 4] instead of [2, 4, 5] (off by one" in aux.detail
    assert "SGLang" not in aux.detail.split(": ", 1)[1].split(";")[-1]  # SGLang's reading is right: not blamed
    assert found["draft: vLLM loader"].status == "FAIL" and found["draft: SGLang loader"].status == "PASS"


def test_eagle3_eval_with_draft_checks_that_draft_before_the_eval_starts(tmp_path, tiny_target_dir):
    """`eagle3 eval CONFIG --draft DIR` (the pipeline's eval_draft): DIR is checked against the rules of the engine the
    eval serves it through (vLLM here: aux id 0; the Kimi case: tests/tasks/doctor/test_draft.py), before anything
    runs."""
    from transformers import AutoModelForCausalLM

    from flows.pipeline import pipeline
    from tasks.serving.vllm import cpu_command
    from tests.drafts import export_random_draft

    theirs = tmp_path / "elsewhere" / "draft"
    export_random_draft(AutoModelForCausalLM.from_pretrained(tiny_target_dir), theirs, draft_vocab_size=1024)
    cfg = json.loads((theirs / "config.json").read_text())
    (theirs / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [0, 4, 5]}))
    server = {"engine": "vllm", "launch": "command", "command": cpu_command("python", str(tiny_target_dir))}
    config = write_demo_config(tmp_path, tiny_target_dir, server=server, eval={"backend": "engine"})
    with pytest.raises(PreflightFailed, match=rf"draft: vLLM loader: --draft {theirs}: top-level eagle_aux_hidden"):
        pipeline(str(config), "eval", eval_draft=str(theirs))
    assert not (tmp_path / "run" / "logs").exists()  # no server was started


def test_a_norm_before_residual_draft_is_vllm_s_a_warning_for_sglang_not_a_failure(tmp_path, tiny_target_dir):
    """SGLang 0.5.23 cannot serve it (its layer keeps the raw residual), vLLM can: the preflight of an eval served by
    vLLM must not stop on SGLang's loader."""
    from transformers import AutoModelForCausalLM

    from tests.drafts import export_random_draft

    config = load_config(write_demo_config(tmp_path, tiny_target_dir))
    export = config.layout.draft_dir / "final"
    export_random_draft(AutoModelForCausalLM.from_pretrained(tiny_target_dir), export, draft_vocab_size=1024)
    cfg = json.loads((export / "config.json").read_text())
    (export / "config.json").write_text(json.dumps({**cfg, "norm_before_residual": True}))
    found = by_name(doctor_findings(config, ["eval"]))
    sglang = found["draft: SGLang loader"]
    assert (sglang.status, sglang.advice) == ("WARN", "serve this draft with vLLM")
    assert sglang.detail.startswith("norm_before_residual: SGLang 0.5.23")
    assert found["draft: vLLM loader"].status == "PASS" and found["draft: norm flags"].status == "WARN"
    assert "FAIL" not in {f.status for g, f in doctor_findings(config, ["eval"]) if g == "draft"}


def test_a_dev_server_serving_another_model_fails(tmp_path, tiny_target_dir, serve_app):
    from emulators.dev_server.app import create_app
    from models.target.tiny import build_tiny_target

    other = build_tiny_target(tmp_path / "other-model", seed=1, train_steps=0)
    with serve_app(create_app(other)) as url:
        config = load_config(write_demo_config(tmp_path, tiny_target_dir, server={"url": url, "launch": "none"}))
        found = by_name(engine_checks(config))
        result = CliRunner().invoke(app, ["doctor", str(tmp_path / "config.yaml")])
    model = found[f"engine {url}: model"]
    assert model.status == "FAIL" and model.detail == f"serves {other}, but target.path is {tiny_target_dir}"
    assert found[f"engine {url}: version"].status == "PASS"
    assert result.exit_code == 1 and "serves" in result.output


def test_the_engine_serving_the_target_passes_with_its_figures(tmp_path, tiny_target_dir, serve_app):
    from emulators.dev_server.app import create_app

    with serve_app(create_app(tiny_target_dir, context_length=512)) as url:
        config = load_config(write_demo_config(tmp_path, tiny_target_dir, server={"url": url, "launch": "none"}))
        found = by_name(engine_checks(config))
    assert {f.status for f in found.values()} == {"PASS", "WARN"}
    assert found[f"engine {url}: model"].detail == str(tiny_target_dir)
    assert found[f"engine {url}: version"].detail.startswith(
        "the eagle3 dev server 0.1.0-eagle3-dev (an emulation of SGLang 0.5.23"
    )
    # B3_long's longest sampled prompt (667 tokens) + max_new_tokens 96 does not fit a context of 512
    context = found[f"engine {url}: context"]
    assert context.status == "WARN" and "B3_long (667)" in context.detail and "SGLang refuses them" in context.advice
    assert found[f"engine {url}: draft"].detail == "none (plain decoding)"


def test_an_unreachable_server_fails_with_what_to_do(tmp_path, tiny_target_dir):
    from tasks.runtime.ports import free_port

    url = f"http://127.0.0.1:{free_port()}"
    config = load_config(write_demo_config(tmp_path, tiny_target_dir, server={"url": url, "launch": "none"}))
    (f,) = engine_checks(config)
    assert f.status == "FAIL" and "not reachable" in f.detail and "start the server" in f.advice
