"""The capture's hidden-state connector for vLLM: a KV-connector plugin, loaded by vLLM from this file, nothing patched.

vLLM (0.32.0 here) extracts hidden states with the speculative method `extract_hidden_states`: its dummy draft
(vllm/model_executor/models/extract_hidden_states.py) stores, for every prompt token, the states of the layer ids in
`eagle_aux_hidden_state_layer_ids` in the paged cache of one `CacheOnlyAttentionLayer` (num_heads = the number of
ids, head_size = hidden size). A KV connector reads them from there when the request ends. vLLM's own
(distributed/kv_transfer/kv_connector/v1/example_hidden_states_connector.py, "a simple debug implementation") needs
CUDA: a copy stream, events and pinned memory. This one is device-agnostic and writes the same file:

    {shared_storage_path}/{request_id}.safetensors
        token_ids      int64         [n]         the prompt's ids
        hidden_states  the KV dtype  [n, k, H]   one slice per layer id, in the ids' order

named in the reply's `kv_transfer_params.hidden_states_path`, so a reader of vLLM's files reads ours
(tasks/capture/vllm_capture.py reads both). What it does as vLLM's does (same file, same methods):
- scheduler side: `build_connector_meta` names the file of each newly scheduled request; `request_finished` keeps
  the request's blocks (returns True) and hands its block ids to the worker as a pending save.
- worker side: `wait_for_save` creates `{file}.lock` and holds LOCK_EX on it before the client can see the path (a
  reader takes LOCK_SH: it sleeps until the file is complete); `get_finished` gathers each pending request's rows
  from the cache (slot = block id * block size + offset) and writes the file on a writer thread, which releases the
  lock when done; the request is reported done sending once its rows are copied out of the cache, so its blocks are
  freed only after that.
- only tensor-parallel rank 0 writes (`get_finished_count` 1).
What differs, and why:
- the copy: on CUDA a copy stream, an event and pinned memory, as vLLM's; on any other device (CPU) the gather
  itself is the copy (advanced indexing makes a new tensor), done before `get_finished` returns.
- the file is written to `{file}.tmp` and renamed: a server killed mid-write leaves no partial file under the
  name a reader opens (vLLM's writes in place, and its lock dies with the process).
- a request whose write failed (a full disk: seen with a 64 KiB tmpfs, "No space left on device") is logged with
  its file and its partial `.tmp` removed; its lock is released, so a reader finds no file and says why it may be.
- no `allow_custom_save_path` (a client cannot choose where the server writes).

Load it with (PYTHONPATH holding this directory):
    --kv-transfer-config '{"kv_connector": "Eagle3HiddenStatesConnector",
                           "kv_connector_module_path": "eagle3_hidden_states", "kv_role": "kv_producer",
                           "kv_connector_extra_config": {"shared_storage_path": DIR}}'
beside `--speculative-config '{"method": "extract_hidden_states", "num_speculative_tokens": 1,
"draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": [...]}}}'` (models/capture/vllm_hidden.py
writes both). This file imports only vLLM, torch and safetensors: it runs in vLLM's environment.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from safetensors.torch import save_file
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    SupportsHMA,
)
from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
from vllm.logger import init_logger

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

logger = init_logger(__name__)
CONNECTOR = "Eagle3HiddenStatesConnector"


@dataclass
class PendingSave:
    req_id: str
    filename: str
    token_ids: torch.Tensor  # int64 [n], on the CPU
    block_ids: list[int]


@dataclass
class Eagle3HiddenStatesMetadata(KVConnectorMetadata):
    pending_saves: list[PendingSave] = field(default_factory=list)
    new_req_filenames: dict[str, str] = field(default_factory=dict)  # req_id -> file, for the worker's locks


def slot_rows(block_ids: list[int], block_size: int, num_tokens: int) -> torch.Tensor:
    """The cache slots of a request's first `num_tokens` tokens: block b's offsets 0..block_size-1, in block order."""
    blocks = torch.tensor(block_ids, dtype=torch.long).reshape(-1, 1)
    offsets = torch.arange(block_size, dtype=torch.long).reshape(1, -1)
    return (blocks * block_size + offsets).flatten()[:num_tokens]


def gather_rows(kv_cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """[n, k, H] of a cache laid out [num_blocks, k, block_size, H] (vLLM's CacheOnlyAttentionLayer, `basic_cache`)."""
    block_size = kv_cache.shape[2]
    slots = slots.to(kv_cache.device)
    return kv_cache[slots // block_size, :, slots % block_size]


def write_file(tensors: dict[str, torch.Tensor], filename: str, ready: Any, lock_fd: int | None) -> None:
    """Writer thread: wait for the copy, write `{filename}.tmp`, rename it into place, release the lock."""
    tmp = f"{filename}.tmp"
    try:
        if ready is not None:
            ready.synchronize()
        save_file(tensors, tmp)
        os.replace(tmp, filename)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a full disk: free what the partial write took
        raise
    finally:
        if lock_fd is not None:
            os.close(lock_fd)  # releases LOCK_EX: a reader sleeping on LOCK_SH wakes


class Eagle3HiddenStatesConnector(KVConnectorBase_V1, SupportsHMA):
    """Writes each finished request's extracted hidden states to one safetensors file (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig | None = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if vllm_config.speculative_config is None or vllm_config.speculative_config.method != "extract_hidden_states":
            raise ValueError(f"{CONNECTOR} needs --speculative-config with method extract_hidden_states")
        self._group = self._hidden_state_group(kv_cache_config)
        self._block_size = (
            vllm_config.cache_config.block_size
            if kv_cache_config is None
            else kv_cache_config.kv_cache_groups[self._group].kv_cache_spec.block_size
        )
        self._storage_path = str(self._kv_transfer_config.get_from_extra_config("shared_storage_path", "/tmp"))
        logger.info("%s writes hidden states to %s", CONNECTOR, self._storage_path)
        # scheduler side
        self._pending_saves: dict[str, PendingSave] = {}
        self._request_filenames: dict[str, str] = {}
        # worker side
        self._kv_cache: torch.Tensor | None = None
        self._is_tp_rank_zero = True
        self._executor = ThreadPoolExecutor(
            max_workers=int(self._kv_transfer_config.get_from_extra_config("num_writer_threads", 4)),
            thread_name_prefix="eagle3-hs-save",
        )
        self._lock_fds: dict[str, int] = {}
        self._copies: dict[str, Any] = {}  # req_id -> CUDA event of its copy; None once copied (any other device)
        self._finished: set[str] = set()
        self._copy_stream: Any = None

    @staticmethod
    def _hidden_state_group(kv_cache_config: KVCacheConfig | None) -> int:
        """The KV cache group holding the hidden states (by its spec type), as vLLM's connector finds it."""
        if kv_cache_config is None:
            return 0
        from vllm.v1.kv_cache_interface import HiddenStateCacheSpec

        groups = kv_cache_config.kv_cache_groups
        found = [i for i, g in enumerate(groups) if isinstance(g.kv_cache_spec, HiddenStateCacheSpec)]
        if len(found) == 1:
            return found[0]
        if not found and len(groups) == 1:
            return 0
        raise ValueError(f"{CONNECTOR}: no single hidden-state KV cache group among {len(groups)} groups")

    def get_finished_count(self) -> int:
        return 1  # only TP rank 0 writes

    # ---- worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.extract_hidden_states import CacheOnlyAttentionLayer

        self._is_tp_rank_zero = get_tensor_model_parallel_rank() == 0
        layers = list(get_layers_from_vllm_config(self._vllm_config, CacheOnlyAttentionLayer, list(kv_caches)))
        if len(layers) != 1:
            raise ValueError(f"{CONNECTOR}: expected one CacheOnlyAttentionLayer, found {layers}")
        self._kv_cache = kv_caches[layers[0]]
        if self._kv_cache.ndim != 4 or self._kv_cache.shape[2] != self._block_size:
            raise ValueError(
                f"{CONNECTOR}: the hidden-state cache is {list(self._kv_cache.shape)}, expected "
                f"[blocks, layer ids, {self._block_size}, hidden]: its rows would be read from the wrong slots"
            )
        logger.info(
            "%s: hidden-state cache %s %s on %s",
            CONNECTOR,
            list(self._kv_cache.shape),
            self._kv_cache.dtype,
            self._kv_cache.device,
        )

    def start_load_kv(self, *args: Any, **kwargs: Any) -> None:
        pass  # store only

    def wait_for_layer_load(self, layer_name: str) -> None:
        pass

    def save_kv_layer(self, *args: Any, **kwargs: Any) -> None:
        pass  # the states are in the cache already; read when the request ends (get_finished)

    def wait_for_save(self) -> None:
        """Take each new request's file lock before the scheduler can hand its path to the client."""
        if not self._is_tp_rank_zero or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, Eagle3HiddenStatesMetadata):
            return
        for req_id, filename in meta.new_req_filenames.items():
            if req_id not in self._lock_fds:
                os.makedirs(os.path.dirname(filename) or ".", exist_ok=True)
                fd = os.open(f"{filename}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
                fcntl.flock(fd, fcntl.LOCK_EX)
                self._lock_fds[req_id] = fd

    def _save(self, pending: PendingSave) -> None:
        assert self._kv_cache is not None
        slots = slot_rows(pending.block_ids, self._block_size, pending.token_ids.shape[0])
        lock_fd = self._lock_fds.pop(pending.req_id, None)
        if lock_fd is None:  # scheduled and finished in one step before wait_for_save saw it
            os.makedirs(os.path.dirname(pending.filename) or ".", exist_ok=True)
            lock_fd = os.open(f"{pending.filename}.lock", os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
            fcntl.flock(lock_fd, fcntl.LOCK_EX)
        ready = None
        if self._kv_cache.is_cuda:  # vLLM's way: a copy stream, pinned memory, an event
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream()
            before = torch.cuda.Event()
            before.record()
            self._copy_stream.wait_event(before)
            with torch.cuda.stream(self._copy_stream):
                rows = gather_rows(self._kv_cache, slots.to(self._kv_cache.device, non_blocking=True))
                host = torch.empty_like(rows, device="cpu", pin_memory=True)
                host.copy_(rows, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self._copy_stream)
        else:
            host = gather_rows(self._kv_cache, slots)  # a new tensor: the blocks may be freed from now on
        tensors = {"hidden_states": host, "token_ids": pending.token_ids.to(torch.int64).clone()}
        future = self._executor.submit(write_file, tensors, pending.filename, ready, lock_fd)
        future.add_done_callback(lambda f, p=pending: self._written(p, f))
        self._copies[pending.req_id] = ready

    @staticmethod
    def _written(pending: PendingSave, future: Future) -> None:
        if future.exception() is not None:
            logger.error("%s: writing %s failed: %r", CONNECTOR, pending.filename, future.exception())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Copy out each newly finished request's rows (writes go to a thread); report those whose copy is done."""
        if self._is_tp_rank_zero and self.has_connector_metadata():
            meta = self._get_connector_metadata()
            if isinstance(meta, Eagle3HiddenStatesMetadata):
                for pending in meta.pending_saves:
                    self._save(pending)
        self._finished.update(finished_req_ids)
        done: set[str] = set()
        for req_id in list(self._finished):
            if req_id in self._copies:
                ready = self._copies[req_id]
                if ready is not None and not ready.query():
                    continue  # the device-to-host copy is still running: keep the blocks
                del self._copies[req_id]
                done.add(req_id)
            self._finished.discard(req_id)
            fd = self._lock_fds.pop(req_id, None)  # a request aborted before its save
            if fd is not None:
                os.close(fd)
        return done or None, None

    # ---- scheduler side
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return 0, False  # store only

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        pass

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = Eagle3HiddenStatesMetadata(pending_saves=list(self._pending_saves.values()))
        self._pending_saves.clear()
        for new in scheduler_output.scheduled_new_reqs:
            filename = os.path.join(self._storage_path, f"{new.req_id}.safetensors")
            self._request_filenames[new.req_id] = filename
            meta.new_req_filenames[new.req_id] = filename
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """Keep the finished request's blocks until its rows are copied; its file's path goes into the reply."""
        filename = self._request_filenames.pop(request.request_id, None)
        if filename is None:  # aborted before it was scheduled: nothing was computed
            return False, None
        ids = request.prompt_token_ids
        token_ids = torch.tensor(list(ids) if ids is not None else [], dtype=torch.int64)
        self._pending_saves[request.request_id] = PendingSave(request.request_id, filename, token_ids, list(block_ids))
        return True, {"hidden_states_path": filename}

    def request_finished_all_groups(
        self, request: Request, block_ids: tuple[list[int], ...]
    ) -> tuple[bool, dict[str, Any] | None]:
        if not 0 <= self._group < len(block_ids):
            return False, None
        return self.request_finished(request, block_ids[self._group])

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: VllmConfig) -> str | None:
        return "LBNHC"  # as vLLM's: a token's states together, [blocks, ids, block size, hidden] per layer
