"""Disk and time planning for the capture stage: refuse a job that cannot fit before it starts.

EAGLE-3 stores, per token, three aux hidden states and the final one (4H values) in the target
dtype, plus the token id and loss flag: for Kimi-K2.5 (H = 7168, bf16) 56 KiB a token, terabytes
for a full run. The plan counts the tokens of the records not yet captured.

Through a vLLM server (capture.backend: vllm) the connector also writes a file per request
(n x 4 x H in the server's dtype, + int64 ids) that lives until the shard holding its record is on
disk: at most the writer's window (shard_tokens + one record) plus the `max_concurrency` requests in
flight, counted here with the longest records (`ExtractionWindow`). On the shards' filesystem that room
is added to what the capture needs; elsewhere (a RAM disk) it is checked against that filesystem.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path

from models.capture.shards import DTYPE_BYTES, NATIVE, bytes_per_token
from models.draft.config import default_aux_layers
from tasks.records.build import summarize_records


class DiskTooSmall(RuntimeError):
    """The capture would not fit in the free space of its output directory."""


@dataclass(frozen=True)
class TargetShape:
    hidden_size: int
    num_layers: int
    dtype: str  # the checkpoint's torch dtype name


@dataclass(frozen=True)
class ExtractionWindow:
    """capture.backend: vllm: where the connector's files go and what bounds how many exist at once."""

    shared_dir: Path
    max_concurrency: int
    shard_tokens: int


@dataclass
class CapturePlan:
    tokens_total: int  # tokens of all records (upper bound: trailing non-loss tokens are trimmed)
    tokens_done: int  # already in complete shards
    tokens_todo: int
    bytes_per_token: int
    bytes_needed: int
    free_bytes: int
    usable_bytes: int  # free space less the margin
    out_dir: str
    dtype: str
    hidden_size: int
    storage: str  # capture.storage: native (dtype) or fp8 (e4m3 with scales)
    est_seconds: float | None  # from a previous capture's throughput, when known
    temp_bytes: int = 0  # vLLM connector files at most on disk at once (0: DeepSpeed backend)
    temp_dir: str | None = None  # where they go
    temp_usable_bytes: int | None = None  # free space there less the margin, when not the shards' filesystem

    @property
    def temp_fits(self) -> bool:
        return self.temp_usable_bytes is None or self.temp_bytes <= self.temp_usable_bytes

    @property
    def fits(self) -> bool:
        return self.bytes_needed <= self.usable_bytes and self.temp_fits

    def to_dict(self) -> dict:
        return {**asdict(self), "fits": self.fits}


class TargetConfigMissing(RuntimeError):
    """The target's config.json is neither in its directory nor in the Hugging Face cache (and is not downloaded)."""


def read_target_config(target_path: str, *, download: bool = True) -> dict:
    """The target's config.json as a dict: from its directory, else from the Hugging Face cache, else downloaded
    (`download`, and HF_HUB_OFFLINE not set); TargetConfigMissing at once otherwise, with how to provide it."""
    config_file = Path(target_path) / "config.json"
    if config_file.is_file():
        return json.loads(config_file.read_text())
    if Path(target_path).exists():
        raise TargetConfigMissing(f"{target_path} has no config.json: point target.path at the checkpoint's directory")
    from huggingface_hub import constants, hf_hub_download, try_to_load_from_cache

    try:
        cached = try_to_load_from_cache(target_path, "config.json")
    except ValueError:  # not a Hub id either (HFValidationError): a local path that does not exist
        raise TargetConfigMissing(f"{target_path}: no such directory (target.path)") from None
    if isinstance(cached, str):
        return json.loads(Path(cached).read_text())
    if not download or constants.HF_HUB_OFFLINE:
        raise TargetConfigMissing(
            f"{target_path} is not a local directory and its config.json is not in the Hugging Face cache "
            "(nothing is downloaded here). Point target.path at a local copy of the checkpoint (config.json is all "
            "the plan needs), or fetch that one file into the cache: "
            f"huggingface-cli download {target_path} config.json"
        )
    return json.loads(Path(hf_hub_download(target_path, "config.json")).read_text())


def text_config(data: dict) -> dict:
    """The text model's config of a config.json (Kimi-K2.5 nests the DeepSeek-V3 text config)."""
    return data.get("text_config") or data


def target_shape(target_path: str, trust_remote_code: bool = False, *, download: bool = True) -> TargetShape:
    """Hidden size, layer count and dtype of the target from its config.json (text config of multimodal ones);
    `download`: fetch config.json from the Hub when neither the path nor the cache has it (`read_target_config`).
    `trust_remote_code` is not needed to read the file (kept for the callers)."""
    return shape_of(read_target_config(target_path, download=download))


def shape_of(data: dict) -> TargetShape:
    """The TargetShape of a config.json's contents."""
    text = text_config(data)
    dtype = text.get("dtype") or text.get("torch_dtype") or data.get("dtype") or data.get("torch_dtype") or "float32"
    return TargetShape(int(text["hidden_size"]), int(text["num_hidden_layers"]), str(dtype).removeprefix("torch."))


