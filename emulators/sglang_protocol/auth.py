"""API keys (``--api-key``, ``--admin-api-key``): who they let in (`Auth`) and the middleware that refuses the rest.

SGLang 0.5.23 srt/utils/auth.py ``decide_request_auth``; 0.4.10 utils.py ``add_api_key_middleware``
(``--api-key`` only). A refusal is 401 ``{"error": "Unauthorized"}``.
"""

from __future__ import annotations

import dataclasses
import secrets
from collections.abc import Callable
from typing import Any

from fastapi.responses import JSONResponse

from emulators.sglang_protocol.versions import V05, SGLangVersion

# entrypoints/http_server.py: the endpoints marked @auth_level(AuthLevel.ADMIN_OPTIONAL) that these servers have.
ADMIN_OPTIONAL_PATHS = frozenset({"/abort_request", "/flush_cache"})


@dataclasses.dataclass(frozen=True)
class Auth:
    """``--api-key`` / ``--admin-api-key`` and who they let in (`decide`)."""

    api_key: str | None = None
    admin_api_key: str | None = None
    version: SGLangVersion = V05

    def __post_init__(self):
        if self.admin_api_key and not self.version.has_admin_api_key:
            raise ValueError(
                "--admin-api-key does not exist in SGLang 0.4.x (only --api-key): drop it or use sglang_version 0.5"
            )

    @property
    def enabled(self) -> bool:
        return bool(self.api_key or self.admin_api_key)

    def decide(self, method: str, path: str, authorization: str | None) -> int | None:
        """None to let the request in, else the refusal's status.

        0.5.23 utils/auth.py `decide_request_auth`: OPTIONS and /health*, /ready*, /metrics* always
        open; an ADMIN_OPTIONAL endpoint takes the admin key when one is set, else the api key, else
        anything; a NORMAL one takes the api key when set, else anything (admin key only: open).
        A bearer token, scheme case-insensitive, compared in constant time. 0.4.10 utils.py
        `add_api_key_middleware`: every path but /health* and /metrics* needs exactly
        ``Bearer <api_key>``.
        """
        if method == "OPTIONS":
            return None
        if self.version.is_04:
            if not self.api_key or path.startswith(("/health", "/metrics")):
                return None
            return None if authorization == f"Bearer {self.api_key}" else 401
        if path.startswith(("/health", "/ready", "/metrics")):
            return None
        key: str | None
        if path in ADMIN_OPTIONAL_PATHS and self.admin_api_key:
            key = self.admin_api_key
        else:
            key = self.api_key
        if not key:
            return None
        return None if _bearer_matches(authorization, key) else 401


def _bearer_matches(authorization: str | None, expected: str) -> bool:
    """utils/auth.py `_check_bearer_token`."""
    if not authorization:
        return False
    parts = authorization.split(" ", 1)
    if len(parts) != 2 or parts[0].lower() != "bearer":
        return False
    return secrets.compare_digest(parts[1], expected)


class AuthMiddleware:
    """ASGI middleware (as utils/auth.py's, so disconnects still reach the app): refuse what `Auth.decide` refuses."""

    def __init__(self, app: Callable, auth: Auth, open_paths: frozenset[str], on_refused: Callable[[], Any] | None):
        self.app, self.auth, self.open_paths, self.on_refused = app, auth, open_paths, on_refused

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and scope.get("path") not in self.open_paths:
            headers = dict(scope.get("headers") or [])
            authorization = headers.get(b"authorization")
            status = self.auth.decide(
                scope["method"], scope["path"], None if authorization is None else authorization.decode("latin-1")
            )
            if status is not None:
                if self.on_refused is not None:
                    self.on_refused()
                body = {"error": "Unauthorized" if status == 401 else "Forbidden"}
                await JSONResponse(body, status_code=status)(scope, receive, send)
                return
        await self.app(scope, receive, send)
