"""Other trainers' drafts: the speculators format read and written, and its two norm options computed as vLLM does."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from models.draft.config import DRAFT_VARIANTS, Eagle3Config, default_aux_layers
from models.export.convert import convert_draft
from models.export.eagle3 import export_draft, load_exported_draft
from models.export.sglang import load_problems, validate_export
from models.export.vllm import validate_export_vllm
from tests.drafts import random_draft

D = 64


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> dict:
    return json.loads((tiny_target_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def embedding(tiny_target_dir: Path) -> torch.Tensor:
    return load_file(str(tiny_target_dir / "model.safetensors"))["model.embed_tokens.weight"]


def speculators_dir(out: Path, target: dict, *, seed: int = 3) -> tuple[Path, dict[str, torch.Tensor]]:
    """A draft as speculators 0.9.0 saves one with its training defaults (norm_before_residual and norm_before_fc on),
    written here by hand from its schema (src/speculators/models/eagle3/config.py, core.py): config.json with
    `transformer_layer_config` and `speculators_config`, the layer as `layers.0.*`, no embed_tokens."""
    H, Hkv, heads, F_, V, L = (
        target["hidden_size"],
        target["num_key_value_heads"],
        target["num_attention_heads"],
        target["intermediate_size"],
        target["vocab_size"],
        target["num_hidden_layers"],
    )
    hd = H // heads
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, norm=False):
        return torch.randn(*shape, generator=g) * 0.1 + (1.0 if norm else 0.0)

    ids = torch.sort(torch.randperm(V, generator=g)[:D]).values
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[ids] = True
    tensors = {
        "fc.weight": rnd(H, 3 * H),
        "input_norm.weight": rnd(3 * H, norm=True),
        "layers.0.self_attn.q_proj.weight": rnd(heads * hd, 2 * H),
        "layers.0.self_attn.k_proj.weight": rnd(Hkv * hd, 2 * H),
        "layers.0.self_attn.v_proj.weight": rnd(Hkv * hd, 2 * H),
        "layers.0.self_attn.o_proj.weight": rnd(H, heads * hd),
        "layers.0.mlp.gate_proj.weight": rnd(F_, H),
        "layers.0.mlp.up_proj.weight": rnd(F_, H),
        "layers.0.mlp.down_proj.weight": rnd(H, F_),
        "layers.0.hidden_norm.weight": rnd(H, norm=True),
        "layers.0.input_layernorm.weight": rnd(H, norm=True),
        "layers.0.post_attention_layernorm.weight": rnd(H, norm=True),
        "norm.weight": rnd(H, norm=True),
        "lm_head.weight": rnd(D, H),
        "d2t": ids - torch.arange(D),
        "t2d": t2d,
    }
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "speculators_version": "0.9.0",
        "transformer_layer_config": {
            "model_type": "llama",
            "vocab_size": V,
            "hidden_size": H,
            "intermediate_size": F_,
            "num_hidden_layers": 1,
            "num_attention_heads": heads,
            "num_key_value_heads": Hkv,
            "max_position_embeddings": target["max_position_embeddings"],
            "rms_norm_eps": 1e-6,
            "torch_dtype": "float32",
        },
        "draft_vocab_size": D,
        "norm_before_residual": True,
        "norm_before_fc": True,
        "fc_norm": False,
        "norm_output": False,
        "target_hidden_size": None,
        "eagle_aux_hidden_state_layer_ids": [2, L // 2, L - 3],
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "default_proposal_method": "greedy",
            "verifier": {"name_or_path": "some/target", "architectures": ["LlamaForCausalLM"]},
        },
    }
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out, tensors


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return w * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


def test_a_speculators_draft_is_read_with_its_norms_as_vllm_computes_them(tmp_path, target, embedding):
    """One position, computed by hand from vLLM 0.32's llama_eagle3.py: input_norm before fc, the residual taken
    after hidden_norm (norm_before_residual), attention over one key = its value."""
    src, t = speculators_dir(tmp_path / "spec", target)
    assert load_problems(src) == [] and validate_export_vllm(src) == []
    draft = load_exported_draft(src)
    L = target["num_hidden_layers"]
    assert draft.config.aux_layers == [1, L // 2 - 1, L - 4]  # vLLM's capture indices [2, L//2, L-3], less one
    assert (draft.config.norm_before_fc, draft.config.norm_before_residual) == (True, True)
    draft.load_target_embedding(embedding)  # no embed_tokens in the file: the target's, as vLLM shares it

    g = torch.Generator().manual_seed(5)
    token = torch.randint(0, target["vocab_size"], (1, 1), generator=g)
    aux = torch.randn(1, 1, 3 * target["hidden_size"], generator=g)
    with torch.no_grad():
        logits = draft(token, aux).logits[0, 0]

        h = F.linear(rms(aux[0, 0], t["input_norm.weight"]), t["fc.weight"])
        normed = rms(h, t["layers.0.hidden_norm.weight"])
        x = torch.cat([rms(embedding[token[0, 0]], t["layers.0.input_layernorm.weight"]), normed])
        v = F.linear(x, t["layers.0.self_attn.v_proj.weight"]).view(target["num_key_value_heads"], -1)
        groups = target["num_attention_heads"] // target["num_key_value_heads"]
        attn = F.linear(v.repeat_interleave(groups, 0).reshape(-1), t["layers.0.self_attn.o_proj.weight"])
        h1 = normed + attn  # residual = hidden_norm(h)
        m = rms(h1, t["layers.0.post_attention_layernorm.weight"])
        mlp = F.linear(
            F.silu(F.linear(m, t["layers.0.mlp.gate_proj.weight"])) * F.linear(m, t["layers.0.mlp.up_proj.weight"]),
            t["layers.0.mlp.down_proj.weight"],
        )
        expected = F.linear(rms(h1 + mlp, t["norm.weight"]), t["lm_head.weight"])
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-5)
    # the draft vocab of the file: draft index i proposes target id i + d2t[i]
    assert torch.equal(draft.draft_to_target(torch.arange(D)), torch.arange(D) + t["d2t"])

    # SGLang reads neither the format nor norm_before_residual: refused, with what to do
    assert "eagle3 export" in validate_export(src)[0] and "speculators" in validate_export(src)[0]
    with pytest.raises(ValueError, match="norm_before_residual"):
        convert_draft(src, tmp_path / "sg", to="sglang", verifier="x", verifier_architectures=[], num_steps=3)
    assert not (tmp_path / "sg").exists()


def test_our_draft_written_as_speculators_and_back_is_unchanged(tmp_path, target, embedding, tiny_target_dir):
    config = Eagle3Config.from_target_config(
        type("C", (), target)(), D, default_aux_layers(target["num_hidden_layers"]), **DRAFT_VARIANTS["eagle3"]
    )
    ours = export_draft(random_draft(config, embedding), tmp_path / "final", target_config=target, dtype=torch.float32)
    spec = convert_draft(
        ours,
        tmp_path / "spec",
        to="speculators",
        verifier=str(tiny_target_dir),
        verifier_architectures=["LlamaForCausalLM"],
        num_steps=3,
    )
    cfg = json.loads((spec / "config.json").read_text())
    ours_cfg = json.loads((ours / "config.json").read_text())
    # what vLLM reads (vllm/transformers_utils/configs/speculators): the verifier, tokens per round, aux ids
    assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(tiny_target_dir)
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 3
    assert cfg["eagle_aux_hidden_state_layer_ids"] == ours_cfg["eagle_aux_hidden_state_layer_ids"]
    assert cfg["norm_before_residual"] is False  # written: vLLM takes an absent key as true
    assert cfg["transformer_layer_config"]["model_type"] == "llama"
    theirs, mine = load_file(str(spec / "model.safetensors")), load_file(str(ours / "model.safetensors"))
    assert sorted(theirs) == sorted(n.replace("midlayer.", "layers.0.") for n in mine)
    for name, tensor in mine.items():
        assert torch.equal(theirs[name.replace("midlayer.", "layers.0.")], tensor), name
    assert validate_export_vllm(spec) == [] and load_problems(spec) == []

    back = convert_draft(spec, tmp_path / "back", to="sglang", verifier="", verifier_architectures=[], num_steps=3)
    assert validate_export(back) == [] and validate_export_vllm(back) == []
    again = load_file(str(back / "model.safetensors"))
    assert sorted(again) == sorted(mine) and all(torch.equal(again[n], mine[n]) for n in mine)
    round_trip = json.loads((back / "config.json").read_text())
    for key in ("hidden_size", "head_dim", "draft_vocab_size", "eagle_config", "max_position_embeddings", "rope_theta"):
        assert round_trip[key] == ours_cfg[key], key


def test_a_speculators_draft_that_does_not_say_its_layers_is_refused_with_what_to_write(tmp_path, target):
    src, _ = speculators_dir(tmp_path / "spec", target)
    cfg = json.loads((src / "config.json").read_text())
    cfg.pop("eagle_aux_hidden_state_layer_ids")
    (src / "config.json").write_text(json.dumps(cfg))
    [problem] = load_problems(src)
    assert "eagle_aux_hidden_state_layer_ids" in problem and "[2, L//2, L-3]" in problem
    cfg["transformer_layer_config"]["model_type"] = "qwen3"
    cfg["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]
    (src / "config.json").write_text(json.dumps(cfg))
    assert "qwen3" in load_problems(src)[0]
