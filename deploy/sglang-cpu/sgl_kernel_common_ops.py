"""STAND-IN (eagle3-pipeline, not SGLang): an empty ``sgl_kernel`` ops library for SGLang 0.5.23 on a CPU.

Installed into .venv-sglang as ``sgl_kernel/sm100/common_ops.py`` by deploy/sglang-cpu/install.sh, beside the
unmodified Python files of the ``sglang-kernel`` 0.4.10 wheel (the version sglang 0.5.23 pins). Why: that
wheel's ``common_ops`` (and its other .so files) are CUDA builds, and SGLang's CPU kernels (sgl-kernel's
csrc/cpu, built from source with ``-march=native``) ship in no registry package. ``sgl_kernel/__init__.py``
loads the first ``sm100/common_ops.*`` it finds (sgl_kernel/load_utils.py ``_load_architecture_specific_ops``),
which is this module: it registers nothing, so every ``torch.ops.sgl_kernel.*`` stays undefined and any call to
one fails loudly (AttributeError / "no such operator"), never silently.

What runs without it: on a CPU without AMX (``cpu_has_amx_support()`` in sglang/srt/utils/common.py is
False), SGLang's norms, activations, rotary embedding, linear layers and KV-cache stores take their plain-torch
paths, and ``--attention-backend torch_native`` attends in torch, so a dense Llama target calls no kernel op.
What does not: anything that calls a ``torch.ops.sgl_kernel`` op on CPU (the speculative decoding helpers in
sgl_kernel/speculative.py, MoE, quantized GEMMs, the AMX paths).
"""
