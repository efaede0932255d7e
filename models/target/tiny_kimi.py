"""The Kimi-K2.5-shaped tiny target: a tiny DeepSeek-V3 (MLA, MoE with a shared expert, YaRN) in the kimi_k25 wrapper.

Kimi-K2.5 is published as a multimodal checkpoint: config.json says `model_type: kimi_k25` with the language
model's DeepSeek-V3 config nested under `text_config`, its weights are named `language_model.model.*` and
`language_model.lm_head.weight` beside a vision tower's, and a preprocessor_config.json describes the image
processing. `save_kimi_k25` writes the tiny model exactly so (no vision weights: neither engine nor our loaders
read them for text), which is what a loader of the reference target must open.

What the serving engine needs of that wrapper (vLLM 0.32, read in vllm/model_executor/models/kimi_k25.py,
transformers_utils/processors/kimi_k25_vision_fused.py, v1/spec_decode/llm_base_proposer.py):
- `architectures: ["KimiK25ForConditionalGeneration"]` picks vLLM's wrapper, which runs the text config as
  `DeepseekV2ForCausalLM` (deepseek_v2.py: MLA, MoE, YaRN);
- preprocessor_config.json with a `media_proc_cfg` (its processor reads merge_kernel_size, image_mean, ... at
  start, KeyError without them), even with every modality limited to 0;
And of SGLang 0.5.23 (srt/models/kimi_k25.py, deepseek_v2.py, multimodal/processors/kimi_k25.py), which builds the
published checkpoint unmodified with `--trust-remote-code`:
- the processor as remote code (kimi_k25_processor.py and its image processor: models/target/kimi_k25_remote/),
  found through preprocessor_config.json's `auto_map`: SGLang builds its Kimi processor from its `media_processor`
  even for a text-only server;
- the published config's vision keys (`vt_*`) and the text config's `moe_layer_freq`;
- `media_placeholder_token_id` at the top level: an EAGLE draft on a Kimi target reads it
  (`llm_base_proposer.py`, AttributeError without it);
- a `<|media_pad|>` token in the tokenizer: vLLM resolves the media token from it (kimi_k25.py
  KimiK25ProcessingInfo) and prefers it to config.json's `image_token_id`.

Shape: Kimi-K2.5's attention and routing fields where vLLM's CPU kernels need them (the CPU MLA kernel takes only
kv_lora_rank 512 with qk_rope_head_dim 64, vllm/v1/attention/backends/mla/cpu_mla.py), everything else shrunk.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from safetensors import safe_open
from safetensors.torch import save_file
from transformers import DeepseekV3Config, GenerationConfig, PreTrainedModel, PreTrainedTokenizerFast

# What a kimi build writes beside its weights, versioned: a change rebuilds every kimi target (2: the processor's
# remote code and the published config keys SGLang reads; 3: the tokenizer as tiktoken remote code,
# models/target/kimi_tokenizer.py).
KIMI_CHECKPOINT_VERSION = 3
MEDIA_PAD = "<|media_pad|>"  # Kimi's media placeholder token (163605 in Kimi-K2.5)
WRAPPER_PREFIX = "language_model."  # the text model's weights in a kimi_k25 checkpoint
WRAPPER_ARCHITECTURE = "KimiK25ForConditionalGeneration"  # vLLM's registry name for the wrapper

# Kimi-K2.5's text config (DeepSeek-V3 style), the fields a tiny build keeps as they are: MLA's latent and rope
# widths (the CPU MLA kernel's only sizes), the router (sigmoid scores, aux-loss-free top-k with a correction
# bias), the first layer dense, and the rope: base 50000 with YaRN x64 over a 4k original context.
KIMI_FIXED: dict[str, Any] = {
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "first_k_dense_replace": 1,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "num_nextn_predict_layers": 0,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "max_position_embeddings": 262144,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
}
# A tiny vision tower's config: the wrapper's config class requires one; no weights are written for it. Each size
# twice: under transformers' names (its kimi_k25/configuration_kimi_k25.py, which vLLM 0.32 loads) and under the
# published config's (`vt_*`, `init_pos_emb_*`, `text_hidden_size`, `mm_hidden_size`), which SGLang 0.5.23 reads
# (srt/configs/kimi_k25.py, srt/models/kimi_k25.py K2VLMultiModalProjector).
TINY_VISION = {
    "patch_size": 14,
    "pos_emb_height": 8,
    "pos_emb_width": 8,
    "pos_emb_time": 4,
    "num_attention_heads": 2,
    "num_hidden_layers": 1,
    "hidden_size": 64,
    "intermediate_size": 128,
    "merge_kernel_size": [2, 2],
    "vt_hidden_size": 64,
    "vt_intermediate_size": 128,
    "vt_num_attention_heads": 2,
    "vt_num_hidden_layers": 1,
    "init_pos_emb_height": 8,
    "init_pos_emb_width": 8,
    "init_pos_emb_time": 4,
    "mm_hidden_size": 64,
}
# The published text config's keys that transformers' DeepseekV3Config does not write and SGLang reads:
# `moe_layer_freq` (srt/models/deepseek_v2.py `_is_layer_sparse`: every layer past first_k_dense_replace is MoE).
PUBLISHED_TEXT_KEYS: dict[str, Any] = {"moe_layer_freq": 1}
# Kimi-K2.5's preprocessor_config.json, as vLLM's fused processor reads it.
MEDIA_PROC_CFG = {
    "in_patch_limit": 16384,
    "patch_size": 14,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
    "merge_kernel_size": 2,
    "fixed_output_tokens": None,
    "patch_limit_on_one_side": 512,
    "in_patch_limit_each_frame": 4096,
    "max_num_frames_each_video": None,
    "temporal_merge_kernel_size": 4,
    "timestamp_mode": "hh:mm:ss.fff",
}
# The remote code the checkpoint ships (models/target/kimi_k25_remote/, ours, to the published interface), and the
# auto_map in preprocessor_config.json through which transformers' AutoProcessor finds it under trust_remote_code
# (transformers, its auto/processing_auto.py).
REMOTE_CODE_DIR = Path(__file__).parent / "kimi_k25_remote"
PROCESSOR_FILES = ("kimi_k25_processor.py", "kimi_k25_vision_processing.py", "media_utils.py")
PROCESSOR_AUTO_MAP = {
    "AutoProcessor": "kimi_k25_processor.KimiK25Processor",
    "AutoImageProcessor": "kimi_k25_vision_processing.KimiK25VisionProcessor",
}


def remote_code_digest() -> str:
    """sha256 over the remote code a kimi build copies (every .py of kimi_k25_remote/ but the package's __init__):
    part of the build info, so an edit to it rebuilds the targets that ship a copy."""
    digest = hashlib.sha256()
    for path in sorted(REMOTE_CODE_DIR.glob("*.py")):
        if path.name != "__init__.py":
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def kimi_text_config(params: dict, sizes: dict[str, Any]) -> DeepseekV3Config:
    """The tiny DeepSeek-V3 text config of a build's `params` (tiny_target.py's build info) over the `sizes` every
    shape shares (vocabulary, hidden, layers, heads, special ids)."""
    return DeepseekV3Config(
        **sizes,
        moe_intermediate_size=params["moe_intermediate_size"],
        num_key_value_heads=params["num_heads"],
        q_lora_rank=params["q_lora_rank"],
        qk_nope_head_dim=params["qk_nope_head_dim"],
        v_head_dim=params["v_head_dim"],
        n_routed_experts=params["n_routed_experts"],
        num_experts_per_tok=params["num_experts_per_tok"],
        # a copy: the config class rewrites rope_scaling in place
        **copy.deepcopy({k: v for k, v in KIMI_FIXED.items() if k not in ("topk_method", "scoring_func")}),
    )


def save_kimi_k25(model: PreTrainedModel, tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    """Write `model` as a kimi_k25 checkpoint in `out_dir`: wrapper config.json, `language_model.*` weights,
    preprocessor_config.json with the processor's remote code, generation_config.json (the tokenizer is saved by the
    caller)."""
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)  # the text model's names as transformers writes them
        text = json.loads((Path(tmp) / "config.json").read_text())
        with safe_open(str(Path(tmp) / "model.safetensors"), framework="pt") as f:
            tensors = {WRAPPER_PREFIX + name: f.get_tensor(name) for name in f.keys()}
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    (out_dir / "config.json").write_text(json.dumps(wrapper_config(text, tokenizer), indent=2, sort_keys=True) + "\n")
    preprocessor = {"auto_map": PROCESSOR_AUTO_MAP, "media_proc_cfg": MEDIA_PROC_CFG}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(preprocessor, indent=2) + "\n")
    for name in PROCESSOR_FILES:
        shutil.copyfile(REMOTE_CODE_DIR / name, out_dir / name)
    eos = int(text["eos_token_id"])
    generation = GenerationConfig(bos_token_id=None, eos_token_id=eos, pad_token_id=text["pad_token_id"])
    generation.save_pretrained(out_dir)


def wrapper_config(text: dict, tokenizer: PreTrainedTokenizerFast) -> dict:
    """Kimi-K2.5's config.json layout around the text config `text` (a DeepseekV3Config's dict)."""
    media = tokenizer.convert_tokens_to_ids(MEDIA_PAD)
    text = {k: v for k, v in text.items() if k not in ("rope_parameters", "transformers_version", "dtype")}
    text.update(
        architectures=["DeepseekV3ForCausalLM"],
        model_type="deepseek_v3",
        torch_dtype="float32",
        **PUBLISHED_TEXT_KEYS,
        **copy.deepcopy({k: KIMI_FIXED[k] for k in ("topk_method", "scoring_func", "rope_theta", "rope_scaling")}),
    )
    return {
        "architectures": [WRAPPER_ARCHITECTURE],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": TINY_VISION,
        "media_placeholder_token_id": media,
        "image_token_id": media,
        "video_token_id": media,
        "bos_token_id": None,
        "eos_token_id": text["eos_token_id"],
        "pad_token_id": text["pad_token_id"],
        "tie_word_embeddings": False,
        "use_unified_vision_chunk": True,
        "torch_dtype": "float32",
    }
