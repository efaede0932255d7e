"""The app: SGLang's endpoints, error bodies and API-key rules over a server's backend (`create_sglang_app`).

A server supplies only what differs through `SGLangBackend`. The routes, as SGLang 0.5.23's
entrypoints/http_server.py registers them: ``POST /generate`` (request.py, results.py),
``POST /abort_request`` (rids.py), ``GET /health``, ``GET /health_generate``, ``GET /server_info`` and
``GET /model_info`` (also under SGLang's older ``/get_*`` names; info.py), ``GET /v1/loads``
(entrypoints/v1_loads.py), ``/flush_cache`` (entrypoints/http_server.py ``flush_cache``: 200 when the
server is idle, else 400; a flush resets the scheduler's metrics). The error bodies of errors.py, the
keys of auth.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractAsyncContextManager
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from emulators.sglang_protocol.auth import Auth, AuthMiddleware
from emulators.sglang_protocol.errors import (
    BadRequest,
    ContractError,
    MalformedRequest,
    ServerError,
    contract_error_body,
    http_error_body,
    value_error_body,
)
from emulators.sglang_protocol.request import parse_abort
from emulators.sglang_protocol.versions import V05, SGLangVersion


class SGLangBackend(Protocol):
    """What a server behind `create_sglang_app` supplies: the model (or its simulation)."""

    async def generate(self, request: Request) -> Any:
        """Serve a /generate request (its body unread); the JSON answer (raise the errors of errors.py)."""

    def abort(self, rid: str, abort_all: bool) -> int:
        """An /abort_request: abort what rids.py `abort_matcher` says; how many sequences."""

    def flush_cache(self) -> bool:
        """/flush_cache: True (and the scheduler metrics reset) when idle, False while requests are in flight."""

    def healthy(self) -> bool:
        """The answer to /health."""

    async def health_generate(self) -> bool:
        """The answer to /health_generate (SGLang runs a 1-token generation)."""

    def server_info(self) -> dict[str, Any]:
        """The /server_info body (info.py `server_info`)."""

    def model_info(self) -> dict[str, Any]:
        """The /model_info body (info.py `model_info`)."""

    def loads(self) -> dict[str, Any]:
        """The /v1/loads body (info.py `loads`)."""


def create_sglang_app(
    backend: SGLangBackend,
    *,
    title: str,
    version: str,
    sglang_version: SGLangVersion = V05,
    auth: Auth | None = None,
    open_paths: Iterable[str] = (),
    on_auth_refused: Callable[[], Any] | None = None,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> FastAPI:
    """A FastAPI app with SGLang's endpoints, error bodies and API-key rules over `backend`.

    `auth`: the keys (`Auth`); `open_paths` are exempt from them (the sim server's admin paths);
    `on_auth_refused` is called for each 401/403.
    """
    app = FastAPI(title=title, version=version, lifespan=lifespan)

    @app.exception_handler(BadRequest)
    async def bad_request(_request: Request, exc: BadRequest):
        return JSONResponse(value_error_body(str(exc)), status_code=400)

    @app.exception_handler(ContractError)
    async def contract(_request: Request, exc: ContractError):
        return JSONResponse(contract_error_body(str(exc)), status_code=400)

    @app.exception_handler(MalformedRequest)
    async def malformed(_request: Request, exc: MalformedRequest):
        return JSONResponse(http_error_body(str(exc), 400), status_code=400)

    @app.exception_handler(ServerError)
    async def server_error(_request: Request, exc: ServerError):
        return JSONResponse(http_error_body(str(exc), exc.status), status_code=exc.status)

    @app.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        return JSONResponse(await backend.generate(request))

    @app.post("/abort_request")
    async def abort_request(request: Request):
        backend.abort(*parse_abort(await request.body()))
        return Response(status_code=200)

    @app.get("/health")
    async def health():
        return Response(status_code=200 if backend.healthy() else 503)

    @app.get("/health_generate")
    async def health_generate():
        return Response(status_code=200 if await backend.health_generate() else 503)

    @app.get("/server_info")
    @app.get("/get_server_info")
    async def get_server_info():
        return JSONResponse(backend.server_info())

    @app.get("/model_info")
    @app.get("/get_model_info")
    async def get_model_info():
        return JSONResponse(backend.model_info())

    @app.get("/v1/loads")
    async def get_loads():
        return JSONResponse(backend.loads())

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        # http_server.py `flush_cache`: 0.5.23 answers a refused flush with FlushCacheReqOutput.message
        # or "Flush cache failed.\n"; 0.4.10 with the success text and 400.
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        if backend.flush_cache():
            return Response(text, status_code=200)
        return Response(text if sglang_version.is_04 else "Flush cache failed.\n", status_code=400)

    if auth is not None and auth.enabled:
        app.add_middleware(AuthMiddleware, auth=auth, open_paths=frozenset(open_paths), on_refused=on_auth_refused)
    return app
