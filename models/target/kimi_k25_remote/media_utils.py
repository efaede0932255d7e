"""Image helpers of the tiny kimi_k25 checkpoint's vision processor (eagle3-pipeline's own code, written to Kimi-K2.5's
published file layout: kimi_k25_vision_processing.py imports its resize rule from here).

The resize rule is the one both engines apply to a Kimi-K2.5 image (SGLang 0.5.23 srt/multimodal/processors/
kimi_k25.py `navit_resize_config`, vLLM 0.32 transformers_utils/processors/kimi_k25_vision_fused.py
`navit_resize_image`): scale down until the patches fit `in_patch_limit` and `patch_limit_on_one_side`, then pad
each side to a multiple of patch_size x merge_kernel_size; one token per merged patch.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from PIL import Image


def to_pil(image: Any) -> Image.Image:
    """An RGB PIL image from a PIL image or an HxWx3 uint8 array."""
    if isinstance(image, Image.Image):
        return image.convert("RGB")
    if isinstance(image, np.ndarray) and image.ndim == 3 and image.shape[2] == 3:
        return Image.fromarray(image.astype(np.uint8), "RGB")
    raise TypeError(f"an image must be a PIL image or an HxWx3 array, got {type(image).__name__}")


def navit_resize(
    width: int,
    height: int,
    patch_size: int,
    merge_kernel_size: int,
    in_patch_limit: int,
    patch_limit_on_one_side: int,
    fixed_output_tokens: int | None,
) -> dict[str, int]:
    """The size an image of `width` x `height` is resized to, its padding, and the tokens it takes."""
    if width < 1 or height < 1:
        raise ValueError(f"an image must have at least one pixel, got {width}x{height}")
    fit_all = math.sqrt(in_patch_limit / (max(1.0, width // patch_size) * max(1.0, height // patch_size)))
    scale = min(
        1.0, fit_all, patch_limit_on_one_side * patch_size / width, patch_limit_on_one_side * patch_size / height
    )
    new_w = min(max(1, int(width * scale)), patch_limit_on_one_side * patch_size)
    new_h = min(max(1, int(height * scale)), patch_limit_on_one_side * patch_size)
    factor = merge_kernel_size * patch_size
    pad_w, pad_h = (factor - new_w % factor) % factor, (factor - new_h % factor) % factor
    tokens = (
        fixed_output_tokens
        if fixed_output_tokens is not None
        else (new_h + pad_h) // factor * ((new_w + pad_w) // factor)
    )
    return {"num_tokens": tokens, "new_width": new_w, "new_height": new_h, "pad_width": pad_w, "pad_height": pad_h}
