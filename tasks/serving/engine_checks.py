"""Doctor: the serving engine at server.url answers, is a version we follow, serves the target, has room.

Read over HTTP in seconds, with the engine clients of tasks/serving/ (so what is checked is what
generate will meet): SGLang's /server_info (model_path, version, context_length, vocab_size, the
speculative_* args), vLLM's /v1/models (id, root, max_model_len) and /version.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.common.findings import Finding
from settings.server import ServerSettings
from tasks.serving import client_class
from tasks.serving.client import RetryPolicy, ServerLimits, auth_hint
from tasks.serving.errors import AuthError, InvalidReply, ServerOutage, ServerRefused

# The engine versions our emulations and clients follow (emulators/sglang_protocol/versions.py; the real vLLM of
# `make vllm`).
ENGINE_VERSIONS = {"sglang": "0.5.23", "vllm": "0.32.0"}
DEV_SERVER = "-eagle3-dev"  # how emulators/dev_server/backend.py's /server_info version ends
NO_RETRY = RetryPolicy(initial_s=0.1, max_s=0.1, jitter=0.0, outage_window_s=0.0)  # one try: a check, not a run


def engine_findings(
    server: ServerSettings,
    *,
    target_path: str,
    vocab_size: int | None,
    max_new_tokens: int | None,
    longest_prompts: dict[str, int],
    timeout_s: float = 10.0,
) -> list[Finding]:
    """The findings for every server generate sends to (server.urls, or server.url)."""
    return asyncio.run(_all(_Check(server, target_path, vocab_size, max_new_tokens, longest_prompts, timeout_s)))


@dataclass(frozen=True)
class _Check:
    """What engine_findings checks every server against (its arguments)."""

    server: ServerSettings
    target_path: str
    vocab_size: int | None
    max_new_tokens: int | None
    longest_prompts: dict[str, int]
    timeout_s: float


async def _all(check: _Check) -> list[Finding]:
    out: list[Finding] = []
    for url in check.server.endpoints:
        out += await _one(url, check)
    return out


async def _one(url: str, check: _Check) -> list[Finding]:
    server, timeout_s = check.server, check.timeout_s
    name = f"engine {url}"
    try:
        api_key = server.api_key()
    except RuntimeError as exc:
        return [Finding(name, "FAIL", str(exc), f"export {server.api_key_env}=... before the run")]
    client_type = client_class(server.engine)
    async with client_type(url, request_timeout_s=timeout_s, retry=NO_RETRY, api_key=api_key) as client:
        try:
            limits = await asyncio.wait_for(client.limits(), timeout_s * 2)
            version = await _version(client, server.engine, limits)
        except ServerOutage as exc:
            if isinstance(exc.__cause__, InvalidReply):
                return [
                    Finding(
                        name,
                        "FAIL",
                        f"not a {client.name} server: {exc.__cause__}"[:300],
                        f"server.engine is {server.engine}: point server.url at one, or set server.engine",
                    )
                ]
            return [
                Finding(
                    name,
                    "FAIL",
                    f"not reachable: {exc}"[:300],
                    "start the server (or set server.launch: dev|command so the pipeline starts it), or fix server.url",
                )
            ]
        except (TimeoutError, OSError) as exc:
            return [
                Finding(
                    name,
                    "FAIL",
                    f"not reachable: {type(exc).__name__}: {exc}"[:300],
                    "start the server, or fix server.url",
                )
            ]
        except ServerRefused as exc:
            return [
                Finding(
                    name,
                    "FAIL",
                    f"refused: HTTP {exc.status} from {exc.url}: {' '.join(exc.message.split())[:160]}",
                    auth_hint(server) if isinstance(exc, AuthError) else client.url_hint,
                )
            ]
        except Exception as exc:  # noqa: BLE001 - an answer that is not the engine's (another service at that port)
            return [
                Finding(
                    name,
                    "FAIL",
                    f"not a {client.name} server: {type(exc).__name__}: {exc}"[:300],
                    f"server.engine is {server.engine}: point server.url at one, or set server.engine",
                )
            ]
    out = [
        _version_finding(name, server.engine, version),
        _model_finding(name, limits, check.target_path, server.engine),
        *_vocab_findings(name, limits, check.vocab_size),
        _context_finding(name, limits, check.max_new_tokens, check.longest_prompts, server.engine),
    ]
    out.append(_draft_finding(name, limits, server.engine))
    return out


async def _version(client: Any, engine: str, limits: ServerLimits) -> str | None:
    if engine == "sglang":
        value = limits.info.get("version")
        return value if isinstance(value, str) else None
    body = await client.get_json("/version")  # vLLM: {"version": "0.32.0"}
    value = body.get("version") if isinstance(body, dict) else None
    return value if isinstance(value, str) else None


def _version_finding(name: str, engine: str, version: str | None) -> Finding:
    tested = ENGINE_VERSIONS[engine]
    if version is None:
        return Finding(
            f"{name}: version",
            "WARN",
            f"{engine} did not say its version",
            f"the clients follow {engine} {tested}; replies of other versions may differ",
        )
    if version.endswith(DEV_SERVER):
        return Finding(
            f"{name}: version", "PASS", f"the eagle3 dev server {version} (an emulation of SGLang {tested} on CPU)"
        )
    if version.split(".")[:2] == tested.split(".")[:2]:
        return Finding(f"{name}: version", "PASS", f"{engine} {version}")
    return Finding(
        f"{name}: version",
        "WARN",
        f"{engine} {version}; the clients follow {tested}",
        "replies of other versions may differ: run `eagle3 demo` against it, or use the tested version",
    )


def served_model(limits: ServerLimits, engine: str) -> str | None:
    """The model path or name the server says it serves."""
    if engine == "sglang":
        value = limits.info.get("model_path")
    else:
        cards = limits.info.get("data") if isinstance(limits.info, dict) else None
        card = next((c for c in cards or [] if isinstance(c, dict) and c.get("id") == limits.model), {})
        value = card.get("root") or limits.model
    return value if isinstance(value, str) else None


def same_model(served: str, target_path: str) -> bool:
    """Whether a served model name and target.path name the same checkpoint: the same path, or the same last part."""
    if served == target_path:
        return True
    a, b = Path(served), Path(target_path)
    if a.is_absolute() and b.is_absolute() and a.exists() and b.exists():
        return a.resolve() == b.resolve()
    return a.name == b.name and bool(a.name)  # a Hub id served, a local copy of it here (or the other way round)


def _model_finding(name: str, limits: ServerLimits, target_path: str, engine: str) -> Finding:
    served = served_model(limits, engine)
    if served is None:
        return Finding(
            f"{name}: model",
            "WARN",
            "the server does not say which model it serves",
            "make sure it serves target.path: the prompts are rendered with that tokenizer",
        )
    if same_model(served, target_path):
        return Finding(f"{name}: model", "PASS", served)
    return Finding(
        f"{name}: model",
        "FAIL",
        f"serves {served}, but target.path is {target_path}",
        "serve target.path's model, or set target.path to the served one: prompts are rendered with "
        "target.path's tokenizer, and the responses must be that model's",
    )


def _vocab_findings(name: str, limits: ServerLimits, vocab_size: int | None) -> list[Finding]:
    served = limits.info.get("vocab_size")
    if vocab_size is None or type(served) is not int:
        return []
    if served == vocab_size:
        return [Finding(f"{name}: vocabulary", "PASS", f"{served:,} tokens, as the target's")]
    return [
        Finding(
            f"{name}: vocabulary",
            "FAIL",
            f"{served:,} tokens; the target at target.path has {vocab_size:,}",
            "the server serves another model: serve target.path's",
        )
    ]


def _context_finding(
    name: str, limits: ServerLimits, max_new_tokens: int | None, longest: dict[str, int], engine: str
) -> Finding:
    context = limits.context_length
    if context is None:
        return Finding(
            f"{name}: context",
            "WARN",
            "the server does not say its context length",
            "prompts longer than it allows come back as counted rejects",
        )
    new = max_new_tokens or 0
    reserved = limits.reserved_tokens
    if new + reserved >= context:
        return Finding(
            f"{name}: context",
            "FAIL",
            f"sampling.max_new_tokens {new:,}"
            + (f" + {reserved} draft tokens" if reserved else "")
            + f" leaves no room in the context of {context:,}",
            "lower sampling.max_new_tokens, or serve with a longer context (--context-length / --max-model-len)",
        )
    over = {d: n for d, n in longest.items() if n + new + reserved > context}
    longest_all = max(longest.values(), default=0)
    seen = f"longest sampled prompt {longest_all:,} + max_new_tokens {new:,} vs context {context:,}"
    if not over:
        return Finding(f"{name}: context", "PASS", seen)
    cut = (
        "vLLM cuts max_tokens to what is left (answers end 'length')"
        if engine == "vllm"
        else "SGLang refuses them (counted rejects, cause too_long)"
    )
    return Finding(
        f"{name}: context",
        "WARN",
        f"{seen}: too long in {', '.join(f'{d} ({n:,})' for d, n in over.items())}",
        f"{cut}; lower max_new_tokens or raise the context if many prompts are that long",
    )


def _draft_finding(name: str, limits: ServerLimits, engine: str) -> Finding:
    spec = limits.speculative
    if not spec:
        return Finding(
            f"{name}: draft",
            "PASS",
            "not reported (vLLM does not say its draft over HTTP)" if engine == "vllm" else "none (plain decoding)",
        )
    shown = ", ".join(f"{k} {v}" for k, v in spec.items() if v is not None)
    if spec.get("topk") not in (None, 1):
        return Finding(
            f"{name}: draft", "WARN", shown, "a tree draft (topk > 1): the engine eval measures chains (topk 1)"
        )
    return Finding(f"{name}: draft", "PASS", shown)
