"""Async client for SGLang's native HTTP API (/generate, /abort_request, /health_generate, /server_info).

Only token ids go over the wire: prompts are rendered with the target's chat template on our side
and the server applies none, so the training text is exactly what the target generated.

Errors split by what a retry can do:
- `BadRequest` (HTTP 400/422, or another 4xx except 408/429): the request itself is wrong; never retried.
- `ServerUnavailable`: connect errors, timeouts, 408, 429, 5xx; retried with exponential backoff and
  jitter until the outage has lasted `RetryPolicy.outage_window_s`, then `ServerOutage` is raised so
  the caller can fail cleanly (resumably) instead of spinning forever.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

RETRYABLE_STATUS = {408, 429}


class SGLangError(Exception):
    """Base of every error this client raises."""


class BadRequest(SGLangError):
    """The server refused the request as invalid (e.g. prompt longer than the context)."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(f"HTTP {status}: {message}")


class ServerUnavailable(SGLangError):
    """One attempt failed in a way that may succeed later (connection, timeout, 429, 5xx)."""


class ServerOutage(SGLangError):
    """The server stayed unavailable for longer than the configured outage window."""


@dataclass(frozen=True)
class RetryPolicy:
    """Backoff for retryable failures: initial_s * 2**attempt, capped, with +-jitter, until the window."""

    initial_s: float = 0.5
    max_s: float = 30.0
    jitter: float = 0.25  # fraction of the delay added or removed at random
    outage_window_s: float = 600.0

    def delay(self, attempt: int) -> float:
        base = min(self.max_s, self.initial_s * (2**attempt))
        return max(0.0, base * (1 + random.uniform(-self.jitter, self.jitter)))


@dataclass(frozen=True)
class Completion:
    """One finished /generate answer, as SGLang's meta_info reports it."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    e2e_latency: float
    finish_reason: str  # "stop" | "length" | "abort"
    finish_detail: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_response(cls, body: dict[str, Any]) -> Completion:
        """Parse one element of a /generate response; ValueError if it lacks SGLang's fields."""
        try:
            meta = body["meta_info"]
            finish = meta.get("finish_reason") or {}
            if isinstance(finish, str):  # older servers sent a bare string
                finish = {"type": finish}
            return cls(
                rid=str(meta["id"]),
                text=body.get("text", ""),
                output_ids=[int(t) for t in body["output_ids"]],
                prompt_tokens=int(meta["prompt_tokens"]),
                completion_tokens=int(meta["completion_tokens"]),
                cached_tokens=int(meta.get("cached_tokens") or 0),
                reasoning_tokens=int(meta.get("reasoning_tokens") or 0),
                e2e_latency=float(meta.get("e2e_latency") or 0.0),
                finish_reason=str(finish.get("type", "unknown")),
                finish_detail=dict(finish),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"not an SGLang /generate response ({exc!r}): {str(body)[:300]}") from None


def error_message(response: httpx.Response) -> str:
    """The message of an SGLang error body (either of its two shapes), else the raw text."""
    try:
        body = response.json()
    except ValueError:
        return response.text.strip()[:500] or response.reason_phrase
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


class SGLangClient:
    """One connection pool to one SGLang server (or router). Use as an async context manager."""

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float = 1800.0,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def __aenter__(self) -> SGLangClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> Completion:
        """Generate for one prompt of token ids, retrying what can succeed on retry."""
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid}
        data = await self._with_retries("POST", "/generate", json=body, rid=rid)
        if isinstance(data, list):  # a server may wrap a single request in a list
            data = data[0]
        return Completion.from_response(data)

    async def abort(self, rid: str) -> None:
        """Ask the server to stop `rid`; its pending /generate then returns finish_reason abort."""
        try:
            await self._http.post("/abort_request", json={"rid": rid}, timeout=10.0)
        except httpx.HTTPError:
            pass  # best effort: an unreachable server is not generating for us either

    async def server_info(self) -> dict[str, Any]:
        return await self._with_retries("GET", "/server_info")

    async def wait_healthy(self, timeout_s: float) -> None:
        """Poll /health_generate until it answers 200; ServerOutage after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        attempt = 0
        last = "no answer yet"
        while True:
            try:
                response = await self._http.get("/health_generate", timeout=min(60.0, timeout_s))
                if response.status_code == 200:
                    return
                last = f"HTTP {response.status_code}: {error_message(response)}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerOutage(
                    f"{self.base_url} not healthy after {timeout_s:.0f}s (last: {last}); "
                    "is the SGLang server running and done loading?"
                )
            await asyncio.sleep(min(self.retry.delay(attempt), max(0.0, deadline - time.monotonic())))
            attempt += 1

    async def _with_retries(self, method: str, path: str, *, rid: str | None = None, **kw: Any) -> Any:
        started = time.monotonic()
        attempt = 0
        while True:
            try:
                return await self._once(method, path, **kw)
            except ServerUnavailable as exc:
                if isinstance(exc.__cause__, httpx.TimeoutException) and rid is not None:
                    await self.abort(rid)  # do not leave the timed-out request running on the GPUs
                elapsed = time.monotonic() - started
                if elapsed >= self.retry.outage_window_s:
                    raise ServerOutage(
                        f"{method} {self.base_url}{path} failing for {elapsed:.0f}s "
                        f"(outage window {self.retry.outage_window_s:.0f}s): {exc}"
                    ) from exc
                await asyncio.sleep(min(self.retry.delay(attempt), self.retry.outage_window_s - elapsed))
                attempt += 1

    async def _once(self, method: str, path: str, **kw: Any) -> Any:
        try:
            response = await self._http.request(method, path, **kw)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise ServerUnavailable(f"{type(exc).__name__}: {exc or 'no detail'}") from exc
        status = response.status_code
        if status == 200:
            try:
                return response.json()
            except ValueError as exc:
                raise ServerUnavailable(f"unparseable 200 body: {response.text[:200]!r}") from exc
        if status in RETRYABLE_STATUS or status >= 500:
            raise ServerUnavailable(f"HTTP {status}: {error_message(response)}")
        raise BadRequest(status, error_message(response))
