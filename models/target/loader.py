"""The target's language model as it is published: a causal LM, or the text model inside a multimodal wrapper.

Kimi-K2.5 is published as a `kimi_k25` checkpoint: a multimodal config whose `text_config` is DeepSeek-V3's and
weights named `language_model.model.*`, `language_model.lm_head.weight` beside a vision tower's.
transformers' AutoModelForCausalLM refuses such a config ("Unrecognized configuration class Kimi_K25Config"),
and the wrapper class (AutoModelForImageTextToText) would build the vision tower too. Capture, the online
train source and the in-process eval need the language model alone, so `load_language_model` builds the
causal LM of the text config and loads the wrapper's `language_model.*` tensors into it by name
(`from_pretrained(config=text_config, key_mapping=...)`): no converted copy is written, the vision tower is
never built, and under ZeRO-3 the weights are still created partitioned (HfDeepSpeedConfig acts inside
from_pretrained).

Kimi-K2.5 as published keeps its routed experts INT4 (compressed-tensors pack-quantized, models/target/int4.py). Such
a checkpoint is read without writing a dense copy: the model is built from the text config (partitioned under ZeRO-3:
transformers' from_config runs deepspeed.zero.Init while an HfDeepSpeedConfig is alive), then one decoder layer at a
time its weights are read, the packed ones dequantized, and assigned -- under ZeRO-3 inside
GatheredParameters(modifier_rank=0), rank 0 reading the files, so no rank holds more than one layer dense.
transformers' own compressed-tensors loading (5.24, `dequantize=True`) dequantizes correctly but, under ZeRO-3, builds
a quantized model whole on every rank (modeling_utils.py get_init_context: zero.Init only `if not is_quantized`).
"""

from __future__ import annotations

import contextlib
import copy
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from safetensors import safe_open

from models.target import int4
from models.target.weights import checkpoint_dir, find_tensor_name, weight_map

if TYPE_CHECKING:
    from transformers import PreTrainedModel

EMBED = "model.embed_tokens.weight"  # the causal LM's input embedding, under any wrapper's prefix


