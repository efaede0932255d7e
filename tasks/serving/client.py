"""The part of talking to a serving engine that every engine shares: retries, status rules, health, reply checks.

An engine module (tasks/serving/sglang.py, tasks/serving/vllm.py) subclasses `EngineClient` with
what differs: the request it sends for token ids (`request`), how it reads the reply (`parse`),
how it stops a request (`abort`), what it says of its limits and its draft (`limits`), its health
path and its speculative-decoding launch flags. Everything else -- the statuses
(tasks/serving/errors.py), the retries, the size cap, the checks a reply must pass before anyone
records it -- is here, once.

Only token ids go over the wire: prompts are rendered with the target's chat template on our side
and the server applies none, so the training text is exactly what the target generated.

Request ids: every send carries a fresh one (`request_id`): a unique fixed-width nonce, then the
caller's label. SGLang refuses a rid it still holds and aborts by prefix (tasks/serving/sglang.py);
vLLM shows it in its logs. The prompt's identity lives in our records, never in the engine's id.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx

from settings.server import ServerSettings
from tasks.serving.errors import (
    AUTH_STATUS,
    ENDPOINT_STATUS,
    PROMPT_STATUS,
    RETRYABLE_STATUS,
    AuthError,
    BadRequest,
    InvalidReply,
    ServerOutage,
    ServerRefused,
    ServerUnavailable,
    WrongEndpoint,
)

if TYPE_CHECKING:  # typing.Self is Python 3.11+; only the checker reads this import
    from typing_extensions import Self

FINISH_REASONS = ("stop", "length", "abort")
RID_NONCE_HEX = 24  # 96 random bits: fixed width, so no rid we send is a prefix of another
MAX_REPLY_BYTES = 64 * 2**20  # a reply of 16k tokens is ~0.2 MiB; more is a faulty server

log = logging.getLogger("eagle3.engine")


def request_id(label: str) -> str:
    """A fresh request id for one send of `label` (e.g. "B1_glaive:123"): a unique nonce, then the label.

    The nonce has a fixed width, so two ids share a prefix of that width only if they are the same
    id: SGLang's prefix-matching /abort_request then stops exactly the request it names.
    """
    return f"{secrets.token_hex(RID_NONCE_HEX // 2)}-{label}"


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
    """One finished answer for one prompt of token ids, whichever engine sent it."""

    rid: str
    text: str
    output_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    reasoning_tokens: int
    e2e_latency: float
    finish_reason: str  # "stop" | "length" | "abort"
    finish_detail: dict[str, Any] = field(default_factory=dict)  # "matched": the stop id that ended it, when one did
    spec_verify_ct: int | None = None  # verify rounds, from a server that decodes with a draft; None without one
    # the draft tokens each verify round accepted, in order (vLLM's per_step_accepted); None from a server without them
    spec_accepted: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ServerLimits:
    """What a server says of itself: its input limit, context, served model and draft."""

    max_input: int | None = None  # the longest prompt + 1 it takes (SGLang's max_req_input_len)
    context_length: int | None = None  # prompt + new tokens
    model: str | None = None  # the served model name (vLLM's /v1/models id; requests must name it)
    router: bool = False  # an SGLang router in front of workers
    speculative: dict[str, Any] = field(
        default_factory=dict
    )  # its draft: algorithm, num_steps, topk, draft_tokens, path
    info: dict[str, Any] = field(default_factory=dict)  # the raw answer it was read from

    @property
    def reserved_tokens(self) -> int:
        """Context a server reserves per request for its EAGLE draft: max(topk * num_steps, draft_tokens); 0 without.

        SGLang's rule (managers/utils.py `compute_num_reserved_tokens`); vLLM reports no draft, so 0 there.
        """
        spec = self.speculative
        if not str(spec.get("algorithm") or "").upper().startswith("EAGLE"):
            return 0
        topk, steps = spec.get("topk") or 1, spec.get("num_steps") or 0
        return max(int(topk) * int(steps), int(spec.get("draft_tokens") or 0))


def check_reply(done: Completion, input_ids: list[int], max_new_tokens: Any, vocab_size: int | None) -> None:
    """InvalidReply unless the answer is possible for what was sent (the checks a recorded reply passed).

    prompt_tokens == the ids sent, completion_tokens == len(output_ids) >= 1, at most max_new_tokens,
    verify rounds <= tokens, ids inside the vocabulary, the matched stop id at the end.
    """
    if done.finish_reason == "abort":
        # Never recorded: its partial counts only feed the budget's waste. Checked before prompt_tokens,
        # which a queued abort need not carry.
        return
    if done.prompt_tokens != len(input_ids):
        raise InvalidReply("prompt_tokens", f"prompt_tokens {done.prompt_tokens} for a prompt of {len(input_ids)} ids")
    n = len(done.output_ids)
    if done.completion_tokens != n:
        raise InvalidReply("completion_tokens", f"completion_tokens {done.completion_tokens} with {n} output_ids")
    if n < 1:
        raise InvalidReply("empty", f"finish_reason {done.finish_reason} with no output_ids")
    if isinstance(max_new_tokens, int) and n > max_new_tokens:
        raise InvalidReply("too_many_tokens", f"{n} output_ids but max_new_tokens is {max_new_tokens}")
    if done.spec_verify_ct is not None and done.spec_verify_ct > n:
        raise InvalidReply("spec_verify_ct", f"spec_verify_ct {done.spec_verify_ct} verify rounds for {n} output_ids")
    if vocab_size is not None and max(done.output_ids) >= vocab_size:
        raise InvalidReply("token_id", f"output id {max(done.output_ids)} is outside the vocabulary of {vocab_size}")
    matched = done.finish_detail.get("matched")
    if done.finish_reason == "stop" and type(matched) is int and done.output_ids[-1] != matched:
        # the stop id is kept (SGLang: no_stop_trim; vLLM keeps it in token_ids): it must be the last output id
        raise InvalidReply(
            "stop_token", f"finish matched stop id {matched} but the last output id is {done.output_ids[-1]}"
        )


def count(values: dict[str, Any], key: str, *, required: bool = False, default: int = 0, where: str = "") -> int:
    """A non-negative int field of a reply; InvalidReply when it is not one (or missing and required)."""
    value = values.get(key)
    if value is None and not required:
        return default
    if type(value) is not int or value < 0:
        raise InvalidReply(key, f"{where}{key} must be a non-negative int, got {value!r}")
    return value


def auth_hint(server: ServerSettings) -> str:
    """What to check when a server refuses our credentials, naming the setting that holds the key (never the key)."""
    if server.api_key_env:
        return f"check that ${server.api_key_env} (server.api_key_env) holds the server's current --api-key"
    return "the server wants an API key: set server.api_key_env to the name of the variable that holds it"


def error_message(response: httpx.Response) -> str:
    """The message of an engine's error response (any of its body shapes), else the raw text."""
    return body_message(response.content, response.reason_phrase)


