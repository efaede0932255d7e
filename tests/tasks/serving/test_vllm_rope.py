"""vLLM 0.32's rotary embedding on CPU, on the strided views its MLA layer rotates (tasks/serving/vllm.py shape_words):
its CPU kernel gets them wrong, its torch code right, and our server command (NATIVE_ROPE) picks the torch code.

The reference is the GPT-J rotation written out here in float64 (pairs 2i, 2i + 1 turned by pos * theta^(-2i/d)),
not vLLM's nor our draft's code. The kernel's test states the engine's bug: when a vLLM release fixes it, that test
fails, and NATIVE_ROPE can go. Without .venv-vllm every test here skips.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from tasks.serving.vllm import NATIVE_ROPE

pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess]

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
SCRIPT = Path(__file__).with_name("vllm_rope_kernel.py")
THETA, NOPE, ROPE, KV_LORA, HEADS = 50000.0, 32, 64, 512, 4  # the tiny Kimi target's MLA widths
POSITIONS = [0, 1, 2, 3, 7, 40, 200, 2700]


def gptj(x: torch.Tensor, positions: list[int]) -> torch.Tensor:
    """x [T, ..., d] rotated GPT-J style at each token's position, in float64."""
    d = x.shape[-1]
    angle = torch.tensor(positions, dtype=torch.float64)[:, None] * THETA ** (
        -torch.arange(0, d, 2, dtype=torch.float64) / d
    )
    shape = (len(positions),) + (1,) * (x.dim() - 2) + (d // 2,)
    cos, sin = angle.cos().view(shape), angle.sin().view(shape)
    x = x.double()
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)


@pytest.fixture(scope="module")
def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(len(POSITIONS), HEADS, NOPE + ROPE, generator=g)
    kv = torch.randn(len(POSITIONS), KV_LORA + ROPE, generator=g)
    return q, kv


def rotate(custom_ops: list[str], inputs, tmp_path: Path) -> tuple[str, torch.Tensor, torch.Tensor]:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no real vLLM: {VLLM_PYTHON} is missing (`make vllm` installs it; CI does)")
    q, kv = inputs
    request, out = tmp_path / "request.json", tmp_path / "out.json"
    request.write_text(
        json.dumps(
            {
                "positions": POSITIONS,
                "q": q.tolist(),
                "kv": kv.tolist(),
                "nope": NOPE,
                "kv_lora_rank": KV_LORA,
                "rope_theta": THETA,
                "custom_ops": custom_ops,
            }
        )
    )
    done = subprocess.run([str(VLLM_PYTHON), str(SCRIPT), str(request), str(out)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(out.read_text())
    return got["method"], torch.tensor(got["q_pe"]), torch.tensor(got["k_pe"])


def errors(q_pe: torch.Tensor, k_pe: torch.Tensor, inputs) -> tuple[float, float]:
    q, kv = inputs
    want_q = gptj(q[..., NOPE:], POSITIONS)
    want_k = gptj(kv[:, KV_LORA:].unsqueeze(1), POSITIONS)
    return (q_pe.double() - want_q).abs().max().item(), (k_pe.double() - want_k).abs().max().item()


def test_our_command_s_compilation_config_rotates_mla_views_with_vllm_s_torch_code(inputs, tmp_path):
    method, q_pe, k_pe = rotate(NATIVE_ROPE["custom_ops"], inputs, tmp_path)
    assert method == "forward_native"
    q_err, k_err = errors(q_pe, k_pe, inputs)
    assert q_err < 2e-3 and k_err < 2e-3  # float32 angles up to 2,700 radians


def test_vllm_s_cpu_rotary_kernel_rotates_mla_views_wrong(inputs, tmp_path):
    """--enforce-eager's default custom ops (all): the CPU kernel, off by whole units on the strided MLA views."""
    method, q_pe, k_pe = rotate([], inputs, tmp_path)
    assert method == "forward_cpu"
    q_err, _ = errors(q_pe, k_pe, inputs)
    assert q_err > 0.5, f"vLLM's CPU rotary kernel now rotates MLA's views right ({q_err}): NATIVE_ROPE can go"
