"""The rehearsal's synthetic target forward (bench/rehearsal.py), for the capture ranks it starts.

Put on PYTHONPATH with REHEARSAL_SYNTHETIC_FORWARD=1 (the ranks inherit both), this replaces, once
models.capture.job is imported, the forward its `_load_target` returns by one that gives the hidden states the
capture expects (L + 1 tensors [B, S, H]) from the target's embeddings plus a per-layer offset: a gather and L adds,
no attention and no MLP. Everything after the forward (the shard writer, the index, resume) runs unchanged: what the
rehearsal measures is our path, not the target's FLOPs. Without the variable nothing is changed.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from types import SimpleNamespace
from typing import Any

MODULE = "models.capture.job"


def _synthetic(model: Any) -> Any:
    import torch

    layers = model.config.num_hidden_layers
    embed = model.get_input_embeddings()

    def forward(input_ids: Any, attention_mask: Any = None, **_: Any) -> Any:
        with torch.no_grad():
            base = embed(input_ids)  # [B, S, H]
            return SimpleNamespace(hidden_states=tuple(base + 0.01 * k for k in range(layers + 1)))

    return forward


def _patch(module: Any) -> None:
    load = module._load_target

    def _load_target(*args: Any, **kwargs: Any) -> Any:
        _, model = load(*args, **kwargs)
        return _synthetic(model), model

    module._load_target = _load_target


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if os.environ.get("REHEARSAL_SYNTHETIC_FORWARD") == "1":
    sys.meta_path.insert(0, _Finder())
