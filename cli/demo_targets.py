"""The demo's tiny targets and the engines it can run through, checked before anything heavy is imported: a refused
`eagle3 demo` argument answers at once (cli/app.py), and cli/demo.py runs what these name."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class DemoTarget:
    """One of the demo's tiny targets: its preset, the engine it runs through unless told otherwise, and the context a
    real engine is started with for it (vLLM's --max-model-len)."""

    config: Path
    engine: str
    max_model_len: int | None = None  # None: vLLM's CPU command's own (tasks/serving/vllm.py cpu_command)
    base: Path | None = None  # a quantized target: where its unquantized build is made or reused


DEMO_TARGETS = {
    "llama": DemoTarget(REPO / "configs" / "demo.yaml", "dev"),
    # vLLM serves the kimi_k25 wrapper as published (models/target/tiny_kimi.py); the dev server is an SGLang emulation
    "kimi": DemoTarget(REPO / "configs" / "demo-kimi.yaml", "vllm"),
    # the Kimi-shaped target trained on a book: answers of up to ~2,100 tokens (models/target/book.py)
    "kimi-long": DemoTarget(REPO / "configs" / "demo-kimi-long.yaml", "vllm", max_model_len=4096),
    # the kimi target as Kimi-K2.5 is published, its routed experts INT4 (models/target/int4.py): the dev server serves
    # it (vLLM 0.32 has no CPU kernel for an INT4 MoE with DeepSeek-V3 routing: docs/kimi-k25.md), DeepSpeed captures it
    "kimi-int4": DemoTarget(REPO / "configs" / "demo-kimi-int4.yaml", "dev", base=REPO / "runs" / "tiny-kimi"),
}
VLLM_VENV = REPO / ".venv-vllm"  # `make vllm`: the CPU build of vLLM in a venv of its own (REFERENCE.md)
SGLANG_VENV = REPO / ".venv-sglang"  # `make sglang`: the real SGLang 0.5.23 on CPU, with labelled stand-ins
# What `--engine` names: the server the demo's generate (and engine eval) goes through.
DEMO_ENGINES = {
    "dev": "the dev server",
    "sglang": "a real SGLang",
    "vllm": "a real vLLM",
}


def engine_python(venv: Path, engine: str, install: str) -> Path:
    """The Python of an engine's venv; FileNotFoundError saying how to make it (`install`) and what a GPU user does."""
    python = venv / "bin" / "python"
    if not python.is_file():
        raise FileNotFoundError(
            f"{python} is missing: `make {engine}` installs {install} there; with a GPU, install {engine} your own "
            f"way and start it yourself (server.engine: {engine}, launch: none)"
        )
    return python


def vllm_python() -> Path:
    return engine_python(VLLM_VENV, "vllm", "the CPU build of vLLM (about a minute)")


def sglang_python() -> Path:
    return engine_python(SGLANG_VENV, "sglang", "SGLang 0.5.23 for CPU (about a minute)")


def check_demo_engine(engine: str, target: str, draft_arch: str = "llama") -> None:
    """ValueError/FileNotFoundError if `engine` cannot run the demo of `target` with a `draft_arch` draft here, saying
    what to do."""
    if engine not in DEMO_ENGINES:
        raise ValueError(f"--engine must be {', '.join(DEMO_ENGINES)}, got {engine!r}")
    if draft_arch not in ("llama", "mla"):
        raise ValueError(f"--draft-arch must be llama or mla, got {draft_arch!r}")
    if draft_arch == "mla" and not target.startswith("kimi"):
        raise ValueError(
            "--draft-arch mla: the MLA draft takes the target's latent-attention widths, which the llama target has "
            "none of; use --target kimi"
        )
    if engine == "sglang" and target == "kimi-int4":
        raise ValueError(
            "the real SGLang here does not serve the INT4 target: SGLang 0.5.23's compressed-tensors INT4 MoE "
            "repacks the experts for its Marlin kernels (srt/layers/quantization/compressed_tensors/schemes/"
            "compressed_tensors_wNa16_moe.py), which have no CPU build; use --engine dev, or --target kimi for "
            "Kimi's shape unquantized"
        )
    if engine == "vllm":
        vllm_python()
    if engine == "sglang":
        sglang_python()