def text_config(config: Any) -> Any:
    """The language model's config: a multimodal config's text config, else the config itself."""
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def load_config(target_path: str, *, trust_remote_code: bool = False) -> Any:
    """The target's transformers config (the wrapper's, for a multimodal checkpoint)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(target_path, trust_remote_code=trust_remote_code)


def wrapper_prefix(target_path: str) -> str:
    """The prefix of the language model's weights in the checkpoint ("" for a plain causal LM, "language_model."
    for Kimi-K2.5's), read from the tensor names (the index, or the single file's header)."""
    names = weight_map(checkpoint_dir(target_path))
    embed = find_tensor_name(names, "embed_tokens.weight")
    if embed is None or not embed.endswith(EMBED):
        raise ValueError(
            f"{target_path}: no language model embedding (*{EMBED}) among the checkpoint's tensors; "
            "is it a causal LM checkpoint?"
        )
    return embed[: -len(EMBED)]


def load_language_model(
    target_path: str, *, dtype: torch.dtype, trust_remote_code: bool = False, config: Any = None, **kwargs: Any
) -> PreTrainedModel:
    """The target's causal language model (transformers), from a plain or a multimodal (kimi_k25) checkpoint.

    `config`: the target's config when the caller has read it already. `kwargs` go to from_pretrained
    (`device_map`, ...).
    """
    from transformers import AutoModelForCausalLM

    config = config if config is not None else load_config(target_path, trust_remote_code=trust_remote_code)
    text = text_config(config)
    quantization = getattr(config, "quantization_config", None) or getattr(text, "quantization_config", None)
    if quantization is not None:
        return load_dequantized(
            target_path, text, quantization, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    if text is config:
        return AutoModelForCausalLM.from_pretrained(
            target_path, dtype=dtype, trust_remote_code=trust_remote_code, **kwargs
        )
    prefix = wrapper_prefix(target_path)
    loaded = AutoModelForCausalLM.from_pretrained(
        target_path,
        config=text,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        key_mapping={f"^{re.escape(prefix)}": ""},
        output_loading_info=True,
        **kwargs,
    )
    model, info = cast(tuple[Any, dict], loaded)  # output_loading_info=True: (model, {"missing_keys", ...})
    if info.get("missing_keys"):  # transformers only warns: the model would run on random weights
        missing = sorted(info["missing_keys"])
        raise ValueError(
            f"{target_path}: {len(missing)} weights of the language model are not in the checkpoint under "
            f"{prefix!r} (first: {missing[:3]}); is it a {type(config).__name__} checkpoint as published?"
        )
    return model


# transformers (5.x) fuses a MoE layer's per-expert Linear weights into two parameters: `gate_up_proj` [E, 2I, H], each
# expert's gate_proj [I, H] then up_proj [I, H]; `down_proj` [E, H, I] (conversion_mapping.py, qwen2_moe's rules).
_FUSED_EXPERTS = re.compile(r"(?P<experts>.*\.mlp\.experts)\.(?P<fused>gate_up_proj|down_proj)")
_FUSED_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")


def load_dequantized(
    target_path: str,
    text: Any,
    quantization: dict,
    *,
    dtype: torch.dtype,
    trust_remote_code: bool = False,
    device_map: Any = None,
) -> PreTrainedModel:
    """The causal LM of a quantized checkpoint (`quantization`: its config's quantization_config), dense in `dtype`,
    dequantized layer by layer as it loads (module docstring). `device_map`: then dispatched with accelerate."""
    from transformers import AutoModelForCausalLM
    from transformers.integrations import is_deepspeed_zero3_enabled

    directory = checkpoint_dir(target_path)
    int4.check_supported(quantization, str(directory / "config.json"))
    dense_config = copy.deepcopy(text)
    del dense_config.quantization_config  # a plain model: no transformers quantizer, zero.Init under ZeRO-3
    zero3 = is_deepspeed_zero3_enabled()
    model = AutoModelForCausalLM.from_config(dense_config, dtype=dtype, trust_remote_code=trust_remote_code)
    prefix = wrapper_prefix(target_path)
    reads = not zero3 or torch.distributed.get_rank() == 0  # under ZeRO-3 rank 0 reads, GatheredParameters broadcasts
    with _Checkpoint(directory) as checkpoint:
        params = dict(model.named_parameters())
        for names in _load_groups(params):
            with _gathered([params[n] for n in names], zero3):
                if reads:
                    for name in names:
                        _assign(params[name], _dense(checkpoint, prefix, name, params[name]), name, directory)
        for name, buffer in _persistent_buffers(model):  # never partitioned: every rank loads them
            _assign(buffer, checkpoint.dense(prefix + name, name), name, directory)
    model.eval()
    if device_map is not None:
        from accelerate import dispatch_model, infer_auto_device_map

        if device_map == "auto":
            device_map = infer_auto_device_map(model, no_split_module_classes=model._no_split_modules)
        model = dispatch_model(model, device_map=device_map)
    return model


class _Checkpoint:
    """A safetensors checkpoint's tensors by name (its files opened once), the packed int4 ones read dense."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.files = weight_map(directory)
        self._open: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> _Checkpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def get(self, name: str) -> torch.Tensor:
        file = self.files[name]
        if file not in self._open:
            self._open[file] = self._stack.enter_context(safe_open(str(self.directory / file), framework="pt"))
        return self._open[file].get_tensor(name)

    def dense(self, name: str, model_name: str) -> torch.Tensor:
        """The tensor `name` as stored, or the dense weight of its `<module>.weight_packed` form."""
        if name in self.files:
            return self.get(name)
        module = name.removesuffix("weight")
        if name.endswith(".weight") and module + int4.PACKED in self.files:
            return int4.dequantize(
                self.get(module + int4.PACKED), self.get(module + int4.SCALE), self.get(module + int4.SHAPE)
            )
        raise ValueError(
            f"{self.directory}: the language model's {model_name} is not in the checkpoint (looked for {name} and "
            f"{module + int4.PACKED}); is it a checkpoint of this config as published?"
        )


def _dense(checkpoint: _Checkpoint, prefix: str, name: str, param: torch.Tensor) -> torch.Tensor:
    """The dense value of the model's parameter `name` (shape of `param`, whole: ds_shape under ZeRO-3)."""
    fused = _FUSED_EXPERTS.fullmatch(name)
    if fused is None:
        return checkpoint.dense(prefix + name, name)
    experts, parts = fused["experts"], _FUSED_PARTS[fused["fused"]]
    count = _full_shape(param)[0]
    return torch.stack(
        [torch.cat([checkpoint.dense(f"{prefix}{experts}.{e}.{p}.weight", name) for p in parts]) for e in range(count)]
    )


def _load_groups(params: dict[str, torch.Tensor]) -> Iterator[list[str]]:
    """The parameters' names in the groups gathered together: each decoder layer's, then every other one alone
    (the embedding and lm_head are each as large as several layers)."""
    layers: dict[int, list[str]] = {}
    for name in params:
        match = _LAYER.match(name)
        if match is None:
            yield [name]
        else:
            layers.setdefault(int(match[1]), []).append(name)
    yield from (layers[i] for i in sorted(layers))


def _gathered(params: list[torch.Tensor], zero3: bool) -> contextlib.AbstractContextManager:
    if not zero3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(params, modifier_rank=0)


def _persistent_buffers(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


def _full_shape(param: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(param, "ds_shape", param.shape))


def _assign(target: torch.Tensor, value: torch.Tensor, name: str, directory: Path) -> None:
    if tuple(value.shape) != _full_shape(target):
        raise ValueError(
            f"{directory}: {name} is {tuple(value.shape)} in the checkpoint, {_full_shape(target)} in the model "
            "built from its config"
        )
    with torch.no_grad():
        target.data.copy_(value.to(target.dtype))
