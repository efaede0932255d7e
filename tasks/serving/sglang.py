"""SGLang behind the engine interface: its native API (/generate, /abort_request, /health_generate, /server_info).

Followed in SGLang 0.5.23 (and 0.4.x where they differ, docs/engines.md "SGLang versions"):
- `POST /generate {"input_ids", "sampling_params", "rid"}` answers `output_ids` and `meta_info`
  (prompt_tokens, completion_tokens, finish_reason {type, matched}, spec_verify_ct with a draft).
  An abort is known by its finish reason alone: 0.5.23 answers a request aborted while still
  queued with no prompt_tokens (managers/tokenizer_manager.py `_handle_abort_req`), 0.4.x with
  prompt_tokens 0 and no output_ids; it is never recorded, so nothing else of it is required.
- SGLang refuses a rid it still holds (400 "Duplicate request ID detected", tokenizer_manager.py),
  and it holds a request whose client went away until its ~4 s disconnect poll notices:
  `DuplicateRequestId`, sent again with a new rid. /abort_request aborts every rid that STARTS
  WITH the given one (managers/scheduler.py `abort_request`): our rids have a fixed-width nonce
  first (tasks/serving/client.py `request_id`), so an abort reaches only its own request.
- `/abort_request` answers 404 behind an sglang-router, and a server started with
  --admin-api-key takes only the admin key there (entrypoints/http_server.py ADMIN_OPTIONAL,
  utils/auth.py): `abort` is then False and the caller closes the connection instead.
- `/server_info` (or `/get_server_info` on older servers and routers) holds max_req_input_len,
  context_length and the speculative settings; a router answers with its own shape, and its
  input limit is read from its workers.
"""

from __future__ import annotations

from typing import Any

import httpx

from tasks.serving.client import FINISH_REASONS, Completion, EngineClient, ServerLimits, count, error_message
from tasks.serving.errors import (
    AUTH_STATUS,
    ENDPOINT_STATUS,
    BadRequest,
    DuplicateRequestId,
    InvalidReply,
    WrongEndpoint,
)

LAUNCH_SERVER = "sglang.launch_server"
DUPLICATE_RID = "duplicate request id"  # SGLang's 400 for a rid it still holds (lower case, as matched)
SPECULATIVE_ALGORITHM = "EAGLE3"
KV_CACHE_TOKENS = 65536  # cpu_command's KV cache, in tokens


def cpu_command(
    python: str,
    target: str,
    *,
    context_length: int | None = None,
    max_running: int | None = None,
    trust_remote_code: bool = False,
) -> list[str]:
    """The command that serves `target` with the real SGLang 0.5.23 on a CPU (.venv-sglang, `make sglang`), with
    {host}/{port} to fill.

    - `SGLANG_USE_CPU_ENGINE=1`: SGLang's CPU platform is opt-in (sglang/srt/platforms/__init__.py); `--device
      cpu` alone is not enough.
    - `OMP_NUM_THREADS=1`: without AMX, SGLang binds no OpenMP threads of its own (srt/distributed/bootstrap.py
      `_init_cpu_threads_env` runs only with AMX or on arm64), so torch takes one spin-waiting thread per core, and
      every op of a decode step waits for all of them. Measured here on the tiny target (2 cores, 16 requests of 96
      tokens, 8 at once): 408 tok/s with the default threads, 4.5 tok/s with the default threads and one other
      busy process (CI's second test worker), 744 and 653 tok/s with one thread. A tiny target gains nothing from
      a second thread. (vLLM's CPU build binds its own: tasks/serving/vllm.py.)
    - `TORCH_COMPILE_DISABLE=1`: SGLang compiles some helpers with `torch.compile` whatever the device (the MoE
      top-k of a DeepSeek-style model: srt/layers/moe/topk.py `@torch.compile(dynamic=True)`), which on a CPU
      means inductor writing and compiling C++ before the server is healthy, at every start that finds no
      inductor cache, and loading the compiled kernels at the others. Eager they give the same tokens.
      Measured here on the Kimi test target (2 cores, nothing else running): healthy after 44 s and 46 CPU-s
      with an empty inductor cache, 30 s with a warm one, 22 s eager; the tiny Llama target compiles nothing
      (22 s either way).
    - `--attention-backend intel_amx`: SGLang's CPU attention backend, the only one its EAGLE-3 worker runs on
      a CPU (speculative/draft_utils.py), so the server with a draft and the one without attend the same way.
      Its two kernel ops, like the speculative-decoding and KV-cache ops, are our torch versions in
      .venv-sglang's stand-in sgl_kernel, and a plugin there keeps the backend on a CPU without AMX
      (deploy/sglang-cpu/, each file says why).
    - `--skip-tokenizer-init`: the pipeline sends and reads token ids only, as it does against a GPU server.
    - `--mem-fraction-static 0.5` with `--max-total-tokens` (KV_CACHE_TOKENS, or the context length when that is
      larger): on CPU SGLang sizes the KV cache from the machine's free memory before and after loading the
      weights (mem_cache/kv_cache_configurator.py `_profile_available_bytes`) and refuses to start when the free
      memory fell by more than 1 - the fraction meanwhile. At 0.05 a server started while other processes grew
      by 5% exited ("Loaded weights leave no GPU memory for the KV cache", a CI run); at 0.5 it takes half the
      free memory shrinking, and the token cap keeps the cache itself small (65536 tokens of the tiny target are
      256 MB).
    - `--sleep-on-idle`: without it the idle scheduler spins (about 65% of a core).
    - float32: the dtype HF transformers computes the references in, so greedy outputs can be compared.
    - `--context-length N` (when given; else the model's max_position_embeddings).
    - `--max-running-requests N` (when given): N requests decode at once, the rest queue at the server.
    - `--trust-remote-code` (when asked): a kimi_k25 checkpoint's processor is remote code, which SGLang builds
      even for a text-only server (models/target/tiny_kimi.py).
    A GPU server takes none of these; docs/engines.md has its launch.
    """
    return [
        "env",
        "SGLANG_USE_CPU_ENGINE=1",
        "OMP_NUM_THREADS=1",
        "TORCH_COMPILE_DISABLE=1",
        python,
        "-m",
        LAUNCH_SERVER,
        "--model-path",
        target,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--device",
        "cpu",
        "--skip-tokenizer-init",
        "--attention-backend",
        "intel_amx",
        "--dtype",
        "float32",
        "--mem-fraction-static",
        "0.5",
        "--max-total-tokens",
        str(max(KV_CACHE_TOKENS, context_length or 0)),
        "--sleep-on-idle",
        *(["--context-length", str(context_length)] if context_length else []),
        *(["--max-running-requests", str(max_running)] if max_running else []),
        *(["--trust-remote-code"] if trust_remote_code else []),
    ]


