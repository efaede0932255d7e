"""The dev server's app: `create_app` loads the model and builds sglang_protocol's app over it; `serve` runs it.

The app is emulators/sglang_protocol/app.py's (SGLang 0.5.23's endpoints and rules, or 0.4.x with
``sglang_version="0.4"``) over `DevBackend`, with the EOS ids collected as SGLang collects them.

vLLM's hidden-state extraction (``--speculative-config`` / ``--kv-transfer-config``, vLLM's flags with
``extract_hidden_states`` and ``ExampleHiddenStatesConnector``): the server also answers vLLM's
``POST /v1/completions`` for token-id prompts and writes the connector's safetensors files, so the
capture's vLLM backend runs against the tiny target (``emulators/vllm_extract.py``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path

import torch
from fastapi import FastAPI

from emulators import vllm_extract
from emulators.dev_server.backend import VERSION, DevBackend
from emulators.dev_server.batcher import Batcher
from emulators.dev_server.draft import load_served_draft
from emulators.dev_server.speculative import Speculative
from emulators.sglang_protocol.app import create_sglang_app
from emulators.sglang_protocol.auth import Auth
from emulators.sglang_protocol.disconnect import DISCONNECT_POLL_S
from emulators.sglang_protocol.info import DECODE_LOG_INTERVAL
from emulators.sglang_protocol.limits import ModelLimits
from emulators.sglang_protocol.versions import SGLangVersion
from models.target.loader import load_language_model
from models.target.tokenizer import load_tokenizer


def _eos_ids(model, tokenizer) -> set[int]:
    """EOS ids the way SGLang collects them: config, generation config and tokenizer."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None), tokenizer):
        value = getattr(source, "eos_token_id", None)
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(int(v) for v in value)
    return ids


def create_app(
    model_dir: str | Path,
    *,
    context_length: int | None = None,
    max_batch_size: int = 16,
    model_name: str | None = None,
    num_threads: int | None = None,
    speculative: Speculative | None = None,
    extraction: vllm_extract.Extraction | None = None,
    api_key: str | None = None,
    admin_api_key: str | None = None,
    disconnect_poll_s: float = DISCONNECT_POLL_S,
    sglang_version: str = "0.5",
    decode_log_interval: int = DECODE_LOG_INTERVAL,
    trust_remote_code: bool = False,
) -> FastAPI:
    """Load the tokenizer and model (float32, eval) and build the FastAPI app.

    `speculative`: serve with that EAGLE-3 draft (speculative.py), loaded in float32 as the
    eval loads it (`load_exported_draft`); like SGLang, a draft whose hidden size is the target's
    takes the target's input embedding.

    `api_key` / `admin_api_key`: SGLang's ``--api-key`` / ``--admin-api-key`` (sglang_protocol.auth.Auth).
    `disconnect_poll_s`: how often a disconnected client is looked for (SGLang's
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT, 4 s; <= 0: at once). `sglang_version`: "0.5" (SGLang 0.5.23)
    or "0.4" (0.4.x where they differ, sglang_protocol.versions.SGLangVersion). `decode_log_interval`: decode
    batches per fold of avg_spec_accept_length (SGLang's ``--decode-log-interval``, 40).

    `extraction`: also serve vLLM's hidden-state extraction (emulators/vllm_extract.py).

    `trust_remote_code`: SGLang's ``--trust-remote-code``; the target's tokenizer may be its own code (Kimi-K2.5's
    tiktoken tokenizer: models/target/kimi_tokenizer.py).

    `num_threads` sets torch's process-wide intra-op threads; None leaves them as they are
    (`serve` picks a value for a dedicated process).
    """
    version = SGLangVersion.of(sglang_version)
    auth = Auth(api_key=api_key, admin_api_key=admin_api_key, version=version)  # checked before any loading
    model_dir = Path(model_dir)
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    tokenizer = load_tokenizer(str(model_dir), trust_remote_code)
    model = load_language_model(str(model_dir), dtype=torch.float32).eval()  # a kimi_k25 wrapper's text model too
    max_positions = int(model.config.max_position_embeddings)
    context_len = int(context_length or max_positions)
    if not 8 <= context_len <= max_positions:
        raise ValueError(f"context_length must be in [8, {max_positions}] for {model_dir}, got {context_len}")
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
    # No KV pool limit here: SGLang's scheduler limits follow from the context alone.
    limits = ModelLimits(
        vocab_size=int(model.config.vocab_size),
        context_length=context_len,
        reserved_tokens=speculative.reserved_tokens if speculative else 0,
        sglang_version=version,
    )
    draft = None
    if speculative is not None:
        draft = load_served_draft(speculative.draft_model_path, model, version)
    batcher = Batcher(
        model,
        tokenizer,
        eos_ids=_eos_ids(model, tokenizer),
        max_batch_size=max_batch_size,
        draft=draft,
        num_steps=speculative.num_steps if speculative else None,
        sglang_version=version,
        decode_log_interval=decode_log_interval,
    )
    backend = DevBackend(
        batcher,
        model,
        tokenizer,
        limits,
        model_path=str(model_dir),
        served_model_name=model_name or str(model_dir),
        max_batch_size=max_batch_size,
        speculative=speculative,
        disconnect_poll_s=disconnect_poll_s,
    )

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):
        batcher.start()
        try:
            yield
        finally:
            await asyncio.to_thread(batcher.stop)

    app = create_sglang_app(
        backend,
        title="eagle3 SGLang-compatible dev server",
        version=VERSION,
        sglang_version=version,
        auth=auth,
        lifespan=lifespan,
    )
    app.state.batcher = batcher
    if extraction is not None:
        app.include_router(
            vllm_extract.router(
                vllm_extract.Extractor(
                    model,
                    tokenizer,
                    extraction,
                    context_length=context_len,
                    served_model_name=model_name or str(model_dir),
                )
            )
        )
    return app


def serve(
    model_dir: str | Path,
    host: str = "127.0.0.1",
    port: int = 30000,
    *,
    log_level: str = "info",
    num_threads: int | None = None,
    **kw,
) -> None:
    """Run the dev server with uvicorn until interrupted (blocking)."""
    import uvicorn

    if num_threads is None:
        # A dedicated process: leave one core to the HTTP event loop; small models gain
        # little from more than a few intra-op threads.
        num_threads = max(1, min(4, (os.cpu_count() or 2) - 1))
    app = create_app(model_dir, num_threads=num_threads, **kw)
    uvicorn.run(app, host=host, port=port, log_level=log_level)
