"""The MLA draft's export (`draft_arch: mla`): what SGLang 0.5.23 (srt/models/kimi_k25_eagle3.py) and vLLM 0.32
(model_executor/models/deepseek_eagle3.py) load, round trip, and each loader's refusals; Kimi-K2.5's MLA draft shape."""

from __future__ import annotations

import json
import types
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models.draft.config import Eagle3Config
from models.draft.eagle3 import Eagle3Draft
from models.draft.vocab import draft_vocab
from models.export.eagle3 import export_draft, load_exported_draft
from models.export.sglang import load_problems, validate_export
from models.export.vllm import validate_export_vllm, vllm_param_name
from models.target.tiny_kimi import KIMI_FIXED
from tests.kimi_k25 import kimi_k25_config

pytestmark = pytest.mark.usefixtures("one_torch_thread_in_module")

V, D = 300, 64
TARGET = {  # the target's text config as export_draft reads it (a tiny DeepSeek-V3: MLA widths, YaRN)
    "model_type": "deepseek_v3",
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 8,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "q_lora_rank": 24,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 16,
    "v_head_dim": 12,
    "rope_theta": 50000.0,
    "rope_scaling": dict(KIMI_FIXED["rope_scaling"]),  # Kimi-K2.5's YaRN
    "max_position_embeddings": 262144,
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "eos_token_id": 1,
    "pad_token_id": 0,
}


def mla_draft(**overrides) -> Eagle3Draft:
    torch.manual_seed(0)
    cfg = Eagle3Config.from_target_config(
        types.SimpleNamespace(**TARGET), draft_vocab_size=D, aux_layers=[1, 3, 4], draft_arch="mla", **overrides
    )
    draft = Eagle3Draft(cfg)
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(0, 0.2)
    counts = torch.randint(0, 50, (V,), generator=torch.Generator().manual_seed(1)).numpy()
    draft.set_draft_vocab(*draft_vocab(counts, V, D))
    return draft


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> Path:
    return export_draft(
        mla_draft(), tmp_path_factory.mktemp("mla") / "draft", target_config=TARGET, dtype=torch.float32
    )


def test_the_export_is_what_both_engines_load_and_round_trips(exported):
    cfg = json.loads((exported / "config.json").read_text())
    assert cfg["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    assert {
        k: cfg[k] for k in ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
    } == {
        "q_lora_rank": 24,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 8,
        "qk_rope_head_dim": 16,
        "v_head_dim": 12,
    }
    assert cfg["rope_scaling"]["factor"] == 64.0 and cfg["rope_scaling"]["type"] == "yarn"  # the target's, as trained
    assert "head_dim" not in cfg  # DeepseekV2Config derives it (as qk_rope_head_dim)
    names = set(load_file(str(exported / "model.safetensors")))
    assert {n for n in names if "self_attn" in n} == {
        f"midlayer.self_attn.{n}.weight"
        for n in (
            "q_a_proj",
            "q_a_layernorm",
            "q_b_proj",
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        )
    }
    assert validate_export(exported) == [] and validate_export_vllm(exported) == []

    draft, loaded = mla_draft(), load_exported_draft(exported)
    assert loaded.config.draft_arch == "mla" and loaded.config.rope_scaling == draft.config.rope_scaling
    ids = torch.randint(0, V, (2, 7))
    aux = torch.randn(2, 7, 3 * TARGET["hidden_size"])
    positions = torch.arange(5000, 5007).expand(2, 7)  # past the original 4k context: YaRN's range
    assert torch.equal(draft(ids, aux, positions).logits, loaded(ids, aux, positions).logits)


def test_plain_rope_is_written_as_null(tmp_path):
    out = export_draft(mla_draft(target_rope=False), tmp_path / "plain", target_config=TARGET, dtype=torch.float32)
    assert json.loads((out / "config.json").read_text())["rope_scaling"] is None
    assert validate_export(out) == [] and validate_export_vllm(out) == []
    assert load_exported_draft(out).config.rope_scaling is None