def parse_generate(body: Any) -> Completion:
    """One element of a /generate response; InvalidReply if it lacks SGLang's fields or types (module docstring)."""
    if isinstance(body, list) and len(body) == 1:  # a server may wrap a single request in a list
        body = body[0]
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
    where = "meta_info."
    return Completion(
        rid=str(meta.get("id", "")),
        text=text,
        output_ids=output_ids,
        prompt_tokens=count(meta, "prompt_tokens", required=not aborted, where=where),
        completion_tokens=count(meta, "completion_tokens", required=not aborted, default=len(output_ids), where=where),
        cached_tokens=count(meta, "cached_tokens", where=where),
        reasoning_tokens=count(meta, "reasoning_tokens", where=where),
        e2e_latency=_seconds(meta.get("e2e_latency")),
        finish_reason=finish["type"],
        finish_detail=dict(finish),
        spec_verify_ct=None if meta.get("spec_verify_ct") is None else count(meta, "spec_verify_ct", where=where),
    )


def _seconds(value: Any) -> float:
    if value is None:
        return 0.0
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidReply("e2e_latency", f"meta_info.e2e_latency must be a number, got {value!r}")
    return float(value)


def context_length(info: dict[str, Any]) -> int | None:
    """The context a /server_info says the server has (context_length, else max_req_len + 1);
    None if it does not say."""
    for key, extra in (("context_length", 0), ("max_req_len", 1)):
        value = info.get(key)
        if type(value) is int and value > 0:
            return value + extra
    return None


def speculative_settings(info: dict[str, Any]) -> dict[str, Any]:
    """The draft a /server_info reports, in ServerLimits.speculative's names ({} without one)."""
    if not info.get("speculative_algorithm"):
        return {}
    return {
        "algorithm": info.get("speculative_algorithm"),
        "num_steps": info.get("speculative_num_steps"),
        "topk": info.get("speculative_eagle_topk"),
        "draft_tokens": info.get("speculative_num_draft_tokens"),
        "path": info.get("speculative_draft_model_path"),
    }


