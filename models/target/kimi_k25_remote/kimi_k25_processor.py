"""The tiny kimi_k25 checkpoint's processor (eagle3-pipeline's own code, written to Kimi-K2.5's published interface:
`KimiK25Processor(image_processor, tokenizer)`, whose `media_processor` is the image processor, called as
`processor(text=[...], medias=[{"type": "image", "image": ...}])`).

SGLang 0.5.23 builds its Kimi multimodal processor from this one whenever the checkpoint is multimodal (srt/managers/
tokenizer_manager.py `init_tokenizer_and_processor`, even with `--skip-tokenizer-init`): it reads
`media_processor.media_proc_cfg`, `image_processor` and `tokenizer` (srt/multimodal/processors/kimi_k25.py
`KimiGPUProcessorWrapper`). Transformers' own kimi_k25 processor (5.19+) has no `media_processor`, which is why the
checkpoint ships this one and the engines load it with `--trust-remote-code`. SGLang expands each `<|media_pad|>`
itself before calling `__call__`, so the text is tokenized as given.
"""

from __future__ import annotations

from typing import Any

from transformers import BatchFeature
from transformers.processing_utils import ProcessorMixin


class KimiK25Processor(ProcessorMixin):
    attributes = ["image_processor", "tokenizer"]

    def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None, **kwargs: Any):
        super().__init__(image_processor, tokenizer, chat_template=chat_template)
        self.media_processor = image_processor

    def __call__(
        self,
        messages: Any = None,
        medias: list[dict[str, Any]] | None = None,
        text: str | list[str] | None = None,
        return_tensors: Any = None,
        **kwargs: Any,
    ) -> BatchFeature:
        if text is None and messages is not None:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        data: dict[str, Any] = {}
        if text is not None:
            texts = text if isinstance(text, list) else [text]
            data.update(self.tokenizer(texts, add_special_tokens=False))
        if medias:
            data.update(self.media_processor.preprocess(medias))
        return BatchFeature(data=data, tensor_type=return_tensors)
