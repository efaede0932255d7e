"""Run in .venv-vllm (not by pytest): vLLM's rotary embedding on the strided views its MLA layer rotates.

    python vllm_rope_kernel.py REQUEST.json OUT.json

REQUEST.json: {"positions": [...], "q": [T][H][nope + rope], "kv": [T][kv_lora_rank + rope], "nope": N,
"kv_lora_rank": R, "rope_theta": B, "custom_ops": [...]}. The rope part is rotated as
vllm/model_executor/layers/mla.py (0.32.0) calls it: `q[..., nope:]` and the rope part of the latent projection with a
head dimension of 1, by a `RotaryEmbedding` (GPT-J style, is_neox_style=False, as deepseek_v2.py builds it without
rope scaling) made under a config with --enforce-eager's compilation mode (NONE) and `custom_ops`. OUT.json:
{"method": the forward vLLM dispatched to, "q_pe", "k_pe": the rotated parts}.
"""

from __future__ import annotations

import json
import sys

import torch
from vllm.config import CompilationConfig, VllmConfig, set_current_vllm_config
from vllm.config.compilation import CompilationMode


def main(request_path: str, out_path: str) -> None:
    r = json.loads(open(request_path).read())
    config = VllmConfig(compilation_config=CompilationConfig(mode=CompilationMode.NONE, custom_ops=r["custom_ops"]))
    with set_current_vllm_config(config):
        from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

        q, kv = torch.tensor(r["q"]), torch.tensor(r["kv"])
        rope_dim = q.shape[-1] - r["nope"]
        rope = RotaryEmbedding(rope_dim, rope_dim, 4096, r["rope_theta"], False, torch.float32)
        k_pe = kv.split([r["kv_lora_rank"], rope_dim], dim=-1)[1].unsqueeze(1)
        q[..., r["nope"] :], k_pe = rope(torch.tensor(r["positions"]), q[..., r["nope"] :], k_pe)
        out = {"method": rope._forward_method.__name__, "q_pe": q[..., r["nope"] :].tolist(), "k_pe": k_pe.tolist()}
    with open(out_path, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
