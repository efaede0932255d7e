"""EAGLE-3 export for SGLang and vLLM: round trip, exact names/shapes/config, both loaders' checks, atomic replace."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import models.export.eagle3 as ex
from models.draft.caches import KVCache
from models.draft.config import DRAFT_VARIANTS, Eagle3Config, default_aux_layers
from models.draft.eagle3 import Eagle3Draft
from models.draft.vocab import draft_vocab
from models.export.eagle3 import export_draft, has_embedding, load_exported_draft
from models.export.rules import ST_DTYPES
from models.export.sglang import validate_export
from models.export.vllm import validate_export_vllm, vllm_load_problems, vllm_param_name
from tests.drafts import random_draft

D = 64
REFERENCE_NAMES = {  # /work/shared/REFERENCE.md, "Export that SGLang loads"
    "fc.weight",
    *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
    "norm.weight",
    "lm_head.weight",
    "d2t",
    "t2d",
}


@pytest.fixture(scope="module")
def target(tiny_target_dir: Path) -> dict:
    return json.loads((tiny_target_dir / "config.json").read_text())


def _random_draft(tiny_target_dir: Path, variant: str) -> Eagle3Draft:
    from transformers import AutoConfig

    hf = AutoConfig.from_pretrained(tiny_target_dir)
    aux = default_aux_layers(hf.num_hidden_layers)
    model = Eagle3Draft(Eagle3Config.from_target_config(hf, D, aux, **DRAFT_VARIANTS[variant]))
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


@pytest.fixture(scope="module")
def draft(tiny_target_dir: Path) -> Eagle3Draft:
    return _random_draft(tiny_target_dir, "eagle3")


@pytest.fixture(scope="module")
def draft31(tiny_target_dir: Path) -> Eagle3Draft:
    return _random_draft(tiny_target_dir, "eagle3.1")


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
        "norm.weight": (H,),
        "lm_head.weight": (D, H),
        "d2t": (D,),
        "t2d": (c.vocab_size,),
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

    def drop(t):
        return {k: v for k, v in t.items() if k != "midlayer.mlp.up_proj.weight"}

    def reshape(t):
        return {**t, "lm_head.weight": t["lm_head.weight"][:-1]}

    def extra(t):
        return {**t, "layers.0.mlp.gate_proj.weight": t["midlayer.mlp.gate_proj.weight"].clone()}

    def bad_t2d(t):
        return {**t, "t2d": ~t["t2d"]}

    for edit, needle in (
        (drop, "missing tensor midlayer.mlp.up_proj.weight"),
        (reshape, "lm_head.weight: shape"),
        (extra, "unknown tensor layers.0.mlp.gate_proj.weight"),
        (bad_t2d, "t2d does not mark"),
    ):
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


def test_an_export_whose_config_says_dtype_as_transformers_5_writes_it_validates_and_loads(draft, target, tmp_path):
    """transformers 5 writes the weights' dtype as `dtype`, not `torch_dtype` (a SpecForge export saved with it);
    both engines read either key through transformers' config, so our checks and loader do too."""
    from transformers import LlamaConfig

    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    cfg = json.loads((good / "config.json").read_text())
    written = tmp_path / "written_by_transformers"
    LlamaConfig(dtype=torch.float32).save_pretrained(written)  # the key as transformers itself names it
    keys = set(json.loads((written / "config.json").read_text()))
    assert "dtype" in keys and "torch_dtype" not in keys
    cfg["dtype"] = cfg.pop("torch_dtype")
    respelled = _rewrite(good, tmp_path / "respelled", lambda t: t)
    (respelled / "config.json").write_text(json.dumps(cfg))
    assert validate_export(respelled) == [] and validate_export_vllm(respelled) == []
    loaded = load_exported_draft(respelled)
    assert loaded.fc.weight.dtype == torch.float32
    for name, t in draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name

    cfg.pop("dtype")  # neither key: a clear error naming both
    (respelled / "config.json").write_text(json.dumps(cfg))
    assert validate_export(respelled) == [f"torch_dtype (or dtype) None not one of {sorted(ST_DTYPES)}"]


