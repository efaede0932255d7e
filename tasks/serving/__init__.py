"""The serving engines' client side, the counterpart of emulators/ (their server side): one module per engine behind
one interface (tasks/serving/client.py `EngineClient`), the generate stage's pool of servers (pool.py,
pooled_server.py), launching servers and watching them (launch.py, watch.py), the capture's vLLM server
(capture_server.py), the eval's (eval_server.py) and the doctor's engine checks over HTTP (engine_checks.py).

What the generate loop, the server pool, the budget stop and the eval use of an engine, and
nothing else: send token ids and get token ids and counts back (`attempt`, `generate`), stop a
request (`abort`, or close its connection where the engine has no abort), health
(`healthy`, `wait_healthy`), limits and the served draft (`limits`), spec-decode counts
(`Completion.spec_verify_ct`) and the launch flags with a draft (`speculative_args`).

- tasks/serving/sglang.py: SGLang's native /generate (the default, `server.engine: sglang`);
- tasks/serving/vllm.py: vLLM's /v1/completions (`server.engine: vllm`), and its hidden-state
  extraction for the capture.

"Engine" in this code always means the serving engine; DeepSpeed's engine stays DeepSpeed's.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tasks.serving.client import EngineClient

ENGINES = ("sglang", "vllm")


def client_class(engine: str) -> type[EngineClient]:
    """The client class of `engine` (one of ENGINES)."""
    if engine == "sglang":
        from tasks.serving.sglang import SGLangClient

        return SGLangClient
    if engine == "vllm":
        from tasks.serving.vllm import VLLMClient

        return VLLMClient
    raise ValueError(f"unknown serving engine {engine!r}: one of {', '.join(ENGINES)}")
