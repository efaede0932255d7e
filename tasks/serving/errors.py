"""What a serving engine's answer means for the request and for the run: one set of errors for every engine.

A status code means what it says, on every endpoint of every engine:
- `BadRequest` (HTTP 400, 413, 422): this request is wrong (e.g. a prompt over the context length);
  never retried, the caller rejects the prompt.
- `ServerRefused` (401/403 `AuthError`, 404/405 `WrongEndpoint`, any other 4xx): the run itself
  is misconfigured (a rotated key, a URL that is not the engine's API, a model name it does not
  serve). Nothing is retried and nothing is rejected: the caller stops and the user fixes the cause.
- `ServerUnavailable`: connect errors, timeouts, 408, 429, 5xx, and replies that fail the reply
  checks (`InvalidReply`: a server that answers 200 with impossible content is faulty, not the
  prompt); retried with backoff until the outage has lasted `RetryPolicy.outage_window_s`, then
  `ServerOutage` is raised so the caller can fail cleanly (resumably) instead of spinning forever.
- `EngineDied`: a server the pipeline launched itself is gone (tasks/serving/watch.py); nothing to wait for.
"""

from __future__ import annotations

from tasks.responses.rejects import says_too_long

RETRYABLE_STATUS = {408, 429}
PROMPT_STATUS = {400, 413, 422}  # the request (prompt) is at fault
AUTH_STATUS = {401, 403}
ENDPOINT_STATUS = {404, 405}


class EngineError(Exception):
    """Base of every error an engine client raises."""


class BadRequest(EngineError):
    """The server refused the request as invalid (e.g. prompt longer than the context)."""

    def __init__(self, status: int, message: str):
        self.status = status
        self.message = message
        super().__init__(f"HTTP {status}: {message}")

    @property
    def too_long(self) -> bool:
        """The prompt exceeds the server's context: a bigger context later may take it."""
        return says_too_long(self.message)


class ServerRefused(EngineError):
    """The server refuses the run itself (credentials, wrong URL): stop, reject nothing, retry nothing."""

    def __init__(self, status: int, url: str, message: str, hint: str):
        self.status = status
        self.url = url
        self.message = message
        super().__init__(f"HTTP {status} from {url}: {message}. {hint} Nothing was rejected: run again once fixed.")


class AuthError(ServerRefused):
    """401/403: the API key is missing, wrong or rotated."""


class WrongEndpoint(ServerRefused):
    """404/405: the URL does not point at the engine's API (or, on vLLM, names a model it does not serve)."""


class ServerUnavailable(EngineError):
    """One attempt failed in a way that may succeed later (connection, timeout, 429, 5xx)."""

    def __init__(self, message: str, status: int | None = None):
        self.status = status  # the HTTP status that said so (None: no answer, or an impossible 200)
        super().__init__(message)


class InvalidReply(ServerUnavailable):
    """A 200 whose content cannot be true (counts, ids, finish reason, size): a server fault, retried."""

    def __init__(self, kind: str, detail: str):
        self.kind = kind  # a short, stable name of the check that failed (for counting)
        super().__init__(f"invalid reply ({kind}): {detail}")


class DuplicateRequestId(ServerUnavailable):
    """SGLang refused the rid as one it still holds (400): not the prompt's fault; sent again with a new rid."""


class ServerOutage(EngineError):
    """The server stayed unavailable for longer than the configured outage window."""


class EngineDied(EngineError):
    """A server the pipeline launched is gone for good: its process exited, or its engine answers 500 and fails its
    health check (vLLM 0.32 after its worker crashed). Nobody restarts it, so waiting out the outage window is
    pointless: the stage stops at once, quoting the server log's last errors."""
