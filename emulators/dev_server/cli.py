"""The dev server's command line: `main`, ``python -m emulators.dev_server`` and ``eagle3 serve-dev``.

SGLang 0.5.23's flags (``--speculative-*``, ``--decode-log-interval``, and sglang_protocol/flags.py's
``--api-key``, ``--admin-api-key``, ``--sglang-version``, ``--disconnect-poll-s``) and vLLM's extraction
flags (emulators/vllm_extract.py), each passed to `serve` / `create_app` by its parameter's name.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from emulators import vllm_extract
from emulators.dev_server.app import create_app, serve
from emulators.dev_server.speculative import Speculative
from emulators.flag_values import flag_values
from emulators.sglang_protocol.flags import add_server_flags
from emulators.sglang_protocol.info import DECODE_LOG_INTERVAL

# The dev server's one-line description (`--help`).
DESCRIPTION = "SGLang-compatible dev server: SGLang's native HTTP protocol over a small HF causal LM on CPU."


def main(argv: list[str] | None = None, prog: str = "python -m emulators.dev_server") -> None:
    """CLI: ``python -m emulators.dev_server --model DIR [--host] [--port] ...`` (also `eagle3 serve-dev`)."""
    ap = argparse.ArgumentParser(prog=prog, description=DESCRIPTION)
    ap.add_argument("--model", required=True, help="HF model directory (weights + tokenizer; `eagle3 tiny-target`)")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000)
    ap.add_argument("--context-length", type=int, default=None, help="default: max_position_embeddings")
    ap.add_argument("--max-batch-size", type=int, default=16, help="sequences decoded together")
    ap.add_argument("--model-name", default=None, help="served model name (default: the model path)")
    ap.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--log-level", default="info")
    ap.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="SGLang's flag: run the target's own tokenizer code (Kimi-K2.5's is tiktoken remote code)",
    )
    ap.add_argument("--speculative-algorithm", default=None, help="EAGLE3 (the only one; implied by a draft path)")
    ap.add_argument("--speculative-draft-model-path", default=None, help="an EAGLE-3 export (models/export/eagle3.py)")
    ap.add_argument("--speculative-num-steps", type=int, default=None, help="draft tokens proposed per round")
    ap.add_argument("--speculative-eagle-topk", type=int, default=None, help="must be 1 (chain)")
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=None, help="must be num-steps + 1")
    ap.add_argument(
        "--decode-log-interval",
        type=int,
        default=DECODE_LOG_INTERVAL,
        help="decode batches between folds of avg_spec_accept_length (SGLang's flag)",
    )
    ap.add_argument(
        "--speculative-config",
        "--speculative_config",
        default=None,
        help="vLLM's flag: JSON with method extract_hidden_states and the layer ids (emulators/vllm_extract.py)",
    )
    ap.add_argument(
        "--kv-transfer-config",
        "--kv_transfer_config",
        default=None,
        help="vLLM's flag: JSON with kv_connector ExampleHiddenStatesConnector and its shared_storage_path",
    )
    ap.add_argument(
        "--no-enable-chunked-prefill", action="store_true", help="accepted for vLLM's command line (no chunking here)"
    )
    add_server_flags(ap)
    args = ap.parse_args(argv)
    if not (Path(args.model) / "config.json").is_file():
        ap.error(f"{args.model} has no config.json; build one with `eagle3 tiny-target {args.model}`")
    try:
        extraction = vllm_extract.Extraction.from_flags(args.speculative_config, args.kv_transfer_config)
    except ValueError as exc:
        ap.error(str(exc))
    try:
        speculative = Speculative.from_flags(**flag_values(args, Speculative.from_flags, prefix="speculative_"))
    except ValueError as exc:
        ap.error(str(exc))
    if args.admin_api_key and args.sglang_version == "0.4":
        ap.error("--admin-api-key does not exist in SGLang 0.4.x (only --api-key)")
    logging.basicConfig(level=args.log_level.upper())
    serve(**flag_values(args, serve, create_app, model_dir=args.model, speculative=speculative, extraction=extraction))
