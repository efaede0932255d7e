"""tasks/doctor/draft.py through the preflight and `eagle3 doctor`: every draft a stage will serve (eval.draft as the
train stage's export or a directory, `eagle3 eval --draft DIR`) is checked against the rules of what serves it.

The case of issue 50: another trainer's draft whose vLLM aux ids hold 0, measured through vLLM on the Kimi-shaped
target, passed the preflight; vLLM 0.32's worker then crashed on the first request (models/export/vllm.py
`aux_id_zero_problem`).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from flows.config.file import load_config
from flows.preflight import PreflightFailed, doctor_findings, preflight
from models.common.findings import Finding
from tasks.serving.vllm import cpu_command
from tests.run_configs import write_demo_config


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    """The tiny kimi_k25 target, untrained (vLLM's DeepSeek/Kimi class serves it)."""
    from models.target.tiny import build_kimi_target

    return build_kimi_target(tmp_path_factory.mktemp("kimi") / "model", train_steps=0)


@pytest.fixture(scope="module")
def aux0_draft(kimi, tmp_path_factory) -> Path:
    """A draft for `kimi` from elsewhere whose top-level (vLLM) aux ids are [0, 4, 5]; its eagle_config (SGLang's)
    says it reads the outputs of layers [1, 3, 4], i.e. vLLM's [2, 4, 5]."""
    import torch

    from models.target.loader import load_language_model
    from tests.drafts import export_random_draft

    out = tmp_path_factory.mktemp("elsewhere") / "their-draft"
    export_random_draft(load_language_model(str(kimi), dtype=torch.float32), out, draft_vocab_size=512)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["eagle_aux_hidden_state_layer_ids"], cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]) == (
        [2, 4, 5],
        [1, 3, 4],
    )
    (out / "config.json").write_text(json.dumps({**cfg, "eagle_aux_hidden_state_layer_ids": [0, 4, 5]}))
    return out


def vllm_eval(tmp_path: Path, target: Path, **eval_settings) -> Path:
    """The demo config with the engine eval served by a launched vLLM (its CPU command), `eval_settings` merged."""
    server = {"engine": "vllm", "launch": "command", "command": cpu_command(".venv-vllm/bin/python", str(target))}
    return write_demo_config(tmp_path, target, server=server, eval={"backend": "engine", **eval_settings})


def found(findings: list[tuple[str, Finding]]) -> dict[str, Finding]:
    return {f.name: f for _, f in findings}


def test_an_eval_draft_with_vllm_aux_id_0_fails_the_preflight_of_a_vllm_eval_naming_draft_rule_and_fix(
    tmp_path, kimi, aux0_draft
):
    config = load_config(vllm_eval(tmp_path, kimi, draft=str(aux0_draft)))
    with pytest.raises(PreflightFailed) as failed:
        preflight(config, ["eval"], logging.getLogger("test"))
    said = str(failed.value)
    assert said.startswith("preflight checks for eval (") and "2 failed: " in said
    loader = found(doctor_findings(config, ["eval"], engine=False))["draft: vLLM loader"]
    assert loader.status == "FAIL"
    assert loader.detail.startswith(f"eval.draft: {aux0_draft}: top-level eagle_aux_hidden_state_layer_ids [0, 4,")
    assert "top-level eagle_aux_hidden_state_layer_ids [0, 4, 5]: vLLM 0.32 takes id k as the hidden state" in said
    assert "vllm/model_executor/models/deepseek_v2.py DeepseekV2Model.forward" in loader.detail  # the rule, cited
    assert "for the layers its eagle_config names (outputs of [1, 3, 4]) vLLM's ids are [2, 4, 5]" in loader.detail
    assert "ask its trainer for a vLLM export" in loader.advice
    # the vllm target group reads the same draft's ids with the Kimi class's rule
    crash = found(doctor_findings(config, ["eval"], engine=False))["vllm target: aux ids, eval.draft"]
    assert crash.status == "FAIL" and "ids [0, 4, 5] for KimiK25ForConditionalGeneration" in crash.detail
    assert "id 0 crashes its forward" in crash.detail and "top level of the draft's config.json" in crash.advice
    assert "vllm target: aux ids, eval.draft: eval.draft: ids [0, 4, 5]" in said


def test_the_same_draft_served_by_sglang_passes_its_rules_and_warns_of_vllm_s(tmp_path, kimi, aux0_draft):
    """SGLang reads eagle_config's ids ([1, 3, 4]): fine. vLLM's problem is said, as a warning, not a stop."""
    path = write_demo_config(
        tmp_path,
        kimi,
        server={"engine": "sglang", "launch": "none"},
        eval={"backend": "engine", "draft": str(aux0_draft)},
    )
    group = {f.name: f for g, f in doctor_findings(load_config(path), ["eval"], engine=False) if g == "draft"}
    assert {n: f.status for n, f in group.items()} == {
        "draft: sizes": "PASS",
        "draft: norm flags": "PASS",
        "draft: SGLang loader": "PASS",
        "draft: vLLM loader": "WARN",
    }
    assert group["draft: vLLM loader"].advice.startswith("the eval serves it through SGLang; serving it with vLLM")


def test_a_draft_dir_given_with_draft_is_checked_even_when_the_train_stage_runs_first(tmp_path, kimi, aux0_draft):
    """`eagle3 eval CONFIG --draft DIR` (and `run` with train,eval): the train stage writes final, not DIR."""
    config = load_config(vllm_eval(tmp_path, kimi))  # eval.draft: final, not there
    for stages in (["eval"], ["train", "eval"]):
        loader = found(doctor_findings(config, stages, engine=False, eval_draft=str(aux0_draft)))["draft: vLLM loader"]
        assert loader.status == "FAIL" and loader.detail.startswith(f"--draft {aux0_draft}: top-level ")
    # without --draft: train,eval checks no draft (the train stage writes it); eval alone needs one there
    assert "draft" not in {g for g, _ in doctor_findings(config, ["train", "eval"], engine=False)}
    missing = found(doctor_findings(config, ["eval"], engine=False))["draft"]
    assert missing.status == "FAIL" and missing.detail.startswith("eval.draft: final: no export in ")
    assert found(doctor_findings(config, engine=False))["draft"].status == "PASS"  # `eagle3 doctor`: not yet written
    gone = found(doctor_findings(config, ["eval"], engine=False, eval_draft=str(tmp_path / "nowhere")))["draft"]
    assert gone.status == "FAIL" and "not an EAGLE-3 draft directory" in gone.detail


def test_eagle3_doctor_reports_the_eval_draft_s_vllm_aux_id_0(tmp_path, kimi, aux0_draft):
    path = vllm_eval(tmp_path, kimi, draft=str(aux0_draft))
    result = CliRunner().invoke(app, ["doctor", str(path)], env={"COLUMNS": "400"})
    assert result.exit_code == 1, result.output
    assert re.search(r"\d+ passed, \d+ warnings, 2 failed", result.output)
    assert "vLLM loader" in result.output and "eagle_aux_hidden_state_layer_ids [0, 4, 5]" in result.output
