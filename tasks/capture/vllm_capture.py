"""The capture through a vLLM server (capture.backend: vllm): every record's ids in, the DeepSpeed path's shards out.

For each pending record (trimmed, resumable and capped exactly as models/capture/job.py does it) one
`POST /v1/completions` with `prompt` = the token ids and `max_tokens: 1` makes the server run the
prefill and write the record's hidden states to `{shared_dir}/{request_id}.safetensors`; the reply's
`kv_transfer_params.hidden_states_path` names the file. The file is read (after the connector's
`.lock`, models/capture/vllm_hidden.py), checked (the ids sent, [n, 4, H]), the final norm is applied to the
last layer, and the sample goes to a `ShardWriter` -- the same shards, index and metadata as the
DeepSpeed ranks write, so train, plan and resume cannot tell the backends apart.

Exactly once: a record is in the shards once it is in a complete shard; a kill loses what the writer
held (< shard_tokens) and those records are sent again on resume. The connector's files are deleted
once the shard that holds their record is durable, so at any time shared_dir holds at most the
writer's window plus the requests in flight (tasks/capture/plan.py counts them); what a killed
capture left there is deleted at the next start (shared_dir is this capture's alone).

A status means what it says (tasks/serving/errors.py): 400/413/422 refuse that record (the others
are captured, then the stage fails naming the refused ones), 401/403/404 stop at once, connection
errors, 408, 429 and 5xx are retried until `outage_window_s` (then `ServerOutage`, which a Prefect
retry resumes). A reply that names no file, or a file that is missing, incomplete or of the wrong
shape (`ExtractionFailed`), and a failed shard write (`WriteFailed`) stop the capture at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import torch

from models.capture.job import DTYPES, check_compatible
from models.capture.records import load_records, within_token_cap
from models.capture.shards import ShardWriter, clean_temps, list_shards, shard_metadata, write_index
from models.capture.vllm_hidden import (
    LOCK_SUFFIX,
    ExtractionFailed,
    FinalNorm,
    connector_env,
    engine_layer_ids,
    read_connector_file,
    sample_rows,
    server_flags,
    wait_for_file,
)
from models.common.atomic import is_safetensors_temp
from models.common.job_files import CaptureJobFile
from models.draft.config import default_aux_layers
from settings.capture import VllmCaptureSettings
from tasks.capture.plan import capture_dtype, target_shape
from tasks.runtime.threads import run_to_the_end
from tasks.serving.client import RetryPolicy
from tasks.serving.errors import BadRequest
from tasks.serving.vllm import VLLMClient

CAPTURE_RANK = 0  # the shard names' rank: one writer, in the pipeline's process
log = logging.getLogger("eagle3.capture.engine")


class RecordsRefused(ValueError):
    """The server refused some records (HTTP 400/413/422); every other record was captured."""

    def __init__(self, refused: list[tuple[str, str, int, str]]):
        self.refused = refused
        first = "; ".join(f"{ds}/{rid} ({n} tokens): {why}" for ds, rid, n, why in refused[:3])
        super().__init__(
            f"the vLLM server refused {len(refused)} record(s), e.g. {first}. Every other record is captured. "
            "Start vLLM with a larger --max-model-len (or drop the records with records.max_seq_len), "
            "then run the capture "
            "stage again: only the refused records are sent."
        )

    def __reduce__(self):  # Prefect pickles task exceptions into results
        return (RecordsRefused, (self.refused,))


@dataclass
class _Window:
    """The connector files of the samples the writer holds: deleted once their shard is durable."""

    files: list[str] = field(default_factory=list)

    def release(self) -> None:
        for path in self.files:
            for name in (path, path + LOCK_SUFFIX):
                try:
                    Path(name).unlink(missing_ok=True)
                except OSError as e:  # a file we cannot delete only costs room in shared_dir
                    log.warning("cannot delete %s: %s", name, e)
        self.files = []


def check_in_shared_dir(path: str, shared_dir: Path) -> None:
    """ExtractionFailed unless the server's file lies in this capture's shared_dir: a file elsewhere is neither read
    nor deleted (the capture deletes the files it has stored, so a wrong path must never reach that)."""
    if not Path(path).resolve().is_relative_to(shared_dir.resolve()):
        raise ExtractionFailed(
            path,
            f"the server wrote it outside capture.engine.shared_dir ({shared_dir}), so it is not read or deleted",
            "Start the server with the kv_transfer_config this capture logs: its "
            "shared_storage_path must be shared_dir, the same path where both run",
        )


def clean_connector_files(shared_dir: Path) -> int:
    """Delete the connector files a killed capture left in `shared_dir` (its records are sent again); how many.

    A server killed mid-write also leaves safetensors' own `.tmpXXXXXX` (models/common/atomic.py).
    """
    if not shared_dir.is_dir():
        return 0
    n = 0
    for p in shared_dir.iterdir():
        connector = p.name.endswith((".safetensors", ".safetensors" + LOCK_SUFFIX, ".safetensors.tmp"))
        if (connector or is_safetensors_temp(p.name)) and p.is_file():
            p.unlink(missing_ok=True)
            n += 1
    return n


async def capture_with_vllm(
    job: CaptureJobFile,
    engine: VllmCaptureSettings,
    shared_dir: Path,
    *,
    on_progress: Callable[[int, int, int], None] = lambda done, total, tokens: None,
    transport: httpx.AsyncBaseTransport | None = None,
    logger: logging.Logger | logging.LoggerAdapter = log,
    on_failure: Callable[[Any, Any], Awaitable[None]] | None = None,
) -> dict[str, int]:
    """Capture every pending record of `job` through the vLLM server; {"samples", "tokens"} captured by this call.

    `on_progress(done, total, tokens)` after every sample (samples and tokens of this call); `on_failure`: the
    client's (tasks/serving/client.py), e.g. the watch of a server the capture launched (tasks/serving/watch.py).
    """
    out_dir = Path(job.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    shared_dir.mkdir(parents=True, exist_ok=True)
    shape = target_shape(job.target.path, job.target.trust_remote_code)
    dtype = DTYPES.get(capture_dtype(shape, job.dtype), torch.float32)
    aux_layers = default_aux_layers(shape.num_layers) if job.aux_layers is None else list(job.aux_layers)
    ids_wanted = engine_layer_ids(aux_layers, shape.num_layers)

    existing = [shard_metadata(p) for p in list_shards(out_dir)]
    check_compatible(existing, out_dir, shape.hidden_size, aux_layers, dtype, job.storage)
    done_keys = {(s["dataset"], s["id"]) for m in existing for s in m["samples"]}
    samples, parts, no_loss = load_records(job.datasets, None)
    pending = within_token_cap([s for s in samples if (s.dataset, s.id) not in done_keys], job.launch_tokens)
    pending.sort(key=lambda s: (-s.length, s.dataset, s.id))  # longest first: no long straggler at the end
    clean_temps(out_dir, CAPTURE_RANK)
    stale = clean_connector_files(shared_dir)
    logger.info(
        "capture (vllm %s): %d records with loss tokens (%d without, skipped), %d already captured, %d pending; "
        "aux_layers=%s dtype=%s; the server must run with: PYTHONPATH=%s ... %s%s",
        engine.url,
        len(samples),
        no_loss,
        len(done_keys),
        len(pending),
        aux_layers,
        str(dtype).removeprefix("torch."),
        connector_env({})["PYTHONPATH"],
        " ".join(f"'{w}'" if w.startswith("{") else w for w in server_flags(aux_layers, shape.num_layers, shared_dir)),
        f"; deleted {stale} connector file(s) a killed capture left" if stale else "",
    )
    if not pending:
        write_index(out_dir)
        on_progress(0, 0, 0)
        return {"samples": 0, "tokens": 0}

    norm = FinalNorm.load(job.target.path)
    model = engine.model or job.target.path
    total, done, tokens = len(pending), 0, 0
    refused: list[tuple[str, str, int, str]] = []
    window = _Window()
    write_lock = asyncio.Lock()
    queue = iter(pending)  # max_concurrency workers take the next record as they finish one
    retry = RetryPolicy(outage_window_s=engine.outage_window_s)
    on_progress(0, total, 0)

    async def one(sample, writer: ShardWriter, client: VLLMClient) -> None:
        nonlocal done, tokens
        part = parts[sample.part]
        ids = part.input_ids[sample.start : sample.start + sample.length]
        try:
            path = await client.extract(ids.tolist(), model)
        except BadRequest as e:
            refused.append((sample.dataset, sample.id, sample.length, e.message))
            return
        check_in_shared_dir(path, shared_dir)
        await asyncio.to_thread(wait_for_file, path, engine.request_timeout_s)
        hidden = await asyncio.to_thread(read_connector_file, path, ids.tolist(), len(ids_wanted), shape.hidden_size)
        aux, last = sample_rows(hidden, norm, dtype)
        async with write_lock:  # one writer; a flush writes every sample the window holds
            window.files.append(path)
            # to the end even when a failure cancels this worker: a shard half-written by a thread
            # nobody waits for would race the next writer of this directory
            shard, cancelled = await run_to_the_end(
                writer.add,
                sample.id,
                sample.dataset,
                torch.from_numpy(ids.copy()),
                torch.from_numpy(part.loss_mask[sample.start : sample.start + sample.length].copy()),
                aux,
                last,
            )
            if shard is not None:
                window.release()
            if cancelled:
                raise asyncio.CancelledError
        done += 1
        tokens += sample.length
        on_progress(done, total, tokens)

    async with VLLMClient(
        engine.url,
        request_timeout_s=engine.request_timeout_s,
        retry=retry,
        api_key=engine.api_key(),
        max_connections=engine.max_concurrency,
        transport=transport,
        logger=logger,
        on_failure=on_failure,
        auth_hint="set capture.engine.api_key_env to the variable holding vLLM's --api-key.",
        url_hint="capture.engine.url must be the base URL of the vLLM server (e.g. http://host:8000, no "
        "path) and capture.engine.model its served model name.",
    ) as client:
        writer = ShardWriter(out_dir, CAPTURE_RANK, job.shard_tokens, aux_layers=aux_layers, storage=job.storage)

        async def worker() -> None:
            for sample in queue:
                await one(sample, writer, client)

        # The first failure cancels the other workers and is raised once they have ended (asyncio.TaskGroup's
        # way, which needs Python 3.11).
        workers = [asyncio.ensure_future(worker()) for _ in range(min(engine.max_concurrency, total))]
        try:
            await asyncio.gather(*workers)
        except BaseException as error:
            for w in workers:
                w.cancel()
            await asyncio.gather(*workers, return_exceptions=True)  # a cancelled worker's shard write runs to its end
            raise error from None
        # Only after every request succeeded or was refused: on a failure what the writer holds is
        # not written (it is captured again on resume), as with the DeepSpeed ranks.
        if writer.flush() is not None:
            window.release()
    write_index(out_dir)
    if refused:
        raise RecordsRefused(sorted(refused))
    return {"samples": done, "tokens": tokens}