def test_an_export_whose_rope_is_written_as_transformers_5_rope_parameters_validates_and_loads(draft, target, tmp_path):
    """transformers 5's save_pretrained writes `rope_parameters` and no `rope_theta` (SpecForge's draft class does:
    tests/tasks/serving/test_sglang_eagle3_real.py serves one); SGLang 0.5.23 reads it (srt/models/llama.py), so our
    checks read it too, plain or YaRN. Before: "config rope_theta must be a positive number, got None"."""
    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    cfg = json.loads((good / "config.json").read_text())
    theta = cfg.pop("rope_theta")
    cfg.pop("rope_scaling")
    cfg["rope_parameters"] = {"rope_theta": theta * 2, "rope_type": "default"}
    written = _rewrite(good, tmp_path / "written", lambda t: t)
    (written / "config.json").write_text(json.dumps(cfg))
    assert validate_export(written) == [] and validate_export_vllm(written) == []
    loaded = load_exported_draft(written)
    assert (loaded.config.rope_theta, loaded.config.rope_scaling) == (theta * 2, None)

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    cfg["rope_parameters"] = {"rope_theta": theta, **yarn}
    (written / "config.json").write_text(json.dumps(cfg))
    assert validate_export(written) == []
    assert load_exported_draft(written).config.rope_scaling == yarn
    cfg["rope_parameters"] = {"rope_type": "default"}  # no theta anywhere: still refused, by the key SGLang reads
    (written / "config.json").write_text(json.dumps(cfg))
    assert validate_export(written) == ["config rope_theta must be a positive number, got None"]


def test_an_export_without_embed_tokens_is_evaluated_with_the_target_s_embedding(
    draft, target, tiny_target_dir, tmp_path
):
    """Another trainer's export may leave the embedding out (allowed when hidden_size == target_hidden_size): the
    engines then give the draft the target's (vLLM 0.32 v1/spec_decode/llm_base_proposer.py
    `_maybe_share_embeddings`; SGLang's `set_embed`), and so does the in-process eval."""
    from transformers import AutoModelForCausalLM

    from models.eval.job import draft_for_target

    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    bare = _rewrite(good, tmp_path / "bare", lambda t: {k: v for k, v in t.items() if k != "embed_tokens.weight"})
    assert validate_export(bare) == [] and not has_embedding(bare) and has_embedding(good)
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    theirs = model.get_input_embeddings().weight  # read by transformers, not by our loader
    left_out = load_exported_draft(bare)  # what the eval measured before: not the target's embedding
    assert not torch.equal(left_out.embed_tokens.weight, theirs)
    served = draft_for_target(bare, model, torch.float32)
    assert torch.equal(served.embed_tokens.weight, theirs)
    for a, b in zip(_two_steps(served), _two_steps(load_exported_draft(good))):  # the draft that was exported
        assert torch.equal(a, b)


# --- EAGLE-3.1: fc_norm and norm_output -------------------------------------------------------------

FC_NORM = {f"fc_norm.{i}.weight" for i in range(3)}  # vLLM 0.32 / SGLang 0.5.23 llama_eagle3.py: self.fc_norm[i]


def test_eagle3_1_export_round_trips_with_its_keys_and_norms(draft, draft31, target, tmp_path):
    plain = export_draft(draft, tmp_path / "plain", target_config=target, dtype=torch.float32)
    out = export_draft(draft31, tmp_path / "v31", target_config=target, dtype=torch.float32)
    cfg, plain_cfg = (json.loads((d / "config.json").read_text()) for d in (out, plain))
    assert (cfg["fc_norm"], cfg["norm_output"]) == (True, True)
    assert (plain_cfg["fc_norm"], plain_cfg["norm_output"]) == (False, False)
    header = _header(out)
    assert set(header) == REFERENCE_NAMES | FC_NORM | {"embed_tokens.weight"}
    assert {header[n] for n in FC_NORM} == {((cfg["target_hidden_size"],), "F32")}
    assert FC_NORM.isdisjoint(_header(plain))
    assert validate_export(out) == [] and validate_export_vllm(out) == []
    loaded = load_exported_draft(out)
    assert loaded.config.variant == "eagle3.1"
    for name, t in draft31.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    for a, b in zip(_two_steps(draft31), _two_steps(loaded)):
        assert torch.equal(a, b)
    # the two variants of the same weights draft differently: the keys are read, not decorative
    assert not torch.equal(_two_steps(draft31)[1], _two_steps(load_exported_draft(plain))[1])


