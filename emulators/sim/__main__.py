"""Simulated SGLang server: SGLang's native HTTP protocol with deterministic fake outputs, no model.

The CLI, in the foreground: ``python -m emulators.sim --port N [--max-running ..] [--decode-ms ..] [--mean-len ..]
[--seed ..] [--model-path ..] [--api-key ..] [--admin-api-key ..] [--sglang-version 0.5|0.4] [--disconnect-poll-s ..]
[--reserved-tokens ..] [--length-rules FILE.json]`` (the package docstring says what it serves).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
from pathlib import Path

from emulators.flag_values import flag_values
from emulators.sglang_protocol.flags import add_server_flags
from emulators.sim.config import LengthRule, SimConfig
from emulators.sim.server import SimServer


def main(argv: list[str] | None = None) -> None:
    """CLI: ``python -m emulators.sim --port N [--max-running ..] [--decode-ms ..] ...`` (foreground)."""
    ap = argparse.ArgumentParser(prog="python -m emulators.sim", description=__doc__.splitlines()[0])
    d = SimConfig()
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=30000, help="0: any free port (printed on start)")
    ap.add_argument("--max-running", type=int, default=d.max_running, help="sequences decoding at once")
    ap.add_argument("--decode-ms", type=float, default=d.decode_s_per_token * 1e3, help="ms per output token")
    ap.add_argument("--prefill-ms", type=float, default=d.prefill_s_per_token * 1e3, help="ms per prompt token")
    ap.add_argument("--mean-len", type=float, default=d.mean_len, help="mean natural output length")
    ap.add_argument("--sigma", type=float, default=d.sigma, help="lognormal sigma (tail weight)")
    ap.add_argument("--length-dist", default=d.length_dist, choices=["lognormal", "exponential", "fixed"])
    ap.add_argument("--vocab-size", type=int, default=d.vocab_size)
    ap.add_argument("--eos-id", type=int, default=d.eos_token_id)
    ap.add_argument("--context-length", type=int, default=d.context_length)
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--model-path", default=d.model_path, help="the model path /model_info and /server_info report")
    ap.add_argument("--starting", action="store_true", help="start with /health_generate answering 503")
    ap.add_argument("--log-level", default="warning")
    add_server_flags(ap, sglang_version=d.sglang_version, disconnect_poll_s=d.disconnect_poll_s)
    ap.add_argument(
        "--reserved-tokens",
        type=int,
        default=d.reserved_tokens,
        help="tokens reserved per request in the length checks, as an EAGLE server does",
    )
    ap.add_argument(
        "--length-rules",
        type=Path,
        help='per-dataset answer lengths, a JSON file {"<dataset>": {"length_dist": .., "mean_len": .., "sigma": ..}}',
    )
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr)
    try:
        per_token = {"decode_s_per_token": args.decode_ms / 1e3, "prefill_s_per_token": args.prefill_ms / 1e3}
        rules = length_rules(args.length_rules) if args.length_rules else ()
        config = SimConfig(**flag_values(args, SimConfig, eos_token_id=args.eos_id, length_rules=rules, **per_token))
        server = SimServer(**flag_values(args, SimServer, config=config))
    except ValueError as exc:
        ap.error(str(exc))
    try:
        asyncio.run(server.serve_forever())
    except KeyboardInterrupt:
        pass


def length_rules(path: Path) -> tuple[LengthRule, ...]:
    """The rules of a ``--length-rules`` file; ValueError naming the file and the entry that is wrong."""
    try:
        spec = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"--length-rules {path}: {exc}") from None
    if not isinstance(spec, dict):
        raise ValueError(f"--length-rules {path}: want an object of datasets, got {type(spec).__name__}")
    rules = []
    for name, fields in spec.items():
        try:
            rules.append(LengthRule(name, **fields))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"--length-rules {path}: {name!r}: {exc}") from None
    return tuple(rules)


if __name__ == "__main__":
    main()
