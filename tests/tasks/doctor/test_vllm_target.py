"""tasks/doctor/vllm_target.py: what vLLM 0.32 needs of a Kimi-K2.5-style target, on the tiny kimi_k25 build with
its config.json edited into each bad case, and the group in `eagle3 doctor` for engine vllm and not for sglang."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from flows.config.file import load_config
from flows.preflight import doctor_findings
from models.common.findings import Finding
from tasks.doctor.vllm_target import (
    VllmServer,
    export_aux_ids,
    mla_disabled,
    runs_on_cpu,
    served_version,
    vllm_target_findings,
)
from tasks.serving.vllm import cpu_command
from tests.run_configs import write_demo_config

REPO = Path(__file__).resolve().parents[3]
L = 8  # decoder layers of both tiny targets
GPU_COMMAND = ["python", "-m", "vllm.entrypoints.openai.api_server", "--model", "M", "--port", "{port}"]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory) -> Path:
    """The tiny kimi_k25 target, untrained (its config and tokenizer are what is checked)."""
    from models.target.tiny import build_kimi_target

    return build_kimi_target(tmp_path_factory.mktemp("kimi") / "model", train_steps=0)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    from models.target.tiny import build_tiny_target

    return build_tiny_target(tmp_path_factory.mktemp("llama") / "model", train_steps=0)


def copy_target(src: Path, dst: Path, *, top: dict | None = None, text: dict | None = None, drop=()) -> Path:
    """`src` without its weights in `dst` (config, tokenizer and its remote code), config.json edited: `top` and `text`
    (its text config) merged in, the top-level keys in `drop` removed."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config.update(top or {})
    config["text_config"].update(text or {})
    for key in drop:
        del config[key]
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def by_name(findings: list[Finding]) -> dict[str, Finding]:
    return {f.name: f for f in findings}


def draft_server(ids: list[int], version: str | None = None, command: list[str] | None = None) -> VllmServer:
    return VllmServer("server", draft=True, aux_ids=(("draft", ids),), command=command, version=version)


# --- media_placeholder_token_id ----------------------------------------------------------------


def test_a_kimi_target_without_its_media_placeholder_fails_once_vllm_serves_a_draft(kimi, tmp_path):
    bare = copy_target(kimi, tmp_path / "bare", drop=["media_placeholder_token_id"])
    f = by_name(vllm_target_findings(str(bare), [draft_server([2, 4, 5])], cuda=True))["vllm target: media placeholder"]
    assert f.status == "FAIL"
    assert "kimi_k25 target whose top-level media_placeholder_token_id is missing" in f.detail
    assert "vllm/v1/spec_decode/llm_base_proposer.py" in f.detail and "AttributeError" in f.detail
    # the value to add: this tokenizer's <|media_pad|> (2048 in the tiny build), and Kimi-K2.5's
    assert f.advice.startswith('add "media_placeholder_token_id": 2048 (the id of <|media_pad|> in this tokenizer')
    assert "163605 in Kimi-K2.5" in f.advice and str(bare / "config.json") in f.advice

    # not read without a draft (generate alone): no finding
    plain = VllmServer("server", command=None)
    assert "vllm target: media placeholder" not in by_name(vllm_target_findings(str(bare), [plain], cuda=True))

    ok = by_name(vllm_target_findings(str(kimi), [draft_server([2, 4, 5])], cuda=True))
    assert ok["vllm target: media placeholder"].status == "PASS"
    assert ok["vllm target: media placeholder"].detail.startswith("media_placeholder_token_id 2048")


# --- aux layer ids -------------------------------------------------------------------------------


def test_aux_id_0_fails_on_the_deepseek_class_and_not_on_llama(kimi, llama):
    f = by_name(vllm_target_findings(str(kimi), [draft_server([0, 4, 5])], cuda=True))["vllm target: aux ids, draft"]
    assert f.status == "FAIL"
    assert "ids [0, 4, 5] for KimiK25ForConditionalGeneration, L = 8" in f.detail
    assert "deepseek_v2.py" in f.detail and "id 0 crashes its forward (TypeError: residual is None" in f.detail
    assert "our aux layer a" in f.advice and "vLLM id a + 1" in f.advice

    # llama.py's EagleModelMixin takes id 0 as the embeddings: not a crash
    ok = by_name(vllm_target_findings(str(llama), [draft_server([0, 4, 5])], cuda=True))["vllm target: aux ids, draft"]
    assert ok.status == "PASS" and "LlamaForCausalLM" in ok.detail and "EagleModelMixin" in ok.detail


