"""Single tensors of a target checkpoint (its input embedding, lm_head, final norm), read without loading the model.

The draft needs two frozen pieces of a target that may be a 1T-parameter MoE: the input embedding
(the draft embeds tokens with it) and the lm_head (target logits are recomputed from the stored
final hidden state; nobody stores logits). Both are read from the checkpoint's safetensors files
through `model.safetensors.index.json`, so only those tensors' bytes are touched.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def checkpoint_dir(target_path: str | Path) -> Path:
    """The local directory of a target: the path itself, or the cached snapshot of a hub id."""
    path = Path(target_path)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(target_path), allow_patterns=["*.json"], local_files_only=True))
    except Exception as e:  # noqa: BLE001 - any failure means: not available locally
        raise FileNotFoundError(
            f"target {target_path}: not a local directory and not in the Hugging Face cache "
            f"({e}); download it first (huggingface-cli download {target_path})"
        ) from e


def weight_map(directory: Path) -> dict[str, str]:
    """Tensor name -> file name, from the index (sharded checkpoints) or the single file."""
    index = directory / INDEX
    if index.is_file():
        return dict(json.loads(index.read_text())["weight_map"])
    single = directory / SINGLE
    if single.is_file():
        with safe_open(str(single), framework="pt") as f:
            return {name: SINGLE for name in f.keys()}
    raise FileNotFoundError(f"{directory}: neither {INDEX} nor {SINGLE}; the target must be a safetensors checkpoint")


def find_tensor_name(names: list[str] | dict[str, str], suffix: str) -> str | None:
    """The language model's tensor ending in `suffix` (e.g. "embed_tokens.weight"); None when absent.

    Multimodal checkpoints (Kimi-K2.5) prefix the text model (`language_model.`); vision towers may
    have their own embeddings, so a name under a vision/audio module never matches.
    """
    found = [
        n
        for n in names
        if (n == suffix or n.endswith("." + suffix))
        and not any(part in n for part in ("vision", "visual", "audio", "mm_projector"))
    ]
    return min(found, key=len) if found else None


def load_target_tensors(
    target_path: str | Path, *, tie_word_embeddings: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """(embedding [V, H], lm_head [V, H]) of the target, in the checkpoint's dtype."""
    directory = checkpoint_dir(target_path)
    names = weight_map(directory)
    embed_name = find_tensor_name(names, "embed_tokens.weight")
    head_name = find_tensor_name(names, "lm_head.weight")
    if embed_name is None:
        raise ValueError(f"{directory}: no *embed_tokens.weight tensor in the checkpoint")
    if head_name is None:
        if not tie_word_embeddings:
            raise ValueError(f"{directory}: no *lm_head.weight tensor and tie_word_embeddings is not set")
        head_name = embed_name
    embed = _read(directory / names[embed_name], embed_name)
    head = embed if head_name == embed_name else _read(directory / names[head_name], head_name)
    if embed.shape != head.shape:
        raise ValueError(f"{directory}: embedding {tuple(embed.shape)} and lm_head {tuple(head.shape)} differ in shape")
    return embed, head


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor(name)


def load_final_norm(target_path: str | Path) -> torch.Tensor:
    """The weight [H] of the target's final norm (`model.norm.weight`, `language_model.model.norm.weight`), as stored.

    Engines that hand out the last layer's output before the final norm (vLLM's hidden-state
    extraction) leave it to the reader; DeepSeek-V3 checkpoints also hold an MTP layer's
    `model.layers.61.shared_head.norm.weight`, which this never picks.
    """
    directory = checkpoint_dir(target_path)
    names = weight_map(directory)
    found = [
        n
        for n in names
        if (n == "model.norm.weight" or n.endswith(".model.norm.weight"))
        and not any(part in n for part in ("vision", "visual", "audio", "mm_projector"))
    ]
    if not found:
        raise ValueError(f"{directory}: no *model.norm.weight tensor (the final norm) in the checkpoint")
    name = min(found, key=len)
    return _read(directory / names[name], name)
