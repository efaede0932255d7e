"""The remote code the tiny kimi_k25 checkpoint ships, as Kimi-K2.5 publishes its own (models/target/tiny_kimi.py copies
these files beside the weights).

Kimi-K2.5's checkpoint carries its tokenizer and multimodal processor as code loaded with `trust_remote_code`:
`tokenization_kimi.py` (a tiktoken tokenizer), `kimi_k25_processor.py` (the processor SGLang's kimi_k25 builds),
`kimi_k25_vision_processing.py` (its image processor, reading preprocessor_config.json's `media_proc_cfg`) and
`media_utils.py`. These are eagle3-pipeline's own files, written to the published interface: the file and class
names, the constructor arguments and the methods the engines call (SGLang 0.5.23 srt/multimodal/processors/
kimi_k25.py, vLLM 0.32 transformers_utils/processors/kimi_k25.py). They are not Moonshot's code.

Each file imports only what transformers' remote-code loader can resolve in a checkpoint directory: the standard
library, numpy, PIL, torch, transformers, tiktoken and its sibling files (relative imports).
"""