def test_eagle3_1_keys_and_norms_are_checked_for_both_engines(draft31, target, tmp_path):
    good = export_draft(draft31, tmp_path / "good", target_config=target, dtype=torch.float32)

    def without_norm(t):
        return {k: v for k, v in t.items() if k != "fc_norm.1.weight"}

    missing = _rewrite(good, tmp_path / "missing", without_norm)
    assert validate_export(missing) == ["missing tensor fc_norm.1.weight"]
    assert [p for p in validate_export_vllm(missing) if "fc_norm" in p] == [
        "missing tensor fc_norm.1.weight: vLLM's model.fc_norm.1.weight would not be initialized from the checkpoint"
    ]

    def with_config(name: str, **change) -> Path:
        cfg = {**json.loads((good / "config.json").read_text()), **change}
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg))
        os.link(good / "model.safetensors", tmp_path / name / "model.safetensors")
        return tmp_path / name

    # norms without fc_norm: true are tensors neither engine has a place for
    off = with_config("off", fc_norm=False)
    assert validate_export(off) == [f"unknown tensor {n}: SGLang would silently skip it" for n in sorted(FC_NORM)]
    assert sum("unknown tensor fc_norm" in p for p in validate_export_vllm(off)) == 3
    legacy = with_config("legacy", use_aux_norm=True)
    assert any("use_aux_norm" in p and "vLLM does not read it" in p for p in validate_export(legacy))
    eagle = json.loads((good / "config.json").read_text())["eagle_config"]
    for before in (  # both engines read it at the top level and inside eagle_config: an input_norm they would load
        with_config("before_fc", norm_before_fc=True),
        with_config("nested", eagle_config={**eagle, "norm_before_fc": True}),
    ):
        assert [p.split(":")[0] for p in validate_export(before)] == ["norm_before_fc and fc_norm are both set"]
        assert any(p.startswith("missing tensor input_norm.weight: vLLM's") for p in validate_export_vllm(before))
    word = with_config("word", norm_output="yes")
    assert "config norm_output must be true or false, got 'yes'" in validate_export(word)
    assert "config norm_output must be true or false, got 'yes'" in validate_export_vllm(word)


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


