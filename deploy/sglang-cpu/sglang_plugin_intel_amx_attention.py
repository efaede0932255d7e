"""STAND-IN (eagle3-pipeline, not SGLang): an SGLang general plugin that keeps `--attention-backend intel_amx` on a
CPU without AMX, because the backend's two kernel ops are answered by our torch versions (sgl_kernel_attention_ops.py).

Why: SGLang 0.5.23 runs EAGLE / EAGLE-3 on a CPU only through the intel_amx attention backend (speculative/
draft_utils.py maps "intel_amx" to a draft backend; torch_native has none: "EAGLE is not supported in decode
attention backend torch_native"). Its server arguments turn intel_amx into torch_native when the platform fact
``has_amx`` is false (arg_groups/overrides.py ``_attention_backend_platform_fallbacks``). This plugin sets that one
fact, the way SGLang provides for it (runtime_context.py ``override_platform``), in every SGLang process: SGLang calls
``load_plugins()`` in the launcher, the scheduler and the detokenizer (sglang/srt/plugins/__init__.py; entry point
group ``sglang.srt.plugins``).

What it does not change: every other AMX decision (the linear, norm, rotary, MoE and KV-cache paths) reads
``cpu_has_amx_support()`` directly (utils/common.py: the CPU's AMX tiles and the ``convert_weight_packed`` op),
which stays false here, so those layers keep their plain-torch paths. The only other reader of the fact is
gpt_oss's config override (arg_groups/model_overrides/gpt_oss.py), which this project does not serve.

deploy/sglang-cpu/install.sh installs it with an entry point ``eagle3_intel_amx_attention``. Nothing of SGLang is
patched; a machine with AMX and SGLang's own kernels needs none of this.
"""

from __future__ import annotations


def register() -> None:
    """The plugin's entry point: SGLang calls it once per process, before the server arguments are resolved."""
    from sglang.srt.runtime_context import override_platform

    override_platform(has_amx=True).install()