def test_aux_ids_past_the_end_layer_fail_on_either_class(kimi, llama):
    for target in (kimi, llama):
        found = vllm_target_findings(str(target), [draft_server([2, 4, L + 1], version="0.32.0")], cuda=True)
        f = by_name(found)["vllm target: aux ids, draft"]
        assert f.status == "FAIL" and f"ids [{L + 1}] are past the end layer: vLLM never returns them" in f.detail


def test_the_end_layer_id_needs_vllm_0_25_on_the_deepseek_class(kimi, llama):
    def finding(target, version):
        return by_name(vllm_target_findings(str(target), [draft_server([2, 4, L], version)], cuda=True))[
            "vllm target: aux ids, draft"
        ]

    old = finding(kimi, "0.24.0")
    assert old.status == "FAIL"
    assert (
        f"the server runs vLLM 0.24.0, which never returns id {L}: it hands over one hidden state fewer" in old.detail
    )
    assert "PR #46973" in old.detail and "serve with vLLM >= 0.25.0" in old.advice
    assert f"capture.aux_layers below {L - 1}" in old.advice

    for version in ("0.25.0", "0.25.0+cpu", "0.32.0", "0.25.1.dev4+gabc"):
        assert finding(kimi, version).status == "PASS", version
        assert f"the server runs {version}" in finding(kimi, version).detail

    unknown = finding(kimi, None)
    assert unknown.status == "WARN"
    assert f"id {L}, the end layer's output, is returned only by vLLM >= 0.25.0" in unknown.detail
    assert "version is not known here" in unknown.detail and ">= 0.25.0" in unknown.advice
    pre = finding(kimi, "0.25.0.dev12+g1234")  # built between 0.24 and 0.25: may or may not hold the fix
    assert pre.status == "WARN" and "a pre-release, 0.25.0.dev12+g1234" in pre.detail

    # llama.py returns id L in every release followed: no version needed
    assert finding(llama, "0.24.0").status == "PASS" and finding(llama, None).status == "PASS"


def test_the_capture_extraction_and_an_export_are_checked_as_their_own_lists(kimi, tmp_path):
    export = tmp_path / "final"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}))
    assert export_aux_ids(export) == [1, 3, 4] and export_aux_ids(tmp_path / "none") is None
    server = VllmServer("server", draft=True, aux_ids=(("draft", [2, 4, 5]), ("export", export_aux_ids(export) or [])))
    capture = VllmServer("capture.engine", aux_ids=(("capture", [2, 4, 5, L]),), version="0.24.0")
    found = by_name(vllm_target_findings(str(kimi), [server, capture], cuda=True))
    assert found["vllm target: aux ids, draft"].status == "PASS"
    assert (
        found["vllm target: aux ids, export"].status == "PASS"
        and "ids [1, 3, 4]" in found["vllm target: aux ids, export"].detail
    )
    assert found["vllm target: aux ids, capture"].status == "FAIL"
    assert "never returns id 8" in found["vllm target: aux ids, capture"].detail
    # the extraction always asks for the end layer: the way out is a newer vLLM or the DeepSpeed capture
    assert "capture.backend: deepspeed" in found["vllm target: aux ids, capture"].advice


# --- MLA on CPU ----------------------------------------------------------------------------------


