"""EAGLE-3 export for SGLang: round trip, exact names/shapes/config, validation, atomic replace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import models.eagle3_export as ex
from models.draft_vocab import draft_vocab
from models.eagle3 import Eagle3Config, Eagle3Draft, KVCache, default_aux_layers
from models.eagle3_export import export_draft, load_exported_draft, validate_export

D = 64
REFERENCE_NAMES = {  # /work/shared/REFERENCE.md, "Export that SGLang loads"
    "fc.weight", *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
    "norm.weight", "lm_head.weight", "d2t", "t2d",
}


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> dict:
    return json.loads((tiny_target_dir / "config.json").read_text())


@pytest.fixture(scope="module")
def draft(tiny_target_dir: Path) -> Eagle3Draft:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_target_dir)
    model = Eagle3Draft(Eagle3Config.from_target_config(hf, D, default_aux_layers(hf.num_hidden_layers)))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name != "embed_tokens.weight":  # random norms too, so every tensor matters
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.ndim > 1 else 0.1) + (p.ndim == 1))
    embed = load_file(str(tiny_target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    model.load_target_embedding(embed)
    counts = torch.randint(0, 100, (hf.vocab_size,), generator=g).numpy()
    model.set_draft_vocab(*draft_vocab(counts, hf.vocab_size, D))
    return model.eval()


def _two_steps(model: Eagle3Draft, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """An extend over 6 positions from aux features, then one draft step from its hidden."""
    g = torch.Generator().manual_seed(seed)
    c = model.config
    ids = torch.randint(0, c.vocab_size, (2, 6), generator=g)
    aux = torch.randn(2, 6, 3 * c.target_hidden_size, generator=g)
    with torch.no_grad():
        first = model(ids, aux, cache=(cache := KVCache()))
        second = model(ids[:, -1:], first.hidden[:, -1:], cache=cache)
    return first.logits, second.logits


def test_round_trip_fp32_gives_identical_logits(draft, target, tmp_path):
    out = export_draft(draft, tmp_path / "draft", target_config=target, dtype=torch.float32)
    loaded = load_exported_draft(out)
    for name, t in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    for a, b in zip(_two_steps(draft), _two_steps(loaded)):
        assert torch.equal(a, b)


def test_names_shapes_and_config(draft, target, tmp_path):
    out = export_draft(draft, tmp_path / "draft", target_config=target)  # bf16 default
    c = draft.config
    H, Ht, hd = c.hidden_size, c.target_hidden_size, c.head_dim
    expected = {
        "fc.weight": (H, 3 * Ht),
        "midlayer.self_attn.q_proj.weight": (c.num_attention_heads * hd, 2 * H),
        "midlayer.self_attn.k_proj.weight": (c.num_key_value_heads * hd, 2 * H),
        "midlayer.self_attn.v_proj.weight": (c.num_key_value_heads * hd, 2 * H),
        "midlayer.self_attn.o_proj.weight": (H, c.num_attention_heads * hd),
        "midlayer.mlp.gate_proj.weight": (c.intermediate_size, H),
        "midlayer.mlp.up_proj.weight": (c.intermediate_size, H),
        "midlayer.mlp.down_proj.weight": (H, c.intermediate_size),
        **{f"midlayer.{n}.weight": (H,) for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")},
        "norm.weight": (H,), "lm_head.weight": (D, H), "d2t": (D,), "t2d": (c.vocab_size,),
        "embed_tokens.weight": (c.vocab_size, H),
    }
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == REFERENCE_NAMES | {"embed_tokens.weight"} == set(expected)
    assert {n: tuple(t.shape) for n, t in tensors.items()} == expected
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    assert all(t.dtype == torch.bfloat16 for n, t in tensors.items() if n not in ("d2t", "t2d"))
    assert torch.equal(tensors["d2t"], draft.d2t) and torch.equal(tensors["t2d"], draft.t2d)
    assert torch.equal(tensors["embed_tokens.weight"], draft.embed_tokens.weight.bfloat16())

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["model_type"] == "llama"
    assert (cfg["draft_vocab_size"], cfg["vocab_size"], cfg["target_hidden_size"]) == (D, target["vocab_size"], Ht)
    assert cfg["max_position_embeddings"] == target["max_position_embeddings"]
    assert cfg["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": c.aux_layers, "use_aux_hidden_state": True}
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == default_aux_layers(target["num_hidden_layers"])
    assert (cfg["num_hidden_layers"], cfg["tie_word_embeddings"], cfg["torch_dtype"]) == (1, False, "bfloat16")
    assert (cfg["head_dim"], cfg["hidden_act"], cfg["rope_scaling"]) == (hd, "silu", None)
    bf16 = load_exported_draft(out)
    assert bf16.fc.weight.dtype == torch.bfloat16 and torch.equal(bf16.fc.weight, draft.fc.weight.bfloat16())


def _rewrite(src: Path, dst: Path, edit) -> Path:
    """Copy an export to `dst` with its tensors passed through `edit(dict) -> dict`."""
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(edit(load_file(str(src / "model.safetensors"))), str(dst / "model.safetensors"))
    return dst


def test_validate_export_catches_problems(draft, target, tmp_path):
    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    assert validate_export(good) == []

    def drop(t): return {k: v for k, v in t.items() if k != "midlayer.mlp.up_proj.weight"}
    def reshape(t): return {**t, "lm_head.weight": t["lm_head.weight"][:-1]}
    def extra(t): return {**t, "layers.0.mlp.gate_proj.weight": t["midlayer.mlp.gate_proj.weight"].clone()}
    def bad_t2d(t): return {**t, "t2d": ~t["t2d"]}
    for edit, needle in ((drop, "missing tensor midlayer.mlp.up_proj.weight"),
                         (reshape, "lm_head.weight: shape"),
                         (extra, "unknown tensor layers.0.mlp.gate_proj.weight"),
                         (bad_t2d, "t2d does not mark")):
        problems = validate_export(_rewrite(good, tmp_path / edit.__name__, edit))
        assert len(problems) == 1 and needle in problems[0], problems

    cfg = json.loads((good / "config.json").read_text())
    cfg.pop("draft_vocab_size")
    (tmp_path / "bad_cfg").mkdir()
    (tmp_path / "bad_cfg" / "config.json").write_text(json.dumps(cfg))
    assert any("draft_vocab_size" in p for p in validate_export(tmp_path / "bad_cfg"))

    # export_draft refuses what SGLang cannot serve (its LlamaMLP is silu-only) and writes nothing.
    gelu = Eagle3Draft(Eagle3Config(**{**vars(draft.config), "hidden_act": "gelu"}))
    with pytest.raises(ValueError, match="hidden_act"):
        export_draft(gelu, tmp_path / "gelu", target_config=target)
    assert not (tmp_path / "gelu").exists()


def test_export_is_atomic(draft, target, tmp_path, monkeypatch):
    out = export_draft(draft, tmp_path / "draft", target_config=target, dtype=torch.float32)
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def crash(tensors, path, metadata=None):
        Path(path).write_bytes(b"partial")
        raise OSError("disk full")

    with monkeypatch.context() as m:
        m.setattr(ex, "save_file", crash)
        with pytest.raises(OSError, match="disk full"):
            export_draft(draft, out, target_config=target)
    real_rename, calls = os.rename, []

    def rename_fails_second(a, b):  # out -> .old works, tmp -> out fails, .old -> out restores
        calls.append((a, b))
        if len(calls) == 2:
            raise OSError("rename failed")
        real_rename(a, b)

    with monkeypatch.context() as m:
        m.setattr(os, "rename", rename_fails_second)
        with pytest.raises(OSError, match="rename failed"):
            export_draft(draft, out, target_config=target)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["draft"]  # no temp or .old dirs left

    export_draft(draft, out, target_config=target, dtype=torch.bfloat16)  # a finished export replaces it
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        assert f.get_slice("fc.weight").get_dtype() == "BF16"
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(FileExistsError):
        export_draft(draft, tmp_path / "other", target_config=target)