class SGLangClient(EngineClient):
    """One SGLang server (or router) behind the engine interface (module docstring)."""

    name = "SGLang"
    generate_path = "/generate"
    health_path = "/health_generate"
    url_hint = "server.url must be the base URL of SGLang's native API (e.g. http://host:30000, no path)."

    def request(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        return {"input_ids": input_ids, "sampling_params": sampling_params, "rid": rid}

    def parse(self, data: Any) -> Completion:
        return parse_generate(data)

    def _bad_request(self, status: int, message: str) -> Exception:
        if status == 400 and DUPLICATE_RID in message.lower():
            return DuplicateRequestId(f"HTTP 400: {message}")
        return BadRequest(status, message)

    async def abort(self, rid: str) -> bool:
        """Ask the server to stop `rid`; its pending /generate then returns finish_reason abort.

        False when the server will not abort for us, and the caller closes the request's connection
        instead (SGLang aborts a request whose client went away, after its disconnect poll):
        - 404/405: no /abort_request (an SGLang router answers so);
        - 401/403: our key does not open it (--admin-api-key).
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
            self.log.info(
                "%s has no /abort_request (HTTP %d; an SGLang router?): requests are stopped by closing their "
                "connection",
                self.base_url,
                response.status_code,
            )
        else:
            self.log.warning(
                "%s/abort_request refused our key (HTTP %d: %s): a server started with --admin-api-key takes "
                "only the admin key there. Requests are stopped by closing their connection instead (SGLang "
                "notices within its ~4 s disconnect poll)",
                self.base_url,
                response.status_code,
                error_message(response),
            )
        return False

    async def server_info(self) -> dict[str, Any]:
        """/server_info, or /get_server_info (older servers, routers) when the first is not there."""
        try:
            info = await self._with_retries("GET", "/server_info")
        except WrongEndpoint:
            info = await self._with_retries("GET", "/get_server_info")
        return info if isinstance(info, dict) else {}

    async def limits(self) -> ServerLimits:
        info = await self.server_info()
        limit = info.get("max_req_input_len")
        router = False
        if type(limit) is int and limit > 0:
            max_input: int | None = limit
        elif info.get("router_manager") or "workers_count" in info:
            router = True
            max_input = await self._workers_limit()
        else:
            max_input = None
        self.server_limits = ServerLimits(
            max_input=max_input,
            context_length=context_length(info),
            router=router,
            speculative=speculative_settings(info),
            info=info,
        )
        return self.server_limits

    async def _workers_limit(self) -> int | None:
        """A router's input limit: the smallest of its workers' (any worker may get the prompt); None if unknown."""
        body = await self.get_json("/workers")
        listed = body.get("workers", []) if isinstance(body, dict) else []
        workers = [w["url"] for w in listed if isinstance(w, dict) and isinstance(w.get("url"), str)]
        limits = []
        for url in workers:
            for path in ("/server_info", "/get_server_info"):
                info = await self.get_json(url.rstrip("/") + path)
                if isinstance(info, dict):
                    value = info.get("max_req_input_len")
                    if type(value) is int and value > 0:
                        limits.append(value)
                    break
        if workers:
            self.log.info(
                "%s is an SGLang router over %d worker(s)%s",
                self.base_url,
                len(workers),
                f"; input limit {min(limits)} (the smallest of theirs)" if limits else "",
            )
        return min(limits) if limits else None

    @staticmethod
    def speculative_args(draft_dir: str, num_steps: int) -> list[str]:
        """SGLang's flags that serve `draft_dir` as an EAGLE-3 chain draft of `num_steps` tokens per round
        (REFERENCE)."""
        return [
            "--speculative-algorithm",
            SPECULATIVE_ALGORITHM,
            "--speculative-draft-model-path",
            str(draft_dir),
            "--speculative-num-steps",
            str(num_steps),
            "--speculative-eagle-topk",
            "1",
            "--speculative-num-draft-tokens",
            str(num_steps + 1),
        ]

    def check_draft(self, limits: ServerLimits, num_steps: int) -> None:
        spec = limits.speculative
        algorithm = spec.get("algorithm")
        if algorithm != SPECULATIVE_ALGORITHM:
            raise ValueError(
                f"{self.base_url} serves no EAGLE-3 draft (server_info speculative_algorithm={algorithm!r}): start "
                f"it with {' '.join(self.speculative_args('DRAFT_DIR', num_steps))}, or let the eval start it "
                "(server.launch: dev|command)"
            )
        steps, topk = spec.get("num_steps"), spec.get("topk")
        if steps is not None and steps != num_steps:
            raise ValueError(
                f"{self.base_url} drafts {steps} tokens per round (--speculative-num-steps) but eval.num_steps is "
                f"{num_steps}: set one to the other"
            )
        if topk not in (None, 1):
            raise ValueError(
                f"{self.base_url} drafts a tree (--speculative-eagle-topk {topk}); the eval measures chain "
                "drafting: topk 1"
            )