def test_mla_sizes_other_than_512_64_fail_on_cpu_unless_mla_is_disabled(kimi, tmp_path):
    small = copy_target(kimi, tmp_path / "small", text={"kv_lora_rank": 256, "qk_rope_head_dim": 32})
    command = [w for w in cpu_command("python", str(small)) if w != "VLLM_MLA_DISABLE=1"]
    plain = VllmServer("server", command=command)  # generate only: no draft
    f = by_name(vllm_target_findings(str(small), [plain], cuda=True, environ={}))["vllm target: server: MLA on CPU"]
    assert f.status == "FAIL"
    assert "kv_lora_rank 256, qk_rope_head_dim 32" in f.detail
    assert "takes only kv_lora_rank 512 with qk_rope_head_dim 64" in f.detail and "cpu_mla.py" in f.detail
    assert "add VLLM_MLA_DISABLE=1 to server.command" in f.advice

    # disabled in the command (cpu_command's own recipe) or inherited from the environment: MLA as plain attention
    for server, environ in (
        (VllmServer("server", command=cpu_command("python", str(small))), {}),
        (plain, {"VLLM_MLA_DISABLE": "1"}),
    ):
        ok = by_name(vllm_target_findings(str(small), [server], cuda=True, environ=environ))
        assert ok["vllm target: server: MLA on CPU"].status == "PASS"
        assert "with VLLM_MLA_DISABLE=1: MLA runs as plain attention" in ok["vllm target: server: MLA on CPU"].detail

    # a GPU machine's command (no VLLM_CPU_KVCACHE_SPACE): no CPU rule; the same command on a machine without CUDA
    gpu = VllmServer("server", command=GPU_COMMAND)
    assert "vllm target: server: MLA on CPU" not in by_name(
        vllm_target_findings(str(small), [gpu], cuda=True, environ={})
    )
    cpu = by_name(vllm_target_findings(str(small), [gpu], cuda=False, environ={}))
    assert cpu["vllm target: server: MLA on CPU"].status == "FAIL"


def test_an_mla_draft_on_cpu_needs_mla_on_and_cpu_command_leaves_it_on(kimi):
    """The reverse of the Llama-style draft's rule: an MLA draft runs on CPU_MLA like the target; with
    VLLM_MLA_DISABLE=1 only the target leaves it and vLLM refuses the pair (measured: "No common block size for 128
    (CPU_ATTN: [MultipleOf(32)]; CPU_MLA: [16])")."""
    mla_on = cpu_command("python", str(kimi), mla_draft=True)
    assert "VLLM_MLA_DISABLE=1" not in mla_on and "VLLM_MLA_DISABLE=1" in cpu_command("python", str(kimi))
    # and with MLA on, vLLM's own rotary code instead of its CPU kernel (tests/tasks/serving/test_vllm_rope.py)
    assert mla_on[mla_on.index("--compilation-config") + 1] == '{"custom_ops": ["-rotary_embedding"]}'
    assert "--compilation-config" not in cpu_command("python", str(kimi))
    name = "vllm target: server: MLA draft on CPU"

    def found(command: list[str], environ: dict[str, str]) -> Finding:
        server = VllmServer("server", draft=True, aux_ids=(("draft", [2, 4, 5]),), command=command, mla_draft=True)
        found = by_name(vllm_target_findings(str(kimi), [server], cuda=True, environ=environ))
        assert "vllm target: server: draft on MLA (CPU)" not in found  # the Llama-style draft's rule does not apply
        return found[name]

    assert found(mla_on, {}).status == "PASS"
    rope = "vllm target: server: MLA rope on CPU"  # vLLM's CPU rotary kernel on MLA's strided views
    server = VllmServer("server", draft=True, aux_ids=(("draft", [2, 4, 5]),), command=mla_on, mla_draft=True)
    assert rope not in by_name(vllm_target_findings(str(kimi), [server], cuda=True, environ={}))
    at = mla_on.index("--compilation-config")
    kernel_on = mla_on[:at] + mla_on[at + 2 :]
    server = VllmServer("server", draft=True, aux_ids=(("draft", [2, 4, 5]),), command=kernel_on, mla_draft=True)
    warned = by_name(vllm_target_findings(str(kimi), [server], cuda=True, environ={}))[rope]
    assert warned.status == "WARN" and "--compilation-config" in warned.advice
    for command, environ in ((cpu_command("python", str(kimi)), {}), (mla_on, {"VLLM_MLA_DISABLE": "1"})):
        f = found(command, environ)
        assert f.status == "FAIL" and "No common block size" in f.detail
        assert f.advice.startswith("remove VLLM_MLA_DISABLE from server.command")