def capture_layers(num_layers: int, override: list[int] | None) -> list[int]:
    """The decoder layers to capture: the config's, checked against the target, or EAGLE-3's default."""
    if override is None:
        return default_aux_layers(num_layers)
    bad = [k for k in override if not 0 <= k < num_layers]
    if len(override) != 3 or bad or len(set(override)) != 3:
        raise ValueError(
            f"capture.aux_layers must be 3 distinct 0-based layers below {num_layers} "
            f"(the target's layer count), got {override}"
        )
    return list(override)


def capture_dtype(shape: TargetShape, setting: str) -> str:
    """The dtype the capture stores for `capture.dtype: <setting>`: auto is the checkpoint's (else float32)."""
    return shape.dtype if setting == "auto" else setting


def plan_capture(
    records_dirs: list[Path],
    out_dir: Path,
    shape: TargetShape,
    dtype: str,
    *,
    margin: float,
    storage: str = NATIVE,
    max_tokens: int | None = None,
    tokens_done: int = 0,
    tokens_per_s: float | None = None,
    engine: ExtractionWindow | None = None,
) -> CapturePlan:
    """Bytes the capture still needs against the free space of `out_dir`'s filesystem (and of the connector's)."""
    dtype = capture_dtype(shape, dtype)
    if dtype not in DTYPE_BYTES:
        raise ValueError(f"cannot plan for dtype {dtype!r}; set capture.dtype to one of {', '.join(DTYPE_BYTES)}")
    reports = [summarize_records(d) for d in records_dirs]
    total = sum(r.tokens for r in reports)
    todo = max(0, (min(total, max_tokens) if max_tokens else total) - tokens_done)
    per_token = bytes_per_token(shape.hidden_size, dtype, storage)
    out_fs = existing_parent(out_dir)
    free = shutil.disk_usage(out_fs).free
    needed, temp_bytes, temp_usable = todo * per_token, 0, None
    if engine is not None and todo:
        longest = sorted((n for r in reports for n in r.lengths), reverse=True)
        window = engine.shard_tokens + sum(longest[: engine.max_concurrency]) + (longest[0] if longest else 0)
        # the server's activations: the checkpoint's dtype (bf16 for Kimi), float32 when it says none
        temp_bytes = min(window, todo) * (4 * shape.hidden_size * DTYPE_BYTES.get(shape.dtype, 4) + 8)
        temp_fs = existing_parent(engine.shared_dir)
        if os.stat(temp_fs).st_dev == os.stat(out_fs).st_dev:
            needed += temp_bytes
        else:
            temp_usable = int(shutil.disk_usage(temp_fs).free * (1 - margin))
    return CapturePlan(
        tokens_total=total,
        tokens_done=tokens_done,
        tokens_todo=todo,
        bytes_per_token=per_token,
        bytes_needed=needed,
        free_bytes=free,
        usable_bytes=int(free * (1 - margin)),
        out_dir=str(out_dir),
        dtype=dtype,
        hidden_size=shape.hidden_size,
        storage=storage,
        est_seconds=todo / tokens_per_s if tokens_per_s else None,
        temp_bytes=temp_bytes,
        temp_dir=str(engine.shared_dir) if engine is not None else None,
        temp_usable_bytes=temp_usable,
    )


def check_fits(plan: CapturePlan) -> None:
    """Raise DiskTooSmall with the figures and the ways out when the plan does not fit."""
    if plan.fits:
        return
    if not plan.temp_fits:
        raise DiskTooSmall(
            f"the vLLM connector's files need up to {human_bytes(plan.temp_bytes)} at once in {plan.temp_dir} "
            "(the records in flight and the shard being filled, the longest first) "
            f"but it has {human_bytes(plan.temp_usable_bytes or 0)} "
            "after the margin. Ways out: a lower capture.engine.max_concurrency or capture.shard_tokens; "
            "capture.engine.shared_dir on a bigger filesystem."
        )
    fit_tokens = plan.usable_bytes // plan.bytes_per_token
    raise DiskTooSmall(
        f"the capture needs {human_bytes(plan.bytes_needed)} ({plan.tokens_todo:,} tokens x "
        f"{plan.bytes_per_token:,} B: 4 x hidden {plan.hidden_size} x {plan.dtype} + ids) but "
        f"{plan.out_dir} has {human_bytes(plan.free_bytes)} free ({human_bytes(plan.usable_bytes)} after the "
        f"margin). Ways out: capture.max_tokens: {fit_tokens:,} (what fits); capture.out_dir on a bigger disk; "
        f"or train online (train.mode: online) so no hidden states are stored."
    )


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{int(n):,} B"
        n /= 1024
    return f"{n} B"


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest existing parent (whose filesystem it will be on)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return path
