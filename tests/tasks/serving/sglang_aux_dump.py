"""A test instrument, loaded by the real SGLang 0.5.23 as a plugin (not by pytest): the aux hidden states SGLang's own
DeepSeek model captures for EAGLE-3, written to files.

`plugin_path(dir)` lays it out as a distribution on a path of its own (a module and a dist-info whose entry point is
in SGLang's plugin group ``sglang.srt.plugins``); a server started with that directory on PYTHONPATH and
EAGLE3_SGLANG_AUX_DUMP=DIR loads it in each of its processes (sglang/srt/plugins/__init__.py) and, through SGLang's own
hook registry (plugins/hook_registry.py, an AFTER hook), sees what `DeepseekV2Model.forward` returns
(srt/models/deepseek_v2.py): with a draft, `(hidden_states, aux)`, aux the states entering each layer of
`layers_to_capture`, packed along the last dimension. Each plain prefill (ForwardMode.EXTEND) is written to
DIR/NNNN.safetensors: its input ids, the packed states (float32) and the layer ids. Nothing is changed: the hook returns
None, so SGLang keeps its own result. Without the variable the plugin registers nothing.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

ENV = "EAGLE3_SGLANG_AUX_DUMP"
MODULE = "eagle3_sglang_aux_dump"
TARGET = "sglang.srt.models.deepseek_v2.DeepseekV2Model.forward"


def register() -> None:
    if not os.environ.get(ENV):
        return
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGET, dump, HookType.AFTER)


def dump(result, model, input_ids, positions, forward_batch, *args, **kwargs):
    import torch
    from safetensors.torch import save_file
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    if not isinstance(result, tuple) or forward_batch.forward_mode != ForwardMode.EXTEND:
        return None
    _, aux = result
    out = Path(os.environ[ENV])
    n = len(list(out.glob("*.safetensors")))
    tensors = {
        # the Kimi wrapper passes embeddings, not ids (srt/models/kimi_k25.py): the batch holds the ids
        "input_ids": forward_batch.input_ids.detach().cpu().clone(),
        "aux": aux.detach().to(torch.float32).cpu().clone(),
        "layers": torch.tensor(list(model.layers_to_capture)),
    }
    save_file(tensors, str(out / f"{n:04d}.safetensors.tmp"))
    os.replace(out / f"{n:04d}.safetensors.tmp", out / f"{n:04d}.safetensors")
    return None


def plugin_path(directory: Path) -> Path:
    """This file as an installed plugin under `directory` (to put on the server's PYTHONPATH)."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(__file__, directory / f"{MODULE}.py")
    dist = directory / "eagle3_test_aux_dump-0.1.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: eagle3-test-aux-dump\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(f"[sglang.srt.plugins]\neagle3_test_aux_dump = {MODULE}:register\n")
    return directory
