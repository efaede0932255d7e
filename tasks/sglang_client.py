"""Async client for SGLang's native HTTP API (/generate, /abort_request, /health_generate, /server_info).

Only token ids go over the wire: prompts are rendered with the target's chat template on our side
and the server applies none, so the training text is exactly what the target generated.

A status code means what it says, on every endpoint:
- `BadRequest` (HTTP 400, 413, 422): this request is wrong (e.g. a prompt over the context length);
  never retried, the caller rejects the prompt.
- `ServerRefused` (401/403 `AuthError`, 404/405 `WrongEndpoint`, any other 4xx): the run itself
  is misconfigured (a rotated key, a URL that is not SGLang's native API). Nothing is retried and
  nothing is rejected: the caller stops and the user fixes the cause.
- `ServerUnavailable`: connect errors, timeouts, 408, 429, 5xx, and replies that fail the checks
  of `check_reply` (`InvalidReply`: a server that answers 200 with impossible content is faulty,
  not the prompt); retried with exponential backoff and jitter until the outage has lasted
  `RetryPolicy.outage_window_s`, then `ServerOutage` is raised so the caller can fail cleanly
  (resumably) instead of spinning forever.

A reply is parsed and checked before anyone records it: output_ids a list of token ids,
completion_tokens == len(output_ids) >= 1, prompt_tokens == the ids sent, at most max_new_tokens,
a known finish reason, a matched stop id at the end, and a body size cap. An abort is known by its
finish reason alone: SGLang 0.5.23 answers a request aborted while still queued with no
prompt_tokens (managers/tokenizer_manager.py `_handle_abort_req`), 0.4.x with prompt_tokens 0 and
no output_ids; it is never recorded, so nothing else of it is required.

Request ids: every send carries a fresh one (`request_id`). SGLang refuses a rid it still holds
(400 "Duplicate request ID detected", tokenizer_manager.py), and it still holds a request whose
client went away until its ~4 s disconnect poll notices; /abort_request aborts every rid that
STARTS WITH the given one (managers/scheduler.py `abort_request`). Our rids begin with a unique
fixed-width nonce, so no rid is a prefix of another and an abort reaches only its own request.
The prompt's identity lives in our records, never in SGLang's rid.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import httpx

from models.jobs import ServerSettings
from tasks.rejects import says_too_long

RETRYABLE_STATUS = {408, 429}
PROMPT_STATUS = {400, 413, 422}  # the request (prompt) is at fault
AUTH_STATUS = {401, 403}
ENDPOINT_STATUS = {404, 405}
FINISH_REASONS = ("stop", "length", "abort")
RID_NONCE_HEX = 24  # 96 random bits: fixed width, so no rid we send is a prefix of another
DUPLICATE_RID = "duplicate request id"  # SGLang's 400 for a rid it still holds (lower case, as matched)
MAX_REPLY_BYTES = 64 * 2**20  # a /generate reply of 16k tokens is ~0.2 MiB; more is a faulty server

log = logging.getLogger("eagle3.sglang")


def request_id(label: str) -> str:
    """A fresh SGLang rid for one send of `label` (e.g. "B1_glaive:123"): a unique nonce, then the label.

    The nonce has a fixed width, so two rids share a prefix of that width only if they are the same
    rid: SGLang's prefix-matching /abort_request then stops exactly the request it names.
    """
    return f"{secrets.token_hex(RID_NONCE_HEX // 2)}-{label}"


class SGLangError(Exception):
    """Base of every error this client raises."""


class BadRequest(SGLangError):
    """The server refused the request as invalid (e.g. prompt longer than the context)."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(f"HTTP {status}: {message}")

    @property
    def too_long(self) -> bool:
        """The prompt exceeds the server's context: a bigger context later may take it."""
        return says_too_long(self.message)



class ServerRefused(SGLangError):
    """The server refuses the run itself (credentials, wrong URL): stop, reject nothing, retry nothing."""

    def __init__(self, status: int, url: str, message: str, hint: str):
        self.status = status
        self.url = url
        self.message = message
        super().__init__(f"HTTP {status} from {url}: {message}. {hint} Nothing was rejected: run again once fixed.")


class AuthError(ServerRefused):
    """401/403: the API key is missing, wrong or rotated."""


