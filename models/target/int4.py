"""Kimi-K2.5's INT4 checkpoint format: compressed-tensors `pack-quantized` routed experts, written and read.

Kimi-K2.5 is published INT4: its routed experts' weights are symmetric int4 with one scale per group of 32 inputs,
packed eight to an int32 (compressed-tensors' `pack-quantized`), while attention, the shared experts, the dense MLP of
the first layer, the router and lm_head stay BF16. Each quantized `<module>.weight` [out, in] is stored as three
tensors: `<module>.weight_packed` int32 [out, in/8], `<module>.weight_scale` [out, in/32] (the weights' dtype) and
`<module>.weight_shape` [2] (out, in). The recipe is `QUANTIZATION_CONFIG`, config.json's
`text_config.quantization_config`.

`write_int4_checkpoint` turns a kimi_k25 checkpoint (models/target/tiny_kimi.py) into that format with
compressed-tensors' own quantizer and packer (the version vLLM 0.32 pins), so an engine reads what it would read of
the real target; `dequantize` is our own inverse (w = int4 * scale, per group of 32), which models/target/loader.py
applies as it loads.
"""

from __future__ import annotations

import copy
import json
import re
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

# moonshotai/Kimi-K2.5 config.json (huggingface.co, main), `text_config.quantization_config`, verbatim (key order
# sorted); the wrapper's top level has none. vLLM 0.32 reads it there: the top level first, then text_config
# (transformers_utils/model_arch_config_convertor.py get_quantization_config). Kimi-K2.6 publishes the same recipe.
QUANTIZATION_CONFIG: dict[str, Any] = {
    "config_groups": {
        "group_0": {
            "input_activations": None,
            "output_activations": None,
            "targets": ["Linear"],
            "weights": {
                "actorder": None,
                "block_structure": None,
                "dynamic": False,
                "group_size": 32,
                "num_bits": 4,
                "observer": "minmax",
                "observer_kwargs": {},
                "strategy": "group",
                "symmetric": True,
                "type": "int",
            },
        }
    },
    "format": "pack-quantized",
    "ignore": [
        "re:.*self_attn.*",
        "re:.*shared_experts.*",
        r"re:.*mlp\.(gate|up|gate_up|down)_proj.*",
        "re:.*lm_head.*",
        "re:vision_tower.*",
        "re:mm_projector.*",
    ],
    "kv_cache_scheme": None,
    "quant_method": "compressed-tensors",
    "quantization_status": "compressed",
}
NUM_BITS = 4
GROUP_SIZE = 32
PACK_FACTOR = 32 // NUM_BITS  # int4 values per int32
PACKED, SCALE, SHAPE = "weight_packed", "weight_scale", "weight_shape"
# A checkpoint's Linear modules, by their tensors' names: every 2-D `<module>.weight` but the embedding and the MoE
# router `mlp.gate` (a plain parameter in transformers' DeepSeek-V3 and built unquantized by vLLM's deepseek_v2.py:
# the config's "Linear" target never reaches it; the published checkpoint keeps it BF16).
_NOT_LINEAR = re.compile(r"(^|\.)(embed_tokens|mlp\.gate)\.weight$")


def quantized_config(config: dict) -> dict | None:
    """The `quantization_config` of a target's config.json dict: its own, else its text config's (Kimi-K2.5's place)."""
    found = config.get("quantization_config")
    if found is None and isinstance(config.get("text_config"), dict):
        found = config["text_config"].get("quantization_config")
    return found