def test_a_draft_on_an_mla_target_on_cpu_fails_without_mla_disabled(kimi):
    command = [w for w in cpu_command("python", str(kimi)) if w != "VLLM_MLA_DISABLE=1"]
    found = by_name(vllm_target_findings(str(kimi), [draft_server([2, 4, 5], command=command)], cuda=True, environ={}))
    assert found["vllm target: server: MLA on CPU"].status == "PASS"  # 512/64: the kernel's sizes
    assert "the sizes of its CPU MLA kernel" in found["vllm target: server: MLA on CPU"].detail
    f = found["vllm target: server: draft on MLA (CPU)"]
    assert f.status == "FAIL"
    assert 'share no KV block size, so vLLM refuses it at start ("No common block size for 16"' in f.detail
    assert "vllm/v1/worker/utils.py" in f.detail and "add VLLM_MLA_DISABLE=1 to server.command" in f.advice

    good = draft_server([2, 4, 5], version="0.32.0", command=cpu_command("python", str(kimi)))
    ok = vllm_target_findings(str(kimi), [good], cuda=True, environ={})
    assert {f.status for f in ok} == {"PASS"}
    assert set(by_name(ok)) == {
        "vllm target: media placeholder",
        "vllm target: aux ids, draft",
        "vllm target: server: MLA on CPU",
    }


def test_what_counts_as_cpu_and_as_mla_disabled():
    assert runs_on_cpu(cpu_command("python", "M"), cuda=True)
    assert runs_on_cpu(["bash", "-c", "VLLM_CPU_KVCACHE_SPACE=4 vllm serve M"], cuda=True)
    assert not runs_on_cpu(GPU_COMMAND, cuda=True) and runs_on_cpu(GPU_COMMAND, cuda=False)
    assert mla_disabled(["env", "VLLM_MLA_DISABLE=1", "python"], {})
    assert not mla_disabled(["env", "VLLM_MLA_DISABLE=0", "python"], {"VLLM_MLA_DISABLE": "1"})  # the command's wins
    assert mla_disabled(["python"], {"VLLM_MLA_DISABLE": "1"}) and not mla_disabled(["python"], {})


def test_a_llama_target_with_nothing_vllm_specific_passes_saying_so(llama):
    (f,) = vllm_target_findings(str(llama), [VllmServer("server")], cuda=True)
    assert f.status == "PASS" and f.detail == "LlamaForCausalLM: no draft, extraction or CPU command of vLLM to check"


# --- through `eagle3 doctor` ---------------------------------------------------------------------


def test_doctor_has_the_group_for_engine_vllm_and_not_for_sglang(kimi, tmp_path):
    command = cpu_command(".venv-vllm/bin/python", str(kimi))
    vllm = load_config(
        write_demo_config(
            tmp_path, kimi, server={"engine": "vllm", "launch": "command", "command": command}, eval={"backend": "both"}
        )
    )
    group = {f.name: f for g, f in doctor_findings(vllm, ["generate", "eval"]) if g == "vllm target"}
    assert {n: f.status for n, f in group.items()} == {
        "vllm target: media placeholder": "PASS",
        "vllm target: aux ids, draft": "PASS",  # ids [2, 4, 5]: no end layer, so no version needed
        "vllm target: server: MLA on CPU": "PASS",
    }
    assert "ids [2, 4, 5] for KimiK25ForConditionalGeneration" in group["vllm target: aux ids, draft"].detail

    sglang = load_config(write_demo_config(tmp_path, kimi))  # the demo's: SGLang's dev server, in-process eval
    assert not [f for g, f in doctor_findings(sglang, ["generate", "eval"]) if g == "vllm target"]


def test_doctor_reads_the_running_capture_servers_version(kimi, tmp_path, serve_app):
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    app = Starlette(routes=[Route("/version", lambda request: JSONResponse({"version": "0.24.0"}))])
    with serve_app(app) as url:
        assert served_version([url], None) == "0.24.0"
        config = load_config(write_demo_config(tmp_path, kimi, capture={"backend": "vllm", "engine": {"url": url}}))
        group = {f.name: f for g, f in doctor_findings(config, ["capture"]) if g == "vllm target"}
    f = group["vllm target: aux ids, capture"]
    assert f.status == "FAIL" and "ids [2, 4, 5, 8]" in f.detail and "vLLM 0.24.0, which never returns id 8" in f.detail


def test_a_target_without_a_config_json_warns_that_nothing_was_checked(tmp_path):
    (f,) = vllm_target_findings(str(tmp_path / "missing"), [draft_server([2, 4, 5])], cuda=True)
    assert f.status == "WARN" and "no config.json here or in the Hugging Face cache" in f.detail