def _header(out: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return {n: (tuple(f.get_slice(n).get_shape()), f.get_slice(n).get_dtype()) for n in f.keys()}


def test_config_carries_aux_ids_in_each_engines_convention(draft, target, tmp_path):
    out = export_draft(draft, tmp_path / "draft", target_config=target)
    assert validate_export(out) == [] and validate_export_vllm(out) == []
    cfg = json.loads((out / "config.json").read_text())
    ours = default_aux_layers(target["num_hidden_layers"])
    assert ours == [1, 3, 4]  # outputs of 0-based layers 1, 3, 4 of the 8-layer tiny target
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # SGLang: output of layer j
    assert cfg["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: input of layer i
    assert (cfg["target_hidden_size"], cfg["draft_vocab_size"], cfg["norm_before_residual"]) == (
        target["hidden_size"],
        D,
        False,
    )


def test_vllm_name_mapping_mirrors_its_loader():
    assert vllm_param_name("midlayer.self_attn.q_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "q")
    assert vllm_param_name("midlayer.self_attn.v_proj.weight") == ("model.layers.0.self_attn.qkv_proj.weight", "v")
    assert vllm_param_name("midlayer.mlp.up_proj.weight") == ("model.layers.0.mlp.gate_up_proj.weight", 1)
    assert vllm_param_name("midlayer.self_attn.o_proj.weight") == ("model.layers.0.self_attn.o_proj.weight", None)
    assert vllm_param_name("fc.weight") == ("model.fc.weight", None)
    assert vllm_param_name("embed_tokens.weight") == ("model.embed_tokens.weight", None)
    assert vllm_param_name("lm_head.weight") == ("lm_head.weight", None)
    assert vllm_param_name("d2t") == ("draft_id_to_target_id", None)
    assert vllm_param_name("t2d") is None  # skipped by vLLM


@pytest.mark.parametrize(
    "old, new", [("midlayer.mlp.up_proj.weight", "midlayer.mlp.upproj.weight"), ("lm_head.weight", "head.weight")]
)
def test_renamed_weight_fails_both_loaders(draft, target, tmp_path, old, new):
    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    bad = _rewrite(good, tmp_path / "bad", lambda t: {(new if k == old else k): v for k, v in t.items()})
    assert validate_export(bad) == [f"missing tensor {old}", f"unknown tensor {new}: SGLang would silently skip it"]
    vllm = validate_export_vllm(bad)
    assert len(vllm) == 2, vllm
    assert vllm[0].startswith(f"unknown tensor {new}: vLLM looks it up as "), vllm
    assert vllm[1].startswith(f"missing tensor {old}: vLLM's "), vllm


def test_vllm_check_catches_shapes_d2t_and_aux_ids(draft, target, tmp_path):
    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    cfg, tensors = json.loads((good / "config.json").read_text()), _header(good)
    d2t = load_file(str(good / "model.safetensors"))["d2t"]
    assert vllm_load_problems(cfg, tensors, d2t) == []
    H = cfg["hidden_size"]

    def problems(cfg_edit=None, tensor_edit=None, d2t_values=d2t):
        return vllm_load_problems({**cfg, **(cfg_edit or {})}, {**tensors, **(tensor_edit or {})}, d2t_values)

    assert problems(tensor_edit={"fc.weight": ((H, 3 * H + 1), "F32")}) == [
        f"fc.weight (vLLM model.fc.weight): shape [{H}, {3 * H + 1}] != expected [{H}, {3 * H}]"
    ]
    assert problems(tensor_edit={"midlayer.self_attn.k_proj.weight": ((1, 2 * H), "F32")})[0].startswith(
        "midlayer.self_attn.k_proj.weight (vLLM model.layers.0.self_attn.qkv_proj.weight shard 'k'): shape [1,"
    )
    assert problems(tensor_edit={"d2t": ((D,), "F32")}) == [
        "d2t (vLLM draft_id_to_target_id): dtype F32, expected an integer type (I64)"
    ]
    shifted = d2t.clone()
    shifted[-1] = cfg["vocab_size"]  # target id D - 1 + V: outside the vocab
    assert "d2t: target ids arange(D) + d2t are not distinct ids in" in problems(d2t_values=shifted)[0]
    # a config whose top-level ids are SGLang's (no +1) or missing: vLLM would capture other layers
    assert "!= eagle_config's [1, 3, 4] + 1" in problems({"eagle_aux_hidden_state_layer_ids": [1, 3, 4]})[0]
    assert problems({"eagle_aux_hidden_state_layer_ids": None})[0].startswith(
        "top-level eagle_aux_hidden_state_layer_ids must be 3 increasing capture indices >= 1"
    )
    assert problems({"target_hidden_size": None}) == ["config target_hidden_size must be a positive int, got None"]
    assert problems({"num_hidden_layers": 2})[0].startswith("num_hidden_layers 2 != 1")
    assert problems({"architectures": ["LlamaForCausalLM"]})[0].startswith("architectures ['LlamaForCausalLM']")
    # an extra copy of a shard under vLLM's own layer name loads the same parameter twice
    assert problems(tensor_edit={"layers.0.mlp.gate_proj.weight": tensors["midlayer.mlp.gate_proj.weight"]}) == [
        "tensors layers.0.mlp.gate_proj.weight and midlayer.mlp.gate_proj.weight both load vLLM's "
        "model.layers.0.mlp.gate_up_proj.weight shard 0"
    ]


@pytest.mark.parametrize(
    "aux, needle",
    [
        ([2, 3, 4], "the first aux layer must be 1. SGLang versions disagree"),
        ([0, 3, 4], "the first aux layer must be 1"),
        ([1, 4, 3], "must be increasing"),
        ([1, 3, 7], "layer 7 is the last of the target's 8 layers"),
    ],
)
def test_export_refuses_aux_layers_engines_would_read_differently(draft, target, tmp_path, aux, needle):
    other = Eagle3Draft(Eagle3Config(**{**vars(draft.config), "aux_layers": aux}))
    with pytest.raises(ValueError, match=needle):
        export_draft(other, tmp_path / "draft", target_config=target)
    assert not (tmp_path / "draft").exists()


def test_validate_export_refuses_first_sglang_id_not_1(draft, target, tmp_path):
    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    cfg = json.loads((good / "config.json").read_text())
    cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 3, 4]
    (good / "config.json").write_text(json.dumps(cfg))
    assert validate_export(good) == [
        "eagle_config.eagle_aux_hidden_state_layer_ids [2, 3, 4]: first id must be 1 "
        "(SGLang versions read other lists differently)"
    ]


@pytest.fixture(scope="module")
def full_vocab_draft(draft) -> Eagle3Draft:
    """`draft`'s shapes with draft_vocab_size == vocab_size (D == V): random weights, identity vocab map."""
    config = Eagle3Config(**{**vars(draft.config), "draft_vocab_size": draft.config.vocab_size})
    return random_draft(config, draft.embed_tokens.weight, seed=2)  # every id maps to itself


def test_full_vocab_export_has_no_vocab_map_and_round_trips(full_vocab_draft, target, tmp_path):
    V = target["vocab_size"]
    out = export_draft(full_vocab_draft, tmp_path / "draft", target_config=target, dtype=torch.float32)
    tensors = load_file(str(out / "model.safetensors"))
    # vLLM 0.32 has no draft_id_to_target_id at D == V and fails on a d2t; both engines skip t2d
    assert set(tensors) == (REFERENCE_NAMES - {"d2t", "t2d"}) | {"embed_tokens.weight"}
    assert tuple(tensors["lm_head.weight"].shape) == (V, full_vocab_draft.config.hidden_size)
    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["draft_vocab_size"], cfg["vocab_size"]) == (V, V) == (2048, 2048)
    assert validate_export(out) == [] and validate_export_vllm(out) == []

    loaded = load_exported_draft(out)
    assert torch.equal(loaded.d2t, torch.zeros(V, dtype=torch.int64))
    assert torch.equal(loaded.t2d, torch.ones(V, dtype=torch.bool))
    for name, t in full_vocab_draft.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t), name
    for a, b in zip(_two_steps(full_vocab_draft), _two_steps(loaded)):
        assert a.shape[-1] == V and torch.equal(a, b)
    logits = _two_steps(loaded)[1]
    assert torch.equal(loaded.to_target_vocab(logits), logits)  # identity: draft index i is target id i
    ids = torch.tensor([0, 7, V - 1])
    assert loaded.draft_to_target(ids).tolist() == [0, 7, V - 1]