def check_supported(quantization: dict, where: str) -> None:
    """Raise unless `quantization` (a config.json's quantization_config, read from `where`) is a format `dequantize`
    reads: compressed-tensors pack-quantized, weight-only symmetric int4 in groups, no activation order."""
    problems = []
    if quantization.get("quant_method") != "compressed-tensors":
        problems.append(f"quant_method {quantization.get('quant_method')!r}")
    if quantization.get("format") != "pack-quantized":
        problems.append(f"format {quantization.get('format')!r}")
    for name, group in (quantization.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if group.get("input_activations") is not None:
            problems.append(f"{name}: quantized activations")
        if group.get("format") not in (None, "pack-quantized"):
            problems.append(f"{name}: format {group.get('format')!r}")
        expected = {"num_bits": NUM_BITS, "type": "int", "symmetric": True, "strategy": "group", "actorder": None}
        problems += [f"{name}: {k} {weights.get(k)!r}" for k, v in expected.items() if weights.get(k) != v]
        if not isinstance(weights.get("group_size"), int) or weights["group_size"] <= 0:
            problems.append(f"{name}: group_size {weights.get('group_size')!r}")
    if problems:
        raise NotImplementedError(
            f"{where}: quantization_config is not one this loader reads ({'; '.join(problems)}); it reads "
            "compressed-tensors pack-quantized symmetric int4 group weights (Kimi-K2.5's). Serve it with an engine "
            "that reads it, or give a BF16 (unquantized) copy of the target for capture and training."
        )


def is_quantized(name: str, quantization: dict = QUANTIZATION_CONFIG) -> bool:
    """Whether the recipe `quantization` packs the checkpoint tensor `name` (a 2-D Linear `<module>.weight`): not in
    its ignore list, matched the way compressed-tensors matches module names."""
    from compressed_tensors.utils.match import match_name

    if not name.endswith(".weight") or _NOT_LINEAR.search(name):
        return False
    module = name[: -len(".weight")]
    return not any(match_name(module, pattern) for pattern in quantization["ignore"])


def quantize(weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The recipe's three tensors for a Linear weight [out, in], computed by compressed-tensors: min-max symmetric int4
    scales per group of 32 inputs (in the weight's dtype), the quantized values packed into int32."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme.model_validate(QUANTIZATION_CONFIG["config_groups"]["group_0"])
    out_features, in_features = weight.shape
    if in_features % GROUP_SIZE:
        raise ValueError(f"a weight of {in_features} inputs does not split into groups of {GROUP_SIZE}")
    groups = weight.reshape(out_features, in_features // GROUP_SIZE, GROUP_SIZE)
    scale, zero_point = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
    state = {"weight": weight, "weight_scale": scale, "weight_zero_point": zero_point}
    packed = PackedQuantizationCompressor.compress(state, scheme)  # weight_packed, weight_scale, weight_shape
    return {PACKED: packed[PACKED], SCALE: packed[SCALE], SHAPE: packed[SHAPE]}


def dequantize(packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor | tuple[int, int]) -> torch.Tensor:
    """The weight [out, in] of its packed int4 form, in the scale's dtype: w = q * scale, q in [-8, 7] stored
    unsigned (q + 8) eight to an int32, the lowest 4 bits first; one scale per group of in / scale.shape[1] inputs."""
    out_features, in_features = (int(v) for v in shape)
    shifts = torch.arange(PACK_FACTOR, dtype=torch.int32) * NUM_BITS
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [out, in/8, 8]: input 8j+i is word j's nibble i
    q = nibbles.reshape(out_features, -1)[:, :in_features] - 8  # [out, in] in [-8, 7]
    group = in_features // scale.shape[1]
    w = q.reshape(out_features, -1, group).to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)
    return w.reshape(out_features, in_features).to(scale.dtype)


def write_int4_checkpoint(base_dir: Path, out_dir: Path, dtype: torch.dtype) -> None:
    """Write the kimi_k25 checkpoint in `base_dir` into `out_dir` in Kimi-K2.5's published format: the routed experts
    quantized (QUANTIZATION_CONFIG), every other tensor cast to `dtype`, the recipe under config.json's text_config;
    tokenizer and the other files copied as they are."""
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(base_dir / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            weight = f.get_tensor(name).to(dtype)
            if weight.ndim == 2 and is_quantized(name):
                module = name[: -len("weight")]
                tensors.update({module + k: v.contiguous() for k, v in quantize(weight).items()})
            else:
                tensors[name] = weight.contiguous()
    if not any(name.endswith(PACKED) for name in tensors):
        raise ValueError(f"{base_dir}: no tensor the recipe quantizes (routed experts); is it a Kimi-shaped target?")
    for path in sorted(base_dir.iterdir()):
        if path.is_file() and path.name not in ("model.safetensors", "config.json"):
            shutil.copyfile(path, out_dir / path.name)
    save_file(dict(sorted(tensors.items())), str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((base_dir / "config.json").read_text())
    dtype_name = str(dtype).removeprefix("torch.")
    config["torch_dtype"] = config["text_config"]["torch_dtype"] = dtype_name
    config["text_config"]["quantization_config"] = copy.deepcopy(QUANTIZATION_CONFIG)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
