"""STAND-IN (eagle3-pipeline, not SGLang): the ``sgl_kernel`` ops library for SGLang 0.5.23 on a CPU, ours.

Installed into .venv-sglang as ``sgl_kernel/sm100/common_ops.py`` by deploy/sglang-cpu/install.sh, beside the
unmodified Python files of the ``sglang-kernel`` 0.4.10 wheel (the version sglang 0.5.23 pins) and beside our two
op files, which install.sh copies into the same folder. Why: that wheel's ``common_ops`` (and its other .so files)
are CUDA builds, and SGLang's CPU kernels (sgl-kernel's csrc/cpu, built from source with ``-march=native``) ship in
no registry package. ``sgl_kernel/__init__.py`` loads the first ``sm100/common_ops.*`` it finds
(sgl_kernel/load_utils.py ``_load_architecture_specific_ops``), which is this module.

What it registers: our plain-torch implementations of SGLang's CPU speculative-decoding ops
(sgl_kernel_speculative_ops.py: ``verify_tree_greedy_cpu``, ``build_tree_kernel_efficient_cpu``, ...) and KV-cache
ops (sgl_kernel_kvcache_ops.py: ``store_cache_cpu``, ``copy_all_layer_kv_cache_cpu``) and the two attention ops of
the ``intel_amx`` backend (sgl_kernel_attention_ops.py: ``decode_attention_cpu``, ``extend_attention_cpu``), under the
same ``torch.ops.sgl_kernel`` names and schemas, following the C++ semantics (each op cites its file). Nothing
else: every other ``torch.ops.sgl_kernel.*`` op stays undefined and a call to one fails loudly (AttributeError / "no
such operator"), never silently.

What runs without a kernel op: on a CPU without AMX (``cpu_has_amx_support()`` in sglang/srt/utils/common.py is
False), SGLang's norms, activations, rotary embedding, linear layers and KV-cache stores take their plain-torch
paths. The ``intel_amx`` attention backend (the one SGLang's EAGLE path runs on a CPU; our plugin,
sglang_plugin_intel_amx_attention.py, keeps it without AMX) calls the two attention ops and
``build_draft_decode_metadata_cpu`` (intel_amx_backend.py), all here; so do MLA layers (prefilled as multi-head
attention, decoded over the latent cache), while the MoE with DeepSeek-V3 routing stays plain torch. What does not
run: quantized GEMMs and MoE, and the AMX kernels (norm, GEMM, rope, MoE), which ``convert_weight_packed`` would
switch on together (it stays undefined).
"""

import importlib.util
import sys
from pathlib import Path

import torch

NAMESPACE = "sgl_kernel"
OP_FILES = ("sgl_kernel_speculative_ops", "sgl_kernel_kvcache_ops", "sgl_kernel_attention_ops")


def defined(name: str) -> bool:
    """Whether ``torch.ops.sgl_kernel.<name>`` exists already (ours, or a real kernel library's)."""
    try:
        getattr(getattr(torch.ops, NAMESPACE), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def register(schemas: dict, impls: dict) -> torch.library.Library | None:
    """Define each op of `schemas` not yet defined under ``torch.ops.sgl_kernel``, with its CPU implementation from
    `impls`; the library holding them (None: none was missing), which must be kept alive, or its definitions are
    dropped."""
    missing = [name for name in schemas if not defined(name)]
    if not missing:
        return None
    library = torch.library.Library(NAMESPACE, "FRAGMENT")
    for name in missing:
        library.define(schemas[name])
        library.impl(name, impls[name], "CPU")
    return library


for _name in OP_FILES:
    # loaded by path: this file is itself loaded by path (load_utils), not as part of a package
    _spec = importlib.util.spec_from_file_location(f"eagle3_{_name}", Path(__file__).with_name(f"{_name}.py"))
    assert _spec is not None and _spec.loader is not None
    _module = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _module  # kept alive, and with it the library that holds its ops
    _spec.loader.exec_module(_module)
    _module.LIBRARY = register(_module.SCHEMAS, _module.IMPLS)