def body_message(content: bytes, reason_phrase: str = "") -> str:
    """The message of an error body, else its raw text (or the reason phrase when empty).

    The shapes: `{"error": {"message": ...}}` (vLLM 0.32's ErrorResponse; SGLang 0.5.23's ValueError,
    srt/server/utils.py `create_error_response`), `{"object": "error", "message": ...}` (SGLang's
    validation and HTTP errors), `{"error": "<string>"}` (SGLang's /generate contract gate and its
    API-key middleware), `{"detail": ...}` (FastAPI's own HTTPException).
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


class EngineClient:
    """One connection pool to one server of a serving engine. Use as an async context manager.

    The generate stage reaches servers through tasks.serving.pool (which calls `attempt` and fails
    over between servers); `generate` retries at this one server and suits a lone caller (the eval).

    `auth_hint` finishes the message of an AuthError (e.g. which setting holds the key);
    `vocab_size` lets replies be checked against the target's vocabulary; `logger` gets one
    warning per kind of invalid reply (then they are only counted, in `invalid_replies`);
    `on_failure(client, exc)` is awaited after each failed try of `generate` and may raise to end the retries (a
    server the caller launched and knows to be dead: tasks/serving/watch.py).
    """

    name = "the engine"  # in messages: "SGLang", "vLLM"
    generate_path = "/generate"  # where `request` sends
    health_path = "/health"
    url_hint = "the URL must be the base URL of the engine's API (e.g. http://host:port, no path)."

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
        on_failure: Callable[[EngineClient, ServerUnavailable], Awaitable[None]] | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.on_failure = on_failure
        self.retry = retry or RetryPolicy()
        self.auth_hint = auth_hint
        self.vocab_size = vocab_size
        self.max_reply_bytes = max_reply_bytes
        self.log = logger
        self.invalid_replies: dict[str, int] = {}  # kind -> count
        self.can_abort = True  # False once the server will not abort for us: requests are then stopped by closing them
        self.server_limits: ServerLimits | None = None  # the last `limits()` read
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.AsyncClient(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(request_timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=max_connections),
            transport=transport,
        )

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    # --- what each engine defines -------------------------------------------------------------

    def request(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        """The JSON body, sent to `generate_path`, that generates for `input_ids` (sampling_params in the pipeline's
        SGLang form, tasks/generate/prompts.py)."""
        raise NotImplementedError

    def parse(self, data: Any) -> Completion:
        """The Completion in a 200 reply; InvalidReply when it lacks the engine's fields or types."""
        raise NotImplementedError

    async def abort(self, rid: str) -> bool:
        """Stop `rid` at the server; False when the server will not, and the caller closes the request instead."""
        raise NotImplementedError

    async def limits(self) -> ServerLimits:
        """What the server says of its limits and its draft (also kept in `server_limits`)."""
        raise NotImplementedError

    @staticmethod
    def speculative_args(draft_dir: str, num_steps: int) -> list[str]:
        """The launch flags that serve `draft_dir` as an EAGLE-3 chain draft of `num_steps` tokens per round."""
        raise NotImplementedError

    def check_draft(self, limits: ServerLimits, num_steps: int) -> None:
        """ValueError unless the server serves an EAGLE-3 chain draft of num_steps tokens (as far as it says)."""
        raise NotImplementedError

    def precheck(self, input_ids: list[int], sampling_params: dict[str, Any]) -> None:
        """Raise, without sending, for a request the server would refuse whatever the prompt (engine-specific: vLLM's
        max_tokens above max_model_len is ServerRefused); nothing by default."""

    # --- shared -------------------------------------------------------------------------------

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], label: str) -> Completion:
        """Generate for one prompt of token ids, retrying what can succeed on retry; the reply is checked.

        Every try is sent with a fresh request id (`request_id(label)`): a retry must not meet the id of
        its own earlier try, which the server may still hold.
        """
        self.precheck(input_ids, sampling_params)
        parse = self._completion_parser(input_ids, sampling_params, self.vocab_size)

        def body() -> dict[str, Any]:
            return self.request(input_ids, sampling_params, request_id(label))

        return await self._with_retries("POST", self.generate_path, body=body, parse=parse)

    async def attempt(
        self, input_ids: list[int], sampling_params: dict[str, Any], rid: str, *, vocab_size: int | None = None
    ) -> Completion:
        """One attempt with `rid` (fresh for this send: `request_id`), no retry (a server pool retries elsewhere):
        ServerUnavailable when it may succeed later.

        An invalid reply is counted (and logged once per kind); a timed-out request is aborted here.
        """
        self.precheck(input_ids, sampling_params)
        path, body = self.generate_path, self.request(input_ids, sampling_params, rid)
        parse = self._completion_parser(
            input_ids, sampling_params, vocab_size if vocab_size is not None else self.vocab_size
        )
        try:
            return parse(await self._once("POST", path, json=body))
        except ServerUnavailable as exc:
            await self._after_failure(exc, path, rid)
            raise

    def _completion_parser(
        self, input_ids: list[int], sampling_params: dict[str, Any], vocab_size: int | None
    ) -> Callable[[Any], Completion]:
        def parse(data: Any) -> Completion:
            done = self.parse(data)
            check_reply(done, input_ids, sampling_params.get("max_new_tokens"), vocab_size)
            return done

        return parse

    async def get_json(self, path_or_url: str, timeout_s: float = 10.0) -> Any:
        """One GET without retries (a path on this server, or a full URL, e.g. a router's worker);
        None unless 200 JSON."""
        try:
            response = await self._http.get(path_or_url, timeout=timeout_s)
            return response.json() if response.status_code == 200 else None
        except (httpx.HTTPError, ValueError):
            return None

    async def healthy(self, timeout_s: float = 30.0) -> bool:
        """One health check at `health_path`: True on 200; ServerRefused for a wrong key or URL
        (waiting will not heal)."""
        try:
            response = await self._http.get(self.health_path, timeout=timeout_s)
        except httpx.HTTPError:
            return False
        if response.status_code == 200:
            return True
        self._raise_refused(response.status_code, error_message(response), self.health_path)
        return False

    async def wait_healthy(self, timeout_s: float, alive: Callable[[], None] | None = None) -> None:
        """Poll `health_path` until it answers 200; ServerOutage after `timeout_s`.

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
                response = await self._http.get(self.health_path, timeout=min(60.0, timeout_s))
                if response.status_code == 200:
                    return
                # a wrong key or URL will not heal by waiting
                self._raise_refused(response.status_code, error_message(response), self.health_path)
                last = f"HTTP {response.status_code}: {error_message(response)}"
            except httpx.HTTPError as exc:
                last = f"{type(exc).__name__}: {exc}"
            if time.monotonic() >= deadline:
                raise ServerOutage(
                    f"{self.base_url}{self.health_path} not healthy after {timeout_s:.0f}s (last: {last}); "
                    f"is {self.name} running and done loading?"
                )
            await asyncio.sleep(min(self.retry.delay(attempt), max(0.0, deadline - time.monotonic())))
            attempt += 1

    async def _with_retries(
        self, method: str, path: str, *, body: Callable[[], dict[str, Any]] | None = None, parse: Any = None
    ) -> Any:
        """`body` makes each try's JSON body (a fresh request id per try); that id is aborted when the try times out."""
        started = time.monotonic()
        attempt = 0
        while True:
            kw = {} if body is None else {"json": body()}
            try:
                data = await self._once(method, path, **kw)
                return parse(data) if parse is not None else data
            except ServerUnavailable as exc:
                await self._after_failure(exc, path, self._rid_of(kw.get("json")))
                if self.on_failure is not None:
                    await self.on_failure(self, exc)
                elapsed = time.monotonic() - started
                if elapsed >= self.retry.outage_window_s:
                    raise ServerOutage(
                        f"{method} {self.base_url}{path} failing for {elapsed:.0f}s "
                        f"(outage window {self.retry.outage_window_s:.0f}s): {exc}"
                    ) from exc
                await asyncio.sleep(min(self.retry.delay(attempt), self.retry.outage_window_s - elapsed))
                attempt += 1

    @staticmethod
    def _rid_of(body: dict[str, Any] | None) -> str | None:
        if not body:
            return None
        return body.get("rid") or body.get("request_id")

    async def _after_failure(self, exc: ServerUnavailable, path: str, rid: str | None) -> None:
        if isinstance(exc, InvalidReply):
            self._count_invalid(exc, path)
        if isinstance(exc.__cause__, httpx.TimeoutException) and rid is not None:
            await self.abort(rid)  # do not leave the timed-out request running on the GPUs

    def _count_invalid(self, exc: InvalidReply, path: str) -> None:
        seen = self.invalid_replies.get(exc.kind, 0)
        self.invalid_replies[exc.kind] = seen + 1
        if not seen:  # once per kind: a lying server must not flood the log
            self.log.warning(
                "%s%s sent an %s; not recorded, retried (further ones of this kind are only counted)",
                self.base_url,
                path,
                exc,
            )

    def _raise_refused(self, status: int, message: str, path: str) -> None:
        url = f"{self.base_url}{path}"
        if status in AUTH_STATUS:
            raise AuthError(status, url, message, f"The server refused our credentials: {self.auth_hint}")
        if status in ENDPOINT_STATUS:
            raise WrongEndpoint(status, url, message, self.url_hint)
        if 400 <= status < 500 and status not in PROMPT_STATUS and status not in RETRYABLE_STATUS:
            raise ServerRefused(status, url, message, "This status says the run, not one prompt, is refused.")

    def _bad_request(self, status: int, message: str) -> Exception:
        """The error of a 400/413/422 (an engine may name some of them otherwise: SGLang's duplicate rid)."""
        return BadRequest(status, message)

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
            raise ServerUnavailable(f"HTTP {status}: {message}", status)
        self._raise_refused(status, message, path)
        raise self._bad_request(status, message)

    async def _read_capped(self, response: httpx.Response) -> bytes:
        """The body, or InvalidReply once it passes max_reply_bytes (a runaway server cannot fill our memory)."""
        chunks, size = [], 0
        async for chunk in response.aiter_bytes():
            size += len(chunk)
            if size > self.max_reply_bytes:
                raise InvalidReply("size", f"reply larger than {self.max_reply_bytes:,} bytes")
            chunks.append(chunk)
        return b"".join(chunks)
