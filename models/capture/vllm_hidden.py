"""Hidden states extracted by a vLLM server, turned into the capture's shard rows (capture.backend: vllm).

vLLM (>= 0.17) extracts hidden states with the speculative method `extract_hidden_states` and a KV connector that
writes what the extraction cached. The capture starts vLLM with ours, `Eagle3HiddenStatesConnector`
(deploy/vllm-plugins/eagle3_hidden_states.py, loaded through `kv_connector_module_path`: it runs on CPU and GPU),
which writes the file vLLM's own `ExampleHiddenStatesConnector` (vllm/distributed/kv_transfer/kv_connector/v1/
example_hidden_states_connector.py, CUDA only) writes, so either one's files are read here. Per request:
`{shared_storage_path}/{request_id}.safetensors`:

    token_ids      int64        [n]            the prompt's ids
    hidden_states  model dtype  [n, k, H]      one slice per id in eagle_aux_hidden_state_layer_ids

Its layer ids are capture indices, not layer numbers: id i is the residual stream entering decoder
layer i (`hidden_states + residual`), i.e. the output of 0-based layer i-1, and an id equal to
num_hidden_layers is the last layer's output BEFORE the final norm. So the capture asks for
`[a+1, b+1, c+1, L]` for its aux layers [a, b, c] (`engine_layer_ids`) and applies the final norm
itself (`FinalNorm`, the weight read from the checkpoint like lm_head is), which gives the shard's
`last_hidden` = HF `hidden_states[-1]`, what the DeepSpeed path stores.

Newer connectors write the file after the reply, holding an exclusive flock on `{path}.lock` until
it is complete (`load_hidden_states` takes a shared one); `wait_for_file` waits for that lock.
"""

from __future__ import annotations

import fcntl
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)

LOCK_SUFFIX = ".lock"
LOCK_POLL_S = 0.01
CONNECTOR = "Eagle3HiddenStatesConnector"
CONNECTOR_MODULE = "eagle3_hidden_states"
# the directory vLLM must have on its PYTHONPATH to load the connector (the repository's deploy/vllm-plugins)
CONNECTOR_DIR = Path(__file__).resolve().parents[2] / "deploy" / "vllm-plugins"


class ExtractionFailed(ValueError):
    """A reply whose hidden-state file cannot be used: the server or its extraction config is wrong, not the record.

    Never retried (the same server answers the same way) and nothing of the record is recorded.
    """

    def __init__(self, path: str | Path, problem: str, advice: str):
        self.path, self.problem, self.advice = str(path), problem, advice
        super().__init__(f"{path}: {problem}. {advice}")

    def __reduce__(self):  # Prefect pickles task exceptions into results
        return (ExtractionFailed, (self.path, self.problem, self.advice))


def engine_layer_ids(aux_layers: list[int], num_layers: int) -> list[int]:
    """vLLM's eagle_aux_hidden_state_layer_ids for the capture: the aux layers' outputs, then the last layer's."""
    return [k + 1 for k in aux_layers] + [num_layers]


def extraction_config(
    aux_layers: list[int], num_layers: int, shared_dir: str | Path
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(speculative_config, kv_transfer_config): what `vllm serve` must be started with for this capture."""
    speculative = {
        "method": "extract_hidden_states",
        "num_speculative_tokens": 1,
        "draft_model_config": {
            "hf_config": {"eagle_aux_hidden_state_layer_ids": engine_layer_ids(aux_layers, num_layers)}
        },
    }
    kv_transfer = {
        "kv_connector": CONNECTOR,
        "kv_connector_module_path": CONNECTOR_MODULE,
        "kv_role": "kv_producer",
        "kv_connector_extra_config": {"shared_storage_path": str(shared_dir)},
    }
    return speculative, kv_transfer


def connector_env(environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment vLLM needs to import the connector: PYTHONPATH with CONNECTOR_DIR first."""
    rest = (environ if environ is not None else os.environ).get("PYTHONPATH")
    return {"PYTHONPATH": os.pathsep.join([str(CONNECTOR_DIR), *([rest] if rest else [])])}


def server_flags(aux_layers: list[int], num_layers: int, shared_dir: str | Path) -> list[str]:
    """The `vllm serve` flags of `extraction_config` (chunked prefill off: the feature requires it); vLLM also needs
    `connector_env`'s PYTHONPATH."""
    speculative, kv_transfer = extraction_config(aux_layers, num_layers, shared_dir)
    return [
        "--speculative-config",
        json.dumps(speculative),
        "--kv-transfer-config",
        json.dumps(kv_transfer),
        "--no-enable-chunked-prefill",
    ]


def wait_for_file(path: str | Path, timeout_s: float) -> None:
    """Return once the connector has finished writing `path` (its `.lock` is free, or there is none).

    TimeoutError after `timeout_s`.
    """
    lock = f"{path}{LOCK_SUFFIX}"
    try:
        fd = os.open(lock, os.O_RDONLY)
    except FileNotFoundError:
        return  # an older connector (written before the reply) or a lock already removed
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"{path}: still being written after {timeout_s:.0f}s ({lock} held)") from None
                time.sleep(LOCK_POLL_S)  # the writer thread releases it when the file is complete
    finally:
        os.close(fd)


