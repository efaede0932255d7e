"""STAND-IN (eagle3-pipeline, not torchvision): the two torchvision op schemas that torchvision's Python needs.

Installed into .venv-sglang as ``eagle3_torchvision_ops.py`` with a ``.pth`` line that imports it, by
deploy/sglang-cpu/install.sh. Why: SGLang 0.5.23 imports ``torchvision.transforms`` unconditionally
(sglang/srt/configs -> its multimodal utils), and the registry's torchvision 0.28.0 wheel is a CUDA build
whose ``_C.so`` cannot load with the CPU torch 2.13.0. torchvision then runs without its C++ ops
(``torchvision.extension._has_ops()`` is False), which its Python allows, except that
torchvision/_meta_registrations.py calls ``torch.library.register_fake("torchvision::nms")`` and
``("torchvision::qnms")`` unconditionally: both fail with "operator torchvision::nms does not exist".

This module defines only those two schemas (the ``nms`` schema as torchvision's csrc/ops/nms.cpp declares it;
``qnms`` has the same arguments, per its meta function) and registers no kernel for either: calling one
fails loudly ("no kernel registered"). Nothing SGLang does for a text model calls them. The definition
happens lazily, on the first ``import torchvision`` (a meta-path hook), so other imports pay nothing.
"""

from __future__ import annotations

import importlib.abc
import sys

SCHEMAS = {
    "nms": "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
}
_LIBRARY: list = []  # the torch.library.Library must outlive this call, or its definitions are dropped


def define_schemas() -> None:
    """Define the schemas in the torchvision namespace (once; a no-op where they already exist)."""
    import torch

    missing = [name for name in SCHEMAS if not _defined(torch, name)]
    if not missing:
        return
    library = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        library.define(SCHEMAS[name])
    _LIBRARY.append(library)


def _defined(torch, name: str) -> bool:
    try:
        getattr(torch.ops.torchvision, name)
    except (AttributeError, RuntimeError):
        return False
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    """Defines the schemas on the first import of torchvision, then steps aside (the normal finders import it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_schemas()
        return None


def install() -> None:
    if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
