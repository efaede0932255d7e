"""Loading the reference target as published: a kimi_k25 checkpoint (models/target/loader.py,
models/target/tiny_kimi.py).

The independent source is transformers' own wrapper class, Kimi_K25ForConditionalGeneration
(AutoModelForImageTextToText, with its own checkpoint conversion rules): our loader's language model must give
the same hidden states and logits on the same ids, without building the vision tower.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.target.loader import load_language_model, wrapper_prefix
from models.target.tiny import build_kimi_target
from models.target.tiny_kimi import MEDIA_PAD, WRAPPER_PREFIX


@pytest.fixture(scope="module")
def kimi_random(tmp_path_factory) -> Path:
    """A Kimi-shaped build with random weights (seconds): the loader's tests need the shape, not the training."""
    return build_kimi_target(tmp_path_factory.mktemp("kimi") / "target", train_steps=0)


def test_the_checkpoint_is_a_kimi_k25_wrapper_as_published(kimi_random):
    cfg = json.loads((kimi_random / "config.json").read_text())
    assert cfg["model_type"] == "kimi_k25" and cfg["architectures"] == ["KimiK25ForConditionalGeneration"]
    text = cfg["text_config"]
    assert text["model_type"] == "deepseek_v3"
    assert (text["kv_lora_rank"], text["qk_rope_head_dim"], text["n_routed_experts"], text["num_experts_per_tok"]) == (
        512,
        64,
        8,
        2,
    )
    assert text["rope_scaling"]["type"] == "yarn" and text["rope_scaling"]["factor"] == 64.0
    assert (text["topk_method"], text["scoring_func"]) == ("noaux_tc", "sigmoid")
    with safe_open(str(kimi_random / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert names and all(n.startswith(WRAPPER_PREFIX) for n in names)
    assert "language_model.model.layers.1.mlp.experts.7.down_proj.weight" in names  # MoE from layer 1 on
    assert "language_model.model.layers.0.mlp.gate_proj.weight" in names  # the first layer dense
    assert "language_model.lm_head.weight" in names
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(kimi_random, trust_remote_code=True)  # Kimi's own code, as published
    assert type(tokenizer).__name__ == "TikTokenTokenizer" and not (kimi_random / "tokenizer.json").exists()
    media = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    assert cfg["media_placeholder_token_id"] == media == text["vocab_size"] - 1
    preprocessor = json.loads((kimi_random / "preprocessor_config.json").read_text())
    assert "merge_kernel_size" in preprocessor["media_proc_cfg"]
    assert preprocessor["auto_map"]["AutoProcessor"] == "kimi_k25_processor.KimiK25Processor"
    assert (kimi_random / "kimi_k25_processor.py").is_file() and text["moe_layer_freq"] == 1


def test_transformers_causal_lm_class_refuses_it(kimi_random):
    """The first-contact break the loader exists for."""
    from transformers import AutoModelForCausalLM

    with pytest.raises(ValueError, match="Kimi_K25Config"):
        AutoModelForCausalLM.from_pretrained(kimi_random)


def test_the_language_model_equals_transformers_wrapper_class(kimi_random):
    from transformers import AutoModelForImageTextToText

    ours = load_language_model(str(kimi_random), dtype=torch.float32).eval()
    assert type(ours).__name__ == "DeepseekV3ForCausalLM"
    assert not any("vision" in n for n, _ in ours.named_parameters())
    wrapper = AutoModelForImageTextToText.from_pretrained(kimi_random, dtype=torch.float32).eval()
    assert type(wrapper).__name__ == "Kimi_K25ForConditionalGeneration"
    ids = torch.tensor([[9, 300, 17, 1200, 5, 44, 801, 2, 66, 1500, 12, 3]])
    with torch.no_grad():
        a = ours(ids, output_hidden_states=True)
        b = wrapper(input_ids=ids, output_hidden_states=True)
    assert len(a.hidden_states) == len(b.hidden_states) == 9
    for x, y in zip(a.hidden_states, b.hidden_states, strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=1e-6)
    torch.testing.assert_close(a.logits, b.logits, rtol=0, atol=1e-5)
    assert a.logits.abs().max() > 0.1  # loaded weights, not zeros


def test_a_plain_checkpoint_has_no_prefix_and_a_wrapped_one_has_kimi_s(kimi_random, tiny_target_dir):
    assert wrapper_prefix(str(kimi_random)) == "language_model."
    assert wrapper_prefix(str(tiny_target_dir)) == ""


def test_a_wrapper_missing_language_model_weights_is_an_error_not_random_weights(kimi_random, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    for p in kimi_random.iterdir():
        if p.name != "model.safetensors":
            (broken / p.name).write_bytes(p.read_bytes())
    with safe_open(str(kimi_random / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if ".layers.3.self_attn." not in n}
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"not in the checkpoint under 'language_model\.'.*layers\.3\.self_attn"):
        load_language_model(str(broken), dtype=torch.float32)
