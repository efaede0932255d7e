"""STAND-IN (eagle3-pipeline, not SGLang): an SGLang general plugin that gives `torch.cuda.synchronize` its CPU meaning,
nothing to wait for, in a torch built without CUDA.

Why: SGLang 0.5.23's MLA EAGLE-3 draft (srt/models/kimi_k25_eagle3.py `Eagle3DeepseekV2ForCausalLM.set_embed` and
`set_embed_and_head`, the draft class of a Kimi-K2.5 target) calls `torch.cuda.empty_cache()` and then
`torch.cuda.synchronize()` after taking the target's embedding. On a CPU build of torch the first is already a no-op
and the second raises "Torch not compiled with CUDA enabled", so the server stops while loading the draft. The Llama
EAGLE-3 draft (llama_eagle3.py) makes no such call. On a CPU every torch op has finished when it returns, so a device
synchronization has nothing to wait for: answering it with nothing is what the call means there.

What it does not change: a torch built with CUDA keeps its own function (this plugin then does nothing), and no other
torch.cuda function is touched. SGLang loads it like the intel_amx plugin (sglang/srt/plugins/__init__.py, entry
point group ``sglang.srt.plugins``, in the launcher, the scheduler and the detokenizer); deploy/sglang-cpu/install.sh
installs it with an entry point ``eagle3_cpu_device_sync``. Nothing of SGLang is patched.
"""

from __future__ import annotations


def register() -> None:
    """The plugin's entry point: SGLang calls it once per process, before any model is loaded."""
    import torch

    if torch.backends.cuda.is_built():
        return

    def synchronize(device: object = None) -> None:
        """A CPU build of torch has no device work in flight: nothing to wait for."""

    torch.cuda.synchronize = synchronize
