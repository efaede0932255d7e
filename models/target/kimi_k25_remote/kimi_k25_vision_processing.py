"""The tiny kimi_k25 checkpoint's image processor (eagle3-pipeline's own code, written to Kimi-K2.5's published
interface: `KimiK25VisionProcessor(media_proc_cfg)` built by `from_dict` from preprocessor_config.json, with
`media_tokens_calculator`, `get_resize_config` and `preprocess(medias) -> {pixel_values, grid_thws}`).

What reads it: SGLang 0.5.23 builds its Kimi processor from `processor.media_processor.media_proc_cfg` (srt/
multimodal/processors/kimi_k25.py `KimiK2_5VLImageProcessor.__init__`) and, for an image on a CPU, calls
`media_tokens_calculator` and the processor's `__call__(text=..., medias=...)`; vLLM 0.32 calls the same methods on
its own copy (transformers_utils/processors/kimi_k25_vision_fused.py). The pipeline itself sends text only, so images
are handled (resized, padded, cut into normalized patches) and video chunks are refused with a clear error.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image
from transformers import BaseImageProcessor, BatchFeature

from .media_utils import navit_resize, to_pil


class KimiK25VisionProcessor(BaseImageProcessor):
    model_type = "kimi_k25"
    model_input_names = ["pixel_values", "grid_thws"]

    def __init__(self, media_proc_cfg: dict[str, Any], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        cfg = dict(media_proc_cfg)
        for key in ("patch_size", "merge_kernel_size", "in_patch_limit", "patch_limit_on_one_side", "image_mean"):
            if key not in cfg:
                raise KeyError(f"preprocessor_config.json's media_proc_cfg has no {key!r}")
        if isinstance(cfg["merge_kernel_size"], (list, tuple)):
            cfg["merge_kernel_size"] = int(cfg["merge_kernel_size"][0])
        self.media_proc_cfg = cfg
        self.num_frames_per_chunk = cfg["temporal_merge_kernel_size"]

    def get_resize_config(self, media: dict[str, Any]) -> dict[str, int]:
        if media.get("type") != "image":
            raise ValueError(f"the tiny kimi_k25 processor takes images only, not {media.get('type')!r}")
        width, height = to_pil(media["image"]).size
        c = self.media_proc_cfg
        return navit_resize(
            width,
            height,
            c["patch_size"],
            c["merge_kernel_size"],
            c["in_patch_limit"],
            c["patch_limit_on_one_side"],
            c.get("fixed_output_tokens"),
        )

    def media_tokens_calculator(self, media: dict[str, Any]) -> int:
        return int(self.get_resize_config(media)["num_tokens"])

    def preprocess(self, medias: Any, return_tensors: Any = None, **kwargs: Any) -> BatchFeature:
        """Each image resized (bicubic, the engines' filter), padded with black, normalized and cut into
        patch_size x patch_size patches (row-major over the patch grid): pixel_values (patches, 3, p, p) and grid_thws
        (images, 3) of (1, rows, columns)."""
        medias = medias if isinstance(medias, list) else [medias]
        if not medias:
            return BatchFeature(data={}, tensor_type=return_tensors)
        p = int(self.media_proc_cfg["patch_size"])
        mean = np.asarray(self.media_proc_cfg["image_mean"], dtype=np.float32)
        std = np.asarray(self.media_proc_cfg["image_std"], dtype=np.float32)
        patches, grids = [], []
        for media in medias:
            size = self.get_resize_config(media)
            image = to_pil(media["image"]).resize((size["new_width"], size["new_height"]), Image.Resampling.BICUBIC)
            padding = ((0, size["pad_height"]), (0, size["pad_width"]), (0, 0))
            pixels = (np.pad(np.asarray(image, dtype=np.float32), padding) / 255.0 - mean) / std  # padded with black
            rows, cols = pixels.shape[0] // p, pixels.shape[1] // p
            cut = pixels.reshape(rows, p, cols, p, 3).transpose(0, 2, 4, 1, 3).reshape(rows * cols, 3, p, p)
            patches.append(cut)
            grids.append([1, rows, cols])
        data = {"pixel_values": np.concatenate(patches), "grid_thws": np.asarray(grids, dtype=np.int64)}
        return BatchFeature(data=data, tensor_type=return_tensors)

    def to_dict(self) -> dict[str, Any]:
        out = super().to_dict()
        out["media_proc_cfg"] = self.media_proc_cfg
        return out

    @classmethod
    def from_dict(cls, image_processor_dict: dict[str, Any], **kwargs: Any) -> KimiK25VisionProcessor:
        config = dict(image_processor_dict)
        media_proc_cfg = config.pop("media_proc_cfg", None)
        if media_proc_cfg is None:
            raise KeyError("preprocessor_config.json has no media_proc_cfg: Kimi-K2.5's processor reads it")
        config.pop("auto_map", None)
        config.pop("image_processor_type", None)
        return cls(media_proc_cfg=media_proc_cfg, **{**config, **kwargs})