class WrongEndpoint(ServerRefused):
    """404/405: server.url does not point at SGLang's native API."""


class ServerUnavailable(SGLangError):
    """One attempt failed in a way that may succeed later (connection, timeout, 429, 5xx)."""


class InvalidReply(ServerUnavailable):
    """A 200 whose content cannot be true (counts, ids, finish reason, size): a server fault, retried."""

    def __init__(self, kind: str, detail: str):
        self.kind = kind  # a short, stable name of the check that failed (for counting)
        super().__init__(f"invalid reply ({kind}): {detail}")


class DuplicateRequestId(ServerUnavailable):
    """SGLang refused the rid as one it still holds (400): not the prompt's fault; sent again with a new rid."""


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
    spec_verify_ct: int | None = None  # verify rounds, from a server that decodes with a draft; None without one

    @classmethod
    def from_response(cls, body: Any) -> Completion:
        """Parse one element of a /generate response; InvalidReply if it lacks SGLang's fields or types.

        An abort needs only its finish reason: output_ids, prompt_tokens and completion_tokens may be
        missing (a queued abort: 0.5.23 sends no prompt_tokens, 0.4.x no output_ids).
        """
        if not isinstance(body, dict) or not isinstance(body.get("meta_info"), dict):
            raise InvalidReply("shape", f"not an SGLang /generate response: {str(body)[:300]}")
        meta = body["meta_info"]
        finish = meta.get("finish_reason")
        if isinstance(finish, str):  # older servers sent a bare string
            finish = {"type": finish}
        if not isinstance(finish, dict) or finish.get("type") not in FINISH_REASONS:
            raise InvalidReply("finish_reason", f"finish_reason must be one of {FINISH_REASONS}, got {finish!r}")
        aborted = finish["type"] == "abort"
        output_ids = body.get("output_ids")
        if output_ids is None and aborted:
            output_ids = []
        if not isinstance(output_ids, list) or not all(type(t) is int and t >= 0 for t in output_ids):
            raise InvalidReply("output_ids", f"output_ids must be a list of non-negative ints, got {str(output_ids)[:200]}")
        text = body.get("text", "")
        if not isinstance(text, str):
            raise InvalidReply("text", f"text must be a string, got {type(text).__name__}")
        completion = _count(meta, "completion_tokens", required=not aborted, default=len(output_ids))
        return cls(
            rid=str(meta.get("id", "")),
            text=text,
            output_ids=output_ids,
            prompt_tokens=_count(meta, "prompt_tokens", required=not aborted),
            completion_tokens=completion,
            cached_tokens=_count(meta, "cached_tokens"),
            reasoning_tokens=_count(meta, "reasoning_tokens"),
            e2e_latency=_seconds(meta.get("e2e_latency")),
            finish_reason=finish["type"],
            finish_detail=dict(finish),
            spec_verify_ct=None if meta.get("spec_verify_ct") is None else _count(meta, "spec_verify_ct"),
        )


def _count(meta: dict[str, Any], key: str, *, required: bool = False, default: int = 0) -> int:
    value = meta.get(key)
    if value is None and not required:
        return default
    if type(value) is not int or value < 0:
        raise InvalidReply(key, f"meta_info.{key} must be a non-negative int, got {value!r}")
    return value