def read_connector_file(path: str | Path, token_ids: list[int], num_ids: int, hidden_size: int) -> torch.Tensor:
    """The [n, num_ids, H] hidden states in a request's file, checked against what was sent; else ExtractionFailed."""
    path = Path(path)
    layers = f"start vLLM with the extraction config this capture logs ({num_ids} layer ids)"
    try:
        data = load_file(str(path))
    except FileNotFoundError:
        raise ExtractionFailed(
            path,
            "the server names this file but it does not exist here",
            "Either the server could not write it (a full shared_dir? its log names the file: our connector logs "
            "each failed write) or capture.engine.shared_dir is not this machine's view of the server's "
            "shared_storage_path",
        ) from None
    except (SafetensorError, OSError) as e:
        try:
            size = f"{path.stat().st_size:,} bytes"
        except OSError:
            size = "size unknown"
        raise ExtractionFailed(
            path,
            f"{size}, not a complete safetensors file ({e})",
            "The server wrote it incompletely (a full shared_dir?); nothing of this record was recorded",
        ) from None
    missing = {"token_ids", "hidden_states"} - set(data)
    if missing:
        raise ExtractionFailed(
            path,
            f"no {', '.join(sorted(missing))} tensor (has {sorted(data)})",
            f"The server does not run {CONNECTOR} (or vLLM's ExampleHiddenStatesConnector)",
        )
    ids, hidden = data["token_ids"], data["hidden_states"]
    if ids.ndim != 1 or ids.tolist() != list(token_ids):
        shown = ids.tolist()[:8] if ids.ndim == 1 else list(ids.shape)
        raise ExtractionFailed(
            path,
            f"token_ids {shown}... (n={ids.numel()}) are not the {len(token_ids)} ids sent",
            "The file belongs to another request, or the server rewrote the prompt",
        )
    want = (len(token_ids), num_ids, hidden_size)
    if tuple(hidden.shape) != want or not hidden.is_floating_point():
        raise ExtractionFailed(
            path,
            f"hidden_states {list(hidden.shape)} {hidden.dtype}, expected {list(want)} floats "
            "(tokens, layer ids, hidden size)",
            layers,
        )
    return hidden


@dataclass(frozen=True)
class FinalNorm:
    """The target's final RMSNorm (Llama / DeepSeek-V3 form), applied as HF applies it.

    The math in float32, the weight times the input dtype.
    """

    weight: torch.Tensor  # [H]
    eps: float

    @classmethod
    def load(cls, target_path: str | Path) -> FinalNorm:
        """The checkpoint's weight (models/target/weights.py), eps from config.json (multimodal: its text config)."""
        from models.target.weights import checkpoint_dir, load_final_norm

        config = json.loads((checkpoint_dir(target_path) / "config.json").read_text())
        text = config.get("text_config") or config
        eps = text.get("rms_norm_eps")
        if not isinstance(eps, (int, float)):
            raise ValueError(f"{target_path}: config.json has no rms_norm_eps; the final norm cannot be applied")
        return cls(load_final_norm(target_path), float(eps))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)  # [n, H]
        return self.weight.to(dtype) * x.to(dtype)


def sample_rows(hidden: torch.Tensor, norm: FinalNorm, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(aux [n, 3H], last [n, H]) in `dtype` of a file's [n, 4, H]: 3 aux outputs in layer order, the last normed."""
    n, k, h = hidden.shape
    aux = hidden[:, : k - 1, :].reshape(n, (k - 1) * h)  # [n, 3H] = cat(aux_0, aux_1, aux_2) along the last axis
    last = norm(hidden[:, k - 1, :])  # [n, H], after the final norm
    return aux.to(dtype), last.to(dtype)
