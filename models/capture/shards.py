"""Captured hidden states on disk: safetensors shards of many samples, plus a Parquet index.

A shard `shard-{rank:03d}-{seq:06d}.safetensors` holds whole samples concatenated along the token
axis (T = the shard's tokens, H = the target's hidden size):

    input_ids    int32        [T]
    loss_mask    uint8        [T]
    aux_hidden   target dtype [T, 3H]   outputs of the three aux decoder layers, concatenated
    last_hidden  target dtype [T, H]    the final hidden state, after the final norm

Its string metadata (read from the header alone, no tensor bytes) says which rows belong to which
sample: `samples` = JSON list of {"id", "dataset", "offset", "length"}, and `hidden_size`,
`aux_layers` (JSON list), `dtype` (e.g. "float32"), `num_tokens`, `format`.

FP8 storage (`capture.storage: fp8`; metadata `storage` = "fp8", absent = "native"): the two hidden
tensors are float8 e4m3 (torch.float8_e4m3fn, safetensors F8_E4M3), each with a float32 scale per
token and feature beside it:

    aux_hidden   float8_e4m3fn [T, 3H]   aux_scale   float32 [T, 3]   (one per aux layer: they differ in scale)
    last_hidden  float8_e4m3fn [T, H]    last_scale  float32 [T, 1]

value = e4m3 * scale, the scale being the row's (feature's) largest |value| / 448, e4m3's largest
finite number, so nothing saturates. `dtype` stays the dtype the target computed in, which
`read_sample` dequantizes to. Error bound per value: |x - x'| <= 2^-4 |x| (3 mantissa bits, round to
nearest) or, below e4m3's smallest normal (2^-6 * scale), the subnormal half-step 2^-10 * scale.
Bytes per token: 4H + 16 + 5 against 8H + 5 in bf16 (Kimi-K2.5, H = 7168: 28,693 against 57,349).
A directory holds one storage and one dtype: `storage_of` refuses a mixed one.

Shards are written to a temporary name starting with '.', fsynced and renamed into place (models/common/atomic.py),
so a shard that exists is complete: a resumed capture trusts every `shard-*.safetensors` and skips the
samples listed in them. Each rank writes only its own `shard-{rank:03d}-*` names, so ranks never
race for a file name. A shard that cannot be read (truncated, overwritten) raises `DamagedShard`,
which names it and says what to do; a shard that cannot be written raises `WriteFailed`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.common.atomic import atomic_file, atomic_path, is_safetensors_temp
from models.common.file_errors import DamagedShard, WriteFailed

FORMAT = "eagle3-hidden-v1"
TENSORS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
NATIVE, FP8 = "native", "fp8"  # `capture.storage`, and the shard metadata's `storage` (absent: native)
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3's largest finite value
# the hidden tensor -> (its scale tensor, features per row that get a scale each)
FP8_SCALES = {"aux_hidden": ("aux_scale", 3), "last_hidden": ("last_scale", 1)}
ID_BYTES = 4 + 1  # int32 input id + uint8 loss flag per token
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
INDEX_NAME = "index.parquet"
METADATA_NAME = (
    "metadata.json"  # beside the index: the capture's target, layers, dtype and speed (tasks/capture/tasks.py)
)
_SHARD_RE = re.compile(r"^shard-(\d{3,})-(\d{6,})\.safetensors$")
_TMP_PREFIX = ".shard-"
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how safetensors' Rust I/O errors carry the errno
RESUME = (
    "make room there (or give capture.out_dir a bigger disk), then run the capture stage again: "
    "complete shards are kept and skipped"
)


def _shard_problem(path: str | Path, error: BaseException) -> str:
    """What is wrong with a shard, in words, from the safetensors or JSON error."""
    try:
        size = f"{os.path.getsize(path):,} bytes"
    except OSError:
        size = "size unknown"
    text = str(error).removeprefix("Error while deserializing header: ")
    if isinstance(error, SafetensorError):
        return f"{size}, not a complete safetensors file: {text}"
    return f"{size}, no valid sample list in its header: {type(error).__name__}: {text}"


def bytes_per_token(hidden_size: int, dtype: str, storage: str = NATIVE) -> int:
    """Bytes one captured token takes in a shard: ids, mask, 3H aux and H last hidden values (and fp8 scales)."""
    if storage == FP8:
        return 4 * hidden_size + 4 * sum(groups for _, groups in FP8_SCALES.values()) + ID_BYTES
    return 4 * hidden_size * DTYPE_BYTES[dtype] + ID_BYTES


def quantize_fp8(x: torch.Tensor, groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, W] -> (e4m3 [T, W], float32 scales [T, groups]): each row's `groups` equal slices scaled to +-448."""
    t, w = x.shape
    sliced = x.detach().to(torch.float32).reshape(t, groups, w // groups)
    scale = sliced.abs().amax(-1) / FP8_MAX  # [T, groups]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero slice: any scale will do
    q = (sliced / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.reshape(t, w), scale


def dequantize_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 [T, W] and float32 scales [T, groups] -> [T, W] in `dtype`."""
    t, w = q.shape
    groups = scale.shape[-1]
    return (q.to(torch.float32).reshape(t, groups, w // groups) * scale[..., None]).reshape(t, w).to(dtype)


def shard_name(rank: int, seq: int) -> str:
    return f"shard-{rank:03d}-{seq:06d}.safetensors"


def list_shards(out_dir: str | Path) -> list[Path]:
    """Complete shards in `out_dir` in (rank, seq) order; temp files are never listed."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return []
    found = []
    for p in out_dir.iterdir():
        m = _SHARD_RE.match(p.name)
        if m:
            found.append((int(m.group(1)), int(m.group(2)), p))
    return [p for _, _, p in sorted(found)]


CAPTURE_SETTINGS = ("hidden_size", "aux_layers", "dtype", "storage")  # what a capture resuming into shards must share


def captured_with(meta: dict) -> dict[str, Any]:
    """The CAPTURE_SETTINGS in a shard's metadata (`shard_metadata`); a shard without `storage` is native."""
    return {k: meta.get(k, NATIVE if k == "storage" else None) for k in CAPTURE_SETTINGS}


def shard_metadata(path: str | Path) -> dict:
    """The decoded metadata of one shard (header only): samples, hidden_size, aux_layers, dtype, ..."""
    try:
        with safe_open(str(path), framework="pt") as f:
            raw = f.metadata() or {}
        meta = dict(raw)
        meta["samples"] = json.loads(raw["samples"])
        meta["aux_layers"] = json.loads(raw["aux_layers"])
        meta["hidden_size"] = int(raw["hidden_size"])
        meta["num_tokens"] = int(raw.get("num_tokens", sum(s["length"] for s in meta["samples"])))
    except (SafetensorError, KeyError, TypeError, ValueError) as e:  # a complete shard is never partial
        raise DamagedShard(path, _shard_problem(path, e)) from None
    return meta


def iter_shard_index(out_dir: str | Path) -> Iterator[dict]:
    """One row per captured sample: {"id", "dataset", "shard" (file name), "offset", "length"}."""
    for path in list_shards(out_dir):
        for s in shard_metadata(path)["samples"]:
            yield {
                "id": s["id"],
                "dataset": s["dataset"],
                "shard": path.name,
                "offset": int(s["offset"]),
                "length": int(s["length"]),
            }


class MixedShards(ValueError):
    """A hidden-state directory holds shards of more than one storage or dtype: training reads one kind."""


def storage_of(out_dir: str | Path) -> tuple[str, str | None]:
    """(storage, dtype) that every shard in `out_dir` shares ((native, None) when there are none); MixedShards
    naming each kind, how many shards it has and one of them, when they differ."""
    kinds: dict[tuple[str, str], list[str]] = {}
    for path in list_shards(out_dir):
        meta = shard_metadata(path)
        kinds.setdefault((meta.get("storage", NATIVE), str(meta.get("dtype"))), []).append(path.name)
    if len(kinds) > 1:
        found = "; ".join(
            f"{len(names)} {storage} {dtype} shard(s) ({names[0]}{', ...' if len(names) > 1 else ''})"
            for (storage, dtype), names in sorted(kinds.items())
        )
        raise MixedShards(
            f"{out_dir} mixes hidden-state shards: {found}. A capture writes one kind (capture.storage, "
            "capture.dtype); move the shards of one kind aside, or capture again into an empty capture.out_dir"
        )
    if not kinds:
        return NATIVE, None
    return next(iter(kinds))


def done_sample_keys(out_dir: str | Path) -> set[tuple[str, str]]:
    """(dataset, id) of every sample in a complete shard of `out_dir`, from shard headers only."""
    return {(row["dataset"], row["id"]) for row in iter_shard_index(out_dir)}


def read_sample(shard_path: str | Path, offset: int, length: int) -> dict[str, torch.Tensor]:
    """The rows [offset, offset+length) of every tensor in a shard, read through a memory map;
    fp8 hidden states dequantized to the shard's `dtype`."""
    out = {}
    try:
        with safe_open(str(shard_path), framework="pt") as f:
            for name in TENSORS:
                out[name] = f.get_slice(name)[offset : offset + length]
            meta = f.metadata() or {}
            if meta.get("storage", NATIVE) == FP8:
                dtype = getattr(torch, meta["dtype"])
                for name, (scale_name, _) in FP8_SCALES.items():
                    scale = f.get_slice(scale_name)[offset : offset + length]
                    out[name] = dequantize_fp8(out[name], scale, dtype)
    except SafetensorError as e:
        raise DamagedShard(shard_path, _shard_problem(shard_path, e)) from None
    return out


def clean_temps(out_dir: str | Path, rank: int | None = None) -> int:
    """Remove temp files a killed writer left behind (all ranks', or only `rank`'s); return how many.

    safetensors' own `.tmpXXXXXX` files cannot be told apart by rank: they are always removed, so call
    this only while nobody writes in `out_dir` (the run lock; the DeepSpeed ranks before their barrier).
    """
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        return 0
    prefix = _TMP_PREFIX if rank is None else f"{_TMP_PREFIX}{rank:03d}-"
    n = 0
    for p in out_dir.iterdir():
        if p.name.startswith(prefix) or is_safetensors_temp(p.name):
            p.unlink(missing_ok=True)
            n += 1
    return n


def write_index(out_dir: str | Path) -> Path:
    """Write `index.parquet` (one row per sample, see `iter_shard_index`) atomically; return its path."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    out_dir = Path(out_dir)
    rows = list(iter_shard_index(out_dir))
    schema = pa.schema(
        {"id": pa.string(), "dataset": pa.string(), "shard": pa.string(), "offset": pa.int64(), "length": pa.int64()}
    )
    table = pa.Table.from_pylist(rows, schema=schema)
    path = out_dir / INDEX_NAME
    try:
        with atomic_file(path) as f:
            pq.write_table(table, f)
    except OSError as e:
        raise WriteFailed(
            path,
            e,
            kept=f"{len(list_shards(out_dir))} complete shards in {out_dir}; the index is rebuilt from their headers",
            resume=RESUME,
        ) from None
    return path


class ShardWriter:
    """Collects one rank's samples and writes a shard once it holds >= `shard_tokens` tokens.

    Samples are never split across shards, so a shard can exceed `shard_tokens` by one sample.
    Call `close()` (or use as a context manager) to write the remainder.
    """

    def __init__(
        self,
        out_dir: str | Path,
        rank: int,
        shard_tokens: int,
        *,
        aux_layers: list[int] | None = None,
        storage: str = NATIVE,
    ):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        if storage not in (NATIVE, FP8):
            raise ValueError(f"storage must be {NATIVE!r} or {FP8!r}, got {storage!r}")
        self.storage = storage
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        self.shard_tokens = shard_tokens
        self.aux_layers = list(aux_layers) if aux_layers is not None else None
        seqs = [
            int(m.group(2))
            for p in list_shards(self.out_dir)  # each listed shard's name matches
            if (m := _SHARD_RE.match(p.name)) and int(m.group(1)) == rank
        ]
        self.next_seq = max(seqs) + 1 if seqs else 0
        self.written: list[Path] = []
        self._pending: list[tuple[str, str, dict[str, torch.Tensor]]] = []
        self._pending_tokens = 0
        self._hidden_size: int | None = None
        self._dtype: torch.dtype | None = None

    def add(
        self,
        sample_id: str,
        dataset: str,
        input_ids: torch.Tensor,
        loss_mask: torch.Tensor,
        aux_hidden: torch.Tensor,
        last_hidden: torch.Tensor,
    ) -> Path | None:
        """Queue one sample ([n] ids and mask, [n, 3H] aux, [n, H] last); return a shard path if one was written."""
        n = int(input_ids.shape[0])
        h = int(last_hidden.shape[-1])
        if n == 0:
            raise ValueError(f"{dataset}/{sample_id}: empty sample")
        if loss_mask.shape != (n,) or aux_hidden.shape != (n, 3 * h) or last_hidden.shape != (n, h):
            raise ValueError(
                f"{dataset}/{sample_id}: inconsistent shapes ids {tuple(input_ids.shape)} mask "
                f"{tuple(loss_mask.shape)} aux {tuple(aux_hidden.shape)} last {tuple(last_hidden.shape)}"
            )
        if aux_hidden.dtype != last_hidden.dtype:
            raise ValueError(f"{dataset}/{sample_id}: aux dtype {aux_hidden.dtype} != last dtype {last_hidden.dtype}")
        if self._hidden_size is None:
            self._hidden_size, self._dtype = h, last_hidden.dtype
        elif (h, last_hidden.dtype) != (self._hidden_size, self._dtype):
            raise ValueError(
                f"{dataset}/{sample_id}: hidden {h}/{last_hidden.dtype} differs from "
                f"{self._hidden_size}/{self._dtype} earlier in this shard writer"
            )
        tensors = {
            "input_ids": input_ids.detach().to("cpu", torch.int32),
            "loss_mask": loss_mask.detach().to("cpu", torch.uint8),
            "aux_hidden": aux_hidden.detach().to("cpu"),
            "last_hidden": last_hidden.detach().to("cpu"),
        }
        if self.storage == FP8:  # quantized as they come: the queue holds the smaller bytes
            for name, (scale_name, groups) in FP8_SCALES.items():
                tensors[name], tensors[scale_name] = quantize_fp8(tensors[name], groups)
        self._pending.append((str(sample_id), str(dataset), tensors))
        self._pending_tokens += n
        if self._pending_tokens >= self.shard_tokens:
            return self.flush()
        return None

    def flush(self) -> Path | None:
        """Write whatever is queued as one shard (atomically); return its path, or None if nothing was queued."""
        if not self._pending:
            return None
        samples, offset = [], 0
        for sample_id, dataset, t in self._pending:
            n = int(t["input_ids"].shape[0])
            samples.append({"id": sample_id, "dataset": dataset, "offset": offset, "length": n})
            offset += n
        names = self._pending[0][2]  # the TENSORS, and with fp8 their scales
        tensors = {name: torch.cat([t[name] for _, _, t in self._pending]).contiguous() for name in names}
        metadata = {
            "format": FORMAT,
            "samples": json.dumps(samples, separators=(",", ":")),
            "hidden_size": str(self._hidden_size),
            "aux_layers": json.dumps(self.aux_layers),
            "dtype": str(self._dtype).removeprefix("torch."),
            "num_tokens": str(offset),
            **({"storage": FP8} if self.storage == FP8 else {}),  # absent: native, as in every earlier shard
        }
        path = self.out_dir / shard_name(self.rank, self.next_seq)
        try:
            with atomic_path(path) as tmp:  # `.shard-RRR-...tmp`: what clean_temps removes
                save_file(tensors, str(tmp), metadata=metadata)
        except BaseException as e:
            error = _as_os_error(e)
            if error is None:
                raise
            # Stop at once: every shard on disk is complete; what this rank held is captured again.
            raise WriteFailed(
                path,
                error,
                resume=RESUME,
                kept=f"{len(list_shards(self.out_dir))} complete shards in {self.out_dir}; the "
                f"{len(self._pending)} sample(s) ({offset:,} tokens) this shard would have held are captured again",
            ) from None
        self.next_seq += 1
        self.written.append(path)
        self._pending, self._pending_tokens = [], 0
        return path

    def close(self) -> Path | None:
        return self.flush()

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, exc_type, *exc: object) -> None:
        if exc_type is None:  # on an error, what is queued is not written: it is recaptured on resume
            self.close()


def _as_os_error(error: BaseException) -> OSError | None:
    """The OSError behind a failed shard write (safetensors reports it as text), or None if not one."""
    if isinstance(error, OSError):
        return error
    if isinstance(error, SafetensorError):
        found = _OS_ERROR.search(str(error))
        if found:
            code = int(found.group(1))
            return OSError(code, os.strerror(code))
    return None