def _seconds(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidReply("e2e_latency", f"meta_info.e2e_latency must be a number, got {value!r}")
    return float(value)


def check_reply(done: Completion, input_ids: list[int], sampling_params: dict[str, Any], vocab_size: int | None) -> None:
    """InvalidReply unless the answer is possible for what was sent (the checks a recorded reply passed)."""
    if done.finish_reason == "abort":
        # Never recorded: its partial counts only feed the budget's waste. Checked before prompt_tokens,
        # which a queued abort does not carry (module docstring).
        return
    if done.prompt_tokens != len(input_ids):
        raise InvalidReply("prompt_tokens", f"prompt_tokens {done.prompt_tokens} for a prompt of {len(input_ids)} ids")
    n = len(done.output_ids)
    if done.completion_tokens != n:
        raise InvalidReply("completion_tokens", f"completion_tokens {done.completion_tokens} with {n} output_ids")
    if n < 1:
        raise InvalidReply("empty", f"finish_reason {done.finish_reason} with no output_ids")
    limit = sampling_params.get("max_new_tokens")
    if isinstance(limit, int) and n > limit:
        raise InvalidReply("too_many_tokens", f"{n} output_ids but max_new_tokens is {limit}")
    if done.spec_verify_ct is not None and done.spec_verify_ct > n:
        raise InvalidReply("spec_verify_ct", f"spec_verify_ct {done.spec_verify_ct} verify rounds for {n} output_ids")
    if vocab_size is not None and max(done.output_ids) >= vocab_size:
        raise InvalidReply("token_id", f"output id {max(done.output_ids)} is outside the vocabulary of {vocab_size}")
    matched = done.finish_detail.get("matched")
    if done.finish_reason == "stop" and type(matched) is int and done.output_ids[-1] != matched:
        # we send no_stop_trim: the matched stop id must be the last output id
        raise InvalidReply("stop_token", f"finish matched stop id {matched} but the last output id is {done.output_ids[-1]}")


def auth_hint(server: ServerSettings) -> str:
    """What to check when a server refuses our credentials, naming the setting that holds the key (never the key)."""
    if server.api_key_env:
        return f"check that ${server.api_key_env} (server.api_key_env) holds the server's current --api-key"
    return "the server wants an API key: set server.api_key_env to the name of the variable that holds it"


def error_message(response: httpx.Response) -> str:
    """The message of an SGLang error response (any of its three body shapes), else the raw text."""
    return body_message(response.content, response.reason_phrase)


def body_message(content: bytes, reason_phrase: str = "") -> str:
    """The message of an SGLang error body, else its raw text (or the reason phrase when empty).

    SGLang 0.5.23's shapes: `{"error": {"message": ...}}` (a ValueError, srt/server/utils.py
    `create_error_response`), `{"object": "error", "message": ...}` (validation and HTTP errors,
    entrypoints/http_server.py), `{"error": "<string>"}` (the /generate contract gate,
    `generate_request`, and the API-key middleware's 401/403, utils/auth.py).
    """
    try:
        body = json.loads(content)
    except ValueError:
        return content.decode("utf-8", "replace").strip()[:500] or reason_phrase
    if isinstance(body, dict):
        if isinstance(body.get("error"), dict) and "message" in body["error"]:
            return str(body["error"]["message"])
        if isinstance(body.get("error"), str):
            return body["error"]
        if "message" in body:
            return str(body["message"])
        if "detail" in body:
            return str(body["detail"])
    return str(body)[:500]


class SGLangClient:
    """One connection pool to one SGLang server (or router). Use as an async context manager.

    The generate stage reaches servers through tasks.server_pool (which calls `attempt` and fails
    over between servers); `generate` retries at this one server and suits a lone caller.

    `auth_hint` finishes the message of an AuthError (e.g. which setting holds the key);
    `vocab_size` lets replies be checked against the target's vocabulary; `logger` gets one
    warning per kind of invalid reply (then they are only counted, in `invalid_replies`).
    """

    def __init__(
        self,
        base_url: str,
        *,
        request_timeout_s: float = 1800.0,
        retry: RetryPolicy | None = None,
        api_key: str | None = None,
        max_connections: int = 256,
        transport: httpx.AsyncBaseTransport | None = None,
        auth_hint: str = "Check the API key the server expects.",
        vocab_size: int | None = None,
        max_reply_bytes: int = MAX_REPLY_BYTES,
        logger: logging.Logger | logging.LoggerAdapter = log,
    ):
        self.base_url = base_url.rstrip("/")
        self.retry = retry or RetryPolicy()
        self.auth_hint = auth_hint
        self.vocab_size = vocab_size
        self.max_reply_bytes = max_reply_bytes
        self.log = logger
        self.invalid_replies: dict[str, int] = {}  # kind -> count
        self.can_abort = True  # False once the server refused /abort_request (no such endpoint, or not our key)
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

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], label: str) -> Completion:
        """Generate for one prompt of token ids, retrying what can succeed on retry; the reply is checked.

        Every try is sent with a fresh rid (`request_id(label)`): a retry must not meet the rid of
        its own earlier try, which the server may still hold.
        """
        parse = self._completion_parser(input_ids, sampling_params, self.vocab_size)

        def body() -> dict[str, Any]:
            return {"input_ids": input_ids, "sampling_params": sampling_params, "rid": request_id(label)}

        return await self._with_retries("POST", "/generate", body=body, parse=parse)

    async def attempt(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str, *,
                      vocab_size: int | None = None) -> Completion:
        """One /generate attempt with `rid` (fresh for this send: `request_id`), no retry (a server pool retries
        elsewhere): ServerUnavailable when it may succeed later.

        An invalid reply is counted (and logged once per kind); a timed-out request is aborted here.
        """
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid}
        parse = self._completion_parser(input_ids, sampling_params, vocab_size if vocab_size is not None else self.vocab_size)
        try:
            return parse(await self._once("POST", "/generate", json=body))
        except ServerUnavailable as exc:
            await self._after_failure(exc, "/generate", rid)
            raise

    @staticmethod
    def _completion_parser(input_ids: list[int], sampling_params: dict[str, Any], vocab_size: int | None) -> Callable[[Any], Completion]:
        def parse(data: Any) -> Completion:
            if isinstance(data, list) and len(data) == 1:  # a server may wrap a single request in a list
                data = data[0]
            done = Completion.from_response(data)
            check_reply(done, input_ids, sampling_params, vocab_size)
            return done

        return parse

    async def abort(self, rid: str) -> bool:
        """Ask the server to stop `rid`; its pending /generate then returns finish_reason abort.

        False when the server will not abort for us, and the caller closes the request's connection
        instead (SGLang aborts a request whose client went away, after its disconnect poll):
        - 404/405: no /abort_request (an SGLang router answers so);
        - 401/403: our key does not open it. With --admin-api-key, SGLang's /abort_request takes
          only the admin key (entrypoints/http_server.py ADMIN_OPTIONAL, utils/auth.py).
        Either is reported once (logged) and remembered in `can_abort`.
        """
        if not self.can_abort:
            return False
        try:
            response = await self._http.post("/abort_request", json={"rid": rid}, timeout=10.0)
        except httpx.HTTPError:
            return True  # best effort: an unreachable server is not generating for us either
        if response.status_code not in ENDPOINT_STATUS and response.status_code not in AUTH_STATUS:
            return True
        if not self.can_abort:  # another abort sent at the same time was refused first and said so
            return False
        self.can_abort = False
        if response.status_code in ENDPOINT_STATUS:
            self.log.info("%s has no /abort_request (HTTP %d; an SGLang router?): requests are stopped by closing their "
                          "connection", self.base_url, response.status_code)
        else:
            self.log.warning("%s/abort_request refused our key (HTTP %d: %s): a server started with --admin-api-key takes "
                             "only the admin key there. Requests are stopped by closing their connection instead (SGLang "
                             "notices within its ~4 s disconnect poll)", self.base_url, response.status_code,
                             error_message(response))
        return False

    async def server_info(self) -> dict[str, Any]:
        """/server_info, or /get_server_info (older servers, routers) when the first is not there."""
        try:
            info = await self._with_retries("GET", "/server_info")
        except WrongEndpoint:
            info = await self._with_retries("GET", "/get_server_info")
        return info if isinstance(info, dict) else {}

    async def get_json(self, path_or_url: str, timeout_s: float = 10.0) -> Any:
        """One GET without retries (a path on this server, or a full URL, e.g. a router's worker); None unless 200 JSON."""
        try:
            response = await self._http.get(path_or_url, timeout=timeout_s)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def healthy(self, path: str = "/health_generate", timeout_s: float = 30.0) -> bool:
        """One health check: True on 200; ServerRefused for a wrong key or URL (waiting will not heal those)."""
        try:
            response = await self._http.get(path, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        if response.status_code == 200:
            return True
        self._raise_refused(response.status_code, error_message(response), path)
        return False

    async def wait_healthy(self, timeout_s: float, alive: Callable[[], None] | None = None, *, path: str = "/health_generate",
                           server: str = "the SGLang server") -> None:
        """Poll `path` (SGLang's /health_generate; vLLM's /health) until it answers 200; ServerOutage after `timeout_s`.

        `alive` is called before every poll: it raises when the server process the caller started
        has died, so a crash at start-up is reported at once, not after the whole timeout.
        """
        deadline = time.monotonic() + timeout_s
        attempt = 0
        last = "no answer yet"
        while True:
            if alive is not None:
                alive()
            try:
                response = await self._http.get(path, timeout=min(60.0, timeout_s))
                if response.status_code == 200:
                    return
                # a wrong key or URL will not heal by waiting
                self._raise_refused(response.status_code, error_message(response), path)
                last = f"HTTP {response.status_code}: {error_message(response)}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerOutage(
                    f"{self.base_url} not healthy after {timeout_s:.0f}s (last: {last}); "
                    f"is {server} running and done loading?"
                )
            await asyncio.sleep(min(self.retry.delay(attempt), max(0.0, deadline - time.monotonic())))
            attempt += 1

    async def _with_retries(self, method: str, path: str, *, body: Callable[[], dict[str, Any]] | None = None,
                            parse: Any = None) -> Any:
        """`body` makes each try's JSON body (a fresh rid per try); its "rid" is aborted when that try times out."""
        started = time.monotonic()
        attempt = 0
        while True:
            kw = {} if body is None else {"json": body()}
            try:
                data = await self._once(method, path, **kw)
                return parse(data) if parse is not None else data
            except ServerUnavailable as exc:
                await self._after_failure(exc, path, kw.get("json", {}).get("rid"))
                elapsed = time.monotonic() - started
                if elapsed >= self.retry.outage_window_s:
                    raise ServerOutage(
                        f"{method} {self.base_url}{path} failing for {elapsed:.0f}s "
                        f"(outage window {self.retry.outage_window_s:.0f}s): {exc}"
                    ) from exc
                await asyncio.sleep(min(self.retry.delay(attempt), self.retry.outage_window_s - elapsed))
                attempt += 1

    async def _after_failure(self, exc: ServerUnavailable, path: str, rid: str | None) -> None:
        if isinstance(exc, InvalidReply):
            self._count_invalid(exc, path)
        if isinstance(exc.__cause__, httpx.TimeoutException) and rid is not None:
            await self.abort(rid)  # do not leave the timed-out request running on the GPUs

    def _count_invalid(self, exc: InvalidReply, path: str) -> None:
        seen = self.invalid_replies.get(exc.kind, 0)
        self.invalid_replies[exc.kind] = seen + 1
        if not seen:  # once per kind: a lying server must not flood the log
            self.log.warning("%s%s sent an %s; not recorded, retried (further ones of this kind are only counted)",
                             self.base_url, path, exc)

    def _raise_refused(self, status: int, message: str, path: str) -> None:
        url = f"{self.base_url}{path}"
        if status in AUTH_STATUS:
            raise AuthError(status, url, message, f"The server refused our credentials: {self.auth_hint}")
        if status in ENDPOINT_STATUS:
            raise WrongEndpoint(status, url, message,
                                "server.url must be the base URL of SGLang's native API (e.g. http://host:30000, no path).")
        if 400 <= status < 500 and status not in PROMPT_STATUS and status not in RETRYABLE_STATUS:
            raise ServerRefused(status, url, message, "This status says the run, not one prompt, is refused.")

    async def _once(self, method: str, path: str, **kw: Any) -> Any:
        try:
            async with self._http.stream(method, path, **kw) as response:
                status, reason = response.status_code, response.reason_phrase
                body = await self._read_capped(response)
        except (httpx.TransportError, httpx.TimeoutException) as exc:
            raise ServerUnavailable(f"{type(exc).__name__}: {exc or 'no detail'}") from exc
        if status == 200:
            try:
                return json.loads(body)
            except ValueError as exc:
                raise InvalidReply("json", f"unparseable 200 body: {body[:200]!r}") from exc
        message = body_message(body, reason)
        if status in RETRYABLE_STATUS or status >= 500:
            raise ServerUnavailable(f"HTTP {status}: {message}")
        self._raise_refused(status, message, path)
        if status == 400 and DUPLICATE_RID in message.lower():
            raise DuplicateRequestId(f"HTTP 400: {message}")
        raise BadRequest(status, message)

    async def _read_capped(self, response: httpx.Response) -> bytes:
        """The body, or InvalidReply once it passes max_reply_bytes (a runaway server cannot fill our memory)."""
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.max_reply_bytes:
                raise InvalidReply("size", f"reply larger than {self.max_reply_bytes:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