def test_vllm_fuses_the_latent_projections_as_its_mapper_does():
    assert vllm_param_name("midlayer.self_attn.q_a_proj.weight") == (
        "model.layers.0.self_attn.fused_qkv_a_proj.weight",
        0,
    )
    assert vllm_param_name("midlayer.self_attn.kv_a_proj_with_mqa.weight") == (
        "model.layers.0.self_attn.fused_qkv_a_proj.weight",
        1,
    )
    assert vllm_param_name("midlayer.self_attn.kv_b_proj.weight") == ("model.layers.0.self_attn.kv_b_proj.weight", None)


def _edited(src: Path, dst: Path, config=None, tensors=None) -> Path:
    dst.mkdir()
    cfg = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(config(cfg) if config else cfg))
    weights = load_file(str(src / "model.safetensors"))
    save_file(tensors(weights) if tensors else weights, str(dst / "model.safetensors"))
    return dst


def test_each_loader_refuses_what_it_would_not_serve(exported, tmp_path):
    v3 = _edited(exported, tmp_path / "v3", config=lambda c: {**c, "model_type": "deepseek_v3"})
    assert any("MTP" in p for p in validate_export_vllm(v3)) and any("model_type" in p for p in validate_export(v3))

    no_norm = _edited(
        exported,
        tmp_path / "no_norm",
        tensors=lambda t: {k: v for k, v in t.items() if "q_a_layernorm" not in k},
    )
    assert any("q_a_layernorm" in p for p in validate_export(no_norm))
    assert any("q_a_layernorm" in p for p in validate_export_vllm(no_norm))

    residual = _edited(exported, tmp_path / "residual", config=lambda c: {**c, "norm_before_residual": True})
    assert any("kimi_k25_eagle3.py" in p for p in validate_export(residual))  # SGLang's MLA layer keeps h
    assert validate_export_vllm(residual) == [] and load_problems(residual) == []  # vLLM's applies it

    fc_norm = _edited(exported, tmp_path / "fc", config=lambda c: {**c, "norm_before_fc": True})
    assert any("input_norm" in p for p in validate_export(fc_norm))
    assert any("input_norm" in p for p in validate_export_vllm(fc_norm))

    dynamic = _edited(exported, tmp_path / "dyn", config=lambda c: {**c, "rope_scaling": {"type": "dynamic"}})
    assert any("rope_scaling type 'dynamic'" in p for p in validate_export(dynamic))

    no_q_lora = _edited(exported, tmp_path / "noq", config=lambda c: {k: v for k, v in c.items() if k != "q_lora_rank"})
    assert any("q_lora_rank" in p for p in validate_export(no_q_lora))


def test_kimi_k25_mla_draft_takes_the_target_s_widths_and_yarn():
    text = kimi_k25_config()["text_config"]
    cfg = Eagle3Config.from_target_config(
        types.SimpleNamespace(**text), draft_vocab_size=32000, aux_layers=[1, 29, 57], draft_arch="mla"
    )
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == (
        1536,
        512,
        128,
        64,
        128,
    )
    assert cfg.num_key_value_heads == cfg.num_attention_heads == 64
    assert cfg.rope_scaling is not None and cfg.rope_scaling["factor"] == 64.0 and cfg.rope_theta == 50000.0
    with pytest.raises(ValueError, match="MLA target"):
        llama = types.SimpleNamespace(**{k: v for k, v in text.items() if k != "kv_lora_rank"})
        Eagle3Config.from_target_config(llama, 32000, [1, 29, 57], draft_arch="mla")


def test_the_speculators_format_refuses_an_mla_draft(exported):
    from models.export.speculators import to_speculators_config

    with pytest.raises(ValueError, match="Llama-layer drafts only"):
        to_speculators_config(
            json.loads((exported / "config.json").read_text()), verifier="t", verifier_architectures=[], num_steps=3
        )