def test_vllm_refuses_d2t_at_full_vocab(full_vocab_draft, target, tmp_path):
    V = target["vocab_size"]
    good = export_draft(full_vocab_draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    old = _rewrite(
        good,
        tmp_path / "old",
        lambda t: {**t, "d2t": torch.zeros(V, dtype=torch.int64), "t2d": torch.ones(V, dtype=torch.bool)},
    )
    assert validate_export(old) == []  # SGLang 0.5.23 loads it: hot_token_id = arange(V)
    vllm = validate_export_vllm(old)
    assert len(vllm) == 1, vllm
    assert vllm[0].startswith(f"d2t present with draft_vocab_size == vocab_size ({V}): vLLM 0.32's"), vllm
    assert "\"There is no module or parameter named 'draft_id_to_target_id' in Eagle3LlamaForCausalLM\"" in vllm[0], (
        vllm
    )
    only_t2d = _rewrite(good, tmp_path / "t2d", lambda t: {**t, "t2d": torch.ones(V, dtype=torch.bool)})
    assert validate_export(only_t2d) == [] and validate_export_vllm(only_t2d) == []  # t2d: skipped by both
    # export_draft never writes an identity d2t at D == V, and refuses a non-identity one
    other = Eagle3Draft(full_vocab_draft.config)
    other.d2t[0] = 1
    with pytest.raises(ValueError, match="d2t is not the identity"):
        export_draft(other, tmp_path / "bad", target_config=target)
    assert not (tmp_path / "bad").exists()


def test_missing_vocab_map_below_full_vocab_fails_both_loaders(draft, target, tmp_path):
    good = export_draft(draft, tmp_path / "good", target_config=target, dtype=torch.float32)
    bad = _rewrite(good, tmp_path / "bad", lambda t: {k: v for k, v in t.items() if k != "d2t"})
    assert validate_export(bad) == ["missing tensor d2t"]
    assert validate_export_vllm(bad) == [
        f"missing tensor d2t: draft_vocab_size {D} < vocab_size {target['vocab_size']}, so vLLM's "
        "draft_id_to_target_id would keep its zeros and compute_logits would serve draft index i as target "
        "id i (vLLM 0.32 runs no check for unloaded draft weights)"
    ]
    with pytest.raises(ValueError, match="missing tensor d2t"):
        load_exported_draft(bad)
