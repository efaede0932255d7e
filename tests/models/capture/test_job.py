"""Hidden-state capture: the shard format, the plan, and real 2-rank torchrun launches on CPU.

The launches run `models.capture` under `torch.distributed.run` with 2 gloo ranks in both modes
(replicate, DeepSpeed ZeRO-3) and compare every stored row with a plain forward of the same tiny
target; a launch SIGKILLed after its first shard resumes without duplicates or gaps.
"""

from __future__ import annotations

import errno
import json
import os
import random
import subprocess
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from models.capture.job import ds_inference_config, main, moe_leaf_classes
from models.capture.records import Sample, deal, held, load_records, make_batches, trimmed_length, within_token_cap
from models.capture.shards import (
    MixedShards,
    ShardWriter,
    clean_temps,
    dequantize_fp8,
    done_sample_keys,
    iter_shard_index,
    list_shards,
    quantize_fp8,
    read_sample,
    shard_metadata,
    storage_of,
    write_index,
)
from models.common.file_errors import DamagedShard, WriteFailed
from models.common.job_files import CaptureJobFile, DatasetRecords
from models.target.tiny import SAMPLES_DIR
from tests.models.torchrun import cpu_env, launch_cmd

REPO = Path(__file__).resolve().parents[3]
AUX_LAYERS = [1, 3, 4]  # default_aux_layers(8)
ATOL = 1e-5
LAUNCH_TIMEOUT_S = 240


# --- fixtures -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def model(tiny_target_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()


@pytest.fixture(scope="module")
def records(tiny_target_dir, tmp_path_factory) -> dict:
    """Two datasets of records written as the records stage does: {"dirs", "rows": {(ds, id): row}}."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    texts = []
    for f in sorted(SAMPLES_DIR.glob("*.jsonl")):
        for line in f.read_text(encoding="utf-8").splitlines():
            row = json.loads(line)
            texts += [m["content"] for m in row.get("messages", [])] + ([row["prompt"]] if "prompt" in row else [])
    rng = random.Random(0)
    root = tmp_path_factory.mktemp("records")
    dirs, rows = {}, {}
    # beta stores its mask as bool, like passthrough records may.
    for ds, n, mask_type in (("alpha", 22, pa.uint8()), ("beta", 16, pa.bool_())):
        ds_rows = []
        for i in range(n):
            ids = []
            while len(ids) < 6:
                ids = tok.encode(rng.choice(texts), add_special_tokens=False)[: rng.randint(6, 150)]
            tail = 3 if i % 3 == 0 else 0  # tokens after the last loss token: trimmed away by the capture
            prompt = rng.randint(1, len(ids) - 1 - tail)
            mask = [0] * prompt + [1] * (len(ids) - prompt - tail) + [0] * tail
            ds_rows.append({"id": f"{ds}-{i:03d}", "input_ids": ids, "loss_mask": mask})
        if ds == "alpha":
            ds_rows[5]["loss_mask"] = [0] * len(ds_rows[5]["loss_mask"])  # nothing to train: skipped
        rows.update({(ds, r["id"]): r for r in ds_rows})
        if ds == "beta":
            # Longer than all others together: under 2 ranks it is rank 0's whole share, so rank 0
            # runs one batch and (under ZeRO-3) pads with dummy forwards while rank 1 works.
            n_long = sum(trimmed_length(np.array(r["loss_mask"])) for r in rows.values()) + 20
            long_ids = sum((tok.encode(t, add_special_tokens=False) for t in texts), [])[:n_long]
            assert len(long_ids) == n_long
            ds_rows.append({"id": "beta-long", "input_ids": long_ids, "loss_mask": [0] * 50 + [1] * (n_long - 50)})
            rows[(ds, "beta-long")] = ds_rows[-1]
        schema = pa.schema(
            [
                ("id", pa.string()),
                ("input_ids", pa.list_(pa.int32())),
                ("loss_mask", pa.list_(mask_type)),
                ("num_tokens", pa.int32()),
            ]
        )
        d = root / ds
        d.mkdir()
        half = len(ds_rows) // 2
        for k, chunk in enumerate((ds_rows[:half], ds_rows[half:])):
            table = pa.Table.from_pylist(
                [
                    {
                        **r,
                        "loss_mask": [bool(x) for x in r["loss_mask"]] if mask_type == pa.bool_() else r["loss_mask"],
                        "num_tokens": len(r["input_ids"]),
                    }
                    for r in chunk
                ],
                schema=schema,
            )
            pq.write_table(table, d / f"part-{k:06d}.parquet")
        dirs[ds] = d
    return {"dirs": dirs, "rows": rows}


@pytest.fixture(scope="module")
def expected(model, records) -> dict:
    """(dataset, id) -> trimmed ids, mask, and aux/last from a plain unbatched forward."""
    out = {}
    for key, row in records["rows"].items():
        n = trimmed_length(np.array(row["loss_mask"]))
        if n == 0:
            continue
        ids = torch.tensor(row["input_ids"][:n])
        with torch.no_grad():
            hs = model(ids[None], output_hidden_states=True).hidden_states
        out[key] = {
            "input_ids": ids.to(torch.int32),
            "loss_mask": torch.tensor(row["loss_mask"][:n], dtype=torch.uint8),
            "aux_hidden": torch.cat([hs[k + 1] for k in AUX_LAYERS], -1)[0],
            "last_hidden": hs[-1][0],
        }
    return out


def _job(tiny_target_dir: Path, records: dict, out_dir: Path, mode: str, **over) -> Path:
    job = {
        "target": {"path": str(tiny_target_dir), "trust_remote_code": False},
        "datasets": [{"name": ds, "records_dir": str(d)} for ds, d in records["dirs"].items()],
        "out_dir": str(out_dir),
        "aux_layers": None,
        "mode": mode,
        "dtype": "auto",
        "max_batch_tokens": 256,
        "shard_tokens": 300,
        "launch_tokens": None,
        "offload": "none",
        "nvme_path": None,
        "device": "cpu",
        **over,
    }
    path = out_dir.parent / f"{out_dir.name}.job.json"
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(job))
    return path


def _torchrun(job: Path) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        launch_cmd(job, ["-m", "models.capture"]),
        env=cpu_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=LAUNCH_TIMEOUT_S,
    )
    assert proc.returncode == 0, f"capture failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def _check_capture(out_dir: Path, expected: dict) -> float:
    """Every expected sample exactly once with equal values; return the max abs diff of hidden states."""
    index = list(iter_shard_index(out_dir))
    keys = [(r["dataset"], r["id"]) for r in index]
    assert len(keys) == len(set(keys)), "a sample was captured twice"
    assert set(keys) == set(expected)
    assert done_sample_keys(out_dir) == set(expected)
    assert pq.read_table(out_dir / "index.parquet").num_rows == len(expected)
    for shard in list_shards(out_dir):
        meta = shard_metadata(shard)
        assert meta["aux_layers"] == AUX_LAYERS
        assert meta["hidden_size"] == 128 and meta["dtype"] == "float32"
    worst = 0.0
    for r in index:
        got = read_sample(out_dir / r["shard"], r["offset"], r["length"])
        want = expected[(r["dataset"], r["id"])]
        assert torch.equal(got["input_ids"], want["input_ids"]), r
        assert torch.equal(got["loss_mask"], want["loss_mask"]), r
        assert got["loss_mask"][-1] == 1  # trimmed after the last loss token
        for name in ("aux_hidden", "last_hidden"):
            assert got[name].dtype == torch.float32 and got[name].shape == want[name].shape, (r, name)
            diff = (got[name] - want[name]).abs().max().item()
            assert torch.allclose(got[name], want[name], atol=ATOL, rtol=0), (r, name, diff)
            worst = max(worst, diff)
    assert not [p for p in out_dir.iterdir() if p.name.startswith(".")], "temp files left behind"
    return worst


# --- the shard format ---------------------------------------------------------------------------


def _tensors(n: int, h: int = 4, dtype=torch.float32, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randint(0, 100, (n,), generator=g, dtype=torch.int32),
        (torch.arange(n) % 2).to(torch.uint8),
        torch.randn(n, 3 * h, generator=g).to(dtype),
        torch.randn(n, h, generator=g).to(dtype),
    )


def test_shard_writer_round_trip_and_index(tmp_path):
    written = {}
    with ShardWriter(tmp_path, rank=1, shard_tokens=10, aux_layers=AUX_LAYERS) as w:
        for i, n in enumerate([4, 5, 3, 7, 2]):  # 4+5 < 10, +3 -> shard; 7+2 -> written on close
            t = _tensors(n, seed=i)
            written[("d", f"s{i}")] = t
            w.add(f"s{i}", "d", *t)
    assert [p.name for p in list_shards(tmp_path)] == ["shard-001-000000.safetensors", "shard-001-000001.safetensors"]
    meta = shard_metadata(tmp_path / "shard-001-000000.safetensors")
    assert meta["samples"] == [
        {"id": "s0", "dataset": "d", "offset": 0, "length": 4},
        {"id": "s1", "dataset": "d", "offset": 4, "length": 5},
        {"id": "s2", "dataset": "d", "offset": 9, "length": 3},
    ]
    assert (meta["hidden_size"], meta["aux_layers"], meta["dtype"], meta["num_tokens"]) == (
        4,
        AUX_LAYERS,
        "float32",
        12,
    )
    assert done_sample_keys(tmp_path) == set(written)
    for row in iter_shard_index(tmp_path):
        got = read_sample(tmp_path / row["shard"], row["offset"], row["length"])
        for name, want in zip(
            ("input_ids", "loss_mask", "aux_hidden", "last_hidden"), written[(row["dataset"], row["id"])]
        ):
            assert torch.equal(got[name], want), (row, name)
    assert pq.read_table(write_index(tmp_path)).column("id").to_pylist() == [f"s{i}" for i in range(5)]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


# --- fp8 storage ---------------------------------------------------------------------------------


def e4m3_bound(x: torch.Tensor, scale: torch.Tensor, groups: int) -> torch.Tensor:
    """How far e4m3 with per-row scales may move each value: half a step of 3 mantissa bits (2^-4 relative),
    and below e4m3's smallest normal number (2^-6 scaled) half the subnormal step, 2^-9 scaled."""
    t, w = x.shape
    s = scale.repeat_interleave(w // groups, dim=-1).reshape(t, w)
    return torch.maximum(2.0**-4 * x.abs(), 2.0**-10 * s)


def test_fp8_round_trip_stays_within_the_e4m3_bound_and_uses_the_whole_range():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(64, 3 * 32, generator=g, dtype=torch.float64)
    x *= torch.tensor([1e-3, 1.0, 300.0], dtype=torch.float64).repeat_interleave(32)  # three layers' scales
    x[5] = 0.0  # an all-zero row
    q, scale = quantize_fp8(x, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32 and scale.shape == (64, 3)
    back = dequantize_fp8(q, scale, torch.float64)
    err = (back - x).abs()
    assert torch.all(err <= e4m3_bound(x, scale, 3) * (1 + 1e-6))
    assert torch.equal(back[5], x[5])
    # each slice's largest value lands on e4m3's largest, 448: nothing saturates, no range is left unused
    top = q.to(torch.float32).abs().reshape(64, 3, 32).amax(-1)
    assert torch.equal(top[torch.arange(64) != 5], torch.full((63, 3), 448.0))
    # the error is real: the mean relative error of e4m3's normal values sits between 2^-8 and 2^-4
    normal = x.abs() >= 2.0**-6 * scale.double().repeat_interleave(32, dim=-1)
    rel = err[normal] / x.abs()[normal]
    assert 2.0**-8 < rel.mean().item() < 2.0**-4


def test_fp8_capture_dequantizes_within_the_e4m3_bound_of_the_bf16_capture(tiny_target_dir, records, tmp_path):
    """The same records captured twice in bfloat16, stored native and fp8: every value within the bound."""
    native, fp8 = tmp_path / "bf16", tmp_path / "fp8"
    assert main(["--job", str(_job(tiny_target_dir, records, native, "replicate", dtype="bfloat16"))]) == 0
    job = _job(tiny_target_dir, records, fp8, "replicate", dtype="bfloat16", storage="fp8")
    assert main(["--job", str(job)]) == 0
    assert storage_of(native) == ("native", "bfloat16") and storage_of(fp8) == ("fp8", "bfloat16")
    with safe_open(str(list_shards(fp8)[0]), framework="pt") as f:
        assert f.get_slice("aux_hidden").get_dtype() == "F8_E4M3" and f.get_slice("aux_scale").get_shape()[1] == 3
    want = {(r["dataset"], r["id"]): r for r in iter_shard_index(native)}
    got = {(r["dataset"], r["id"]): r for r in iter_shard_index(fp8)}
    assert set(got) == set(want)
    worst = 0.0
    for key, r in got.items():
        b = want[key]
        a = read_sample(native / b["shard"], b["offset"], b["length"])
        q = read_sample(fp8 / r["shard"], r["offset"], r["length"])
        assert torch.equal(q["input_ids"], a["input_ids"]) and torch.equal(q["loss_mask"], a["loss_mask"])
        with safe_open(str(fp8 / r["shard"]), framework="pt") as f:
            scales = {n: f.get_slice(n)[r["offset"] : r["offset"] + r["length"]] for n in ("aux_scale", "last_scale")}
        for name, scale_name, groups in (("aux_hidden", "aux_scale", 3), ("last_hidden", "last_scale", 1)):
            assert q[name].dtype == torch.bfloat16  # dequantized to the dtype the target computed in
            x, y = a[name].double(), q[name].double()
            # e4m3's bound, and the rounding of the dequantized value to bfloat16 (8 bits: 2^-9 relative)
            bound = e4m3_bound(x, scales[scale_name].double(), groups) + 2.0**-8 * x.abs()
            assert torch.all((y - x).abs() <= bound), (key, name, ((y - x).abs() - bound).max())
            worst = max(worst, ((y - x).abs() / x.abs().clamp(min=1e-6)).median().item())
    assert worst > 0  # quantized, not copied
    size = lambda d: sum(p.stat().st_size for p in list_shards(d))  # noqa: E731
    assert 0.45 < size(fp8) / size(native) < 0.6  # about half of bf16's bytes (H = 128: ids and scales weigh more)


def test_a_directory_of_two_storages_is_refused_by_training_and_by_the_capture(
    tiny_target_dir, records, tmp_path, capsys
):
    from models.train.data import HiddenSource

    out = tmp_path / "hidden"
    for storage in ("native", "fp8"):
        with ShardWriter(out, rank=0, shard_tokens=100, aux_layers=AUX_LAYERS, storage=storage) as w:
            w.add(f"{storage}-0", "B1", *_tensors(5))
    with pytest.raises(MixedShards) as info:
        HiddenSource(out, 64)
    message = str(info.value)
    assert "1 fp8 float32 shard(s) (shard-000-000001.safetensors)" in message
    assert "1 native float32 shard(s) (shard-000-000000.safetensors)" in message and "capture.storage" in message
    # a capture into a native directory with fp8 storage stops before it writes anything
    native = tmp_path / "native"
    assert main(["--job", str(_job(tiny_target_dir, records, native, "replicate", launch_tokens=200))]) == 0
    before = sorted(p.name for p in native.iterdir())
    assert main(["--job", str(_job(tiny_target_dir, records, native, "replicate", storage="fp8"))]) != 0
    assert "'storage': 'native'" in capsys.readouterr().err and sorted(p.name for p in native.iterdir()) == before


def test_shard_writer_continues_numbering_and_keeps_dtype(tmp_path):
    for _ in range(2):
        with ShardWriter(tmp_path, rank=0, shard_tokens=1) as w:
            w.add("a", "d", *_tensors(3, dtype=torch.bfloat16))
    with ShardWriter(tmp_path, rank=2, shard_tokens=1) as w:
        w.add("b", "d", *_tensors(3, dtype=torch.bfloat16))
    assert [p.name for p in list_shards(tmp_path)] == [
        "shard-000-000000.safetensors",
        "shard-000-000001.safetensors",
        "shard-002-000000.safetensors",
    ]
    got = read_sample(tmp_path / "shard-002-000000.safetensors", 1, 2)
    assert got["aux_hidden"].dtype == torch.bfloat16 and got["aux_hidden"].shape == (2, 12)
    assert shard_metadata(tmp_path / "shard-002-000000.safetensors")["dtype"] == "bfloat16"


def test_temps_are_invisible_and_cleaned(tmp_path):
    with ShardWriter(tmp_path, rank=0, shard_tokens=100) as w:
        w.add("a", "d", *_tensors(3))
    (tmp_path / ".shard-000-000001.safetensors.123-abcd.tmp").write_bytes(b"partial")
    (tmp_path / ".shard-001-000000.safetensors.456-abcd.tmp").write_bytes(b"partial")
    (tmp_path / ".tmpVBB9X3").write_bytes(b"partial")  # safetensors' own temp, killed mid save_file
    (tmp_path / ".tmp-not-ours").write_bytes(b"kept")
    assert done_sample_keys(tmp_path) == {("d", "a")}
    assert ShardWriter(tmp_path, rank=0, shard_tokens=1).next_seq == 1
    assert clean_temps(tmp_path, rank=1) == 2
    assert clean_temps(tmp_path) == 1
    (tmp_path / ".tmp-not-ours").unlink()
    assert [p.name for p in tmp_path.iterdir()] == ["shard-000-000000.safetensors"]
    assert done_sample_keys(tmp_path / "missing") == set()


def test_writer_rejects_inconsistent_samples(tmp_path):
    w = ShardWriter(tmp_path, rank=0, shard_tokens=100)
    ids, mask, aux, last = _tensors(3)
    with pytest.raises(ValueError, match="shapes"):
        w.add("a", "d", ids, mask, aux[:2], last)
    w.add("a", "d", ids, mask, aux, last)
    with pytest.raises(ValueError, match="differs"):
        w.add("b", "d", *_tensors(3, h=8))


# --- the plan -----------------------------------------------------------------------------------


def _samples(lengths: list[int]) -> list[Sample]:
    return [Sample("d" if i % 2 else "e", f"s{i:03d}", 0, 0, n) for i, n in enumerate(lengths)]


def test_trimmed_length():
    assert trimmed_length(np.array([0, 1, 1, 0, 0], dtype=np.uint8)) == 3
    assert trimmed_length(np.array([0, 0], dtype=np.uint8)) == 0
    assert trimmed_length(np.array([1], dtype=np.uint8)) == 1


def test_deal_balances_tokens_deterministically():
    rng = random.Random(1)
    samples = _samples([rng.randint(1, 500) for _ in range(200)])
    shares = deal(samples, 3)
    assert deal(list(reversed(samples)), 3) == shares  # input order does not matter
    dealt = [s for share in shares for s in share]
    assert len(dealt) == len(samples) and set(dealt) == set(samples)
    loads = [sum(s.length for s in share) for share in shares]
    assert max(loads) - min(loads) <= 500
    for share in shares:
        assert [s.length for s in share] == sorted((s.length for s in share), reverse=True)


def test_make_batches_bounds_padded_tokens():
    samples = sorted(_samples([300, 120, 100, 90, 60, 60, 10, 5]), key=lambda s: -s.length)
    batches = make_batches(samples, 256)
    assert [s for b in batches for s in b] == samples
    assert [len(b) for b in batches] == [1, 2, 2, 3]  # 300 | 120 100 | 90 60 | 60 10 5
    for b in batches[1:]:
        assert b[0].length * len(b) <= 256


def test_token_cap_is_resume_consistent():
    samples = _samples([random.Random(2).randint(1, 100) for _ in range(100)])
    chosen = within_token_cap(samples, 2000)
    assert sum(s.length for s in chosen) <= 2000
    assert {s.dataset for s in chosen} == {"d", "e"}
    done = set(chosen[:7])  # a killed run captured some of them
    rest = within_token_cap([s for s in samples if s not in done], 2000 - sum(s.length for s in done))
    assert set(rest) | done == set(chosen)
    assert within_token_cap(samples, None) == samples


def test_load_records_trims_and_skips(records):
    samples, parts, no_loss = load_records(
        [DatasetRecords(name=ds, records_dir=str(d)) for ds, d in records["dirs"].items()], 2048
    )
    assert no_loss == 1
    by_key = {(s.dataset, s.id): s for s in samples}
    assert ("alpha", "alpha-005") not in by_key
    for key, s in by_key.items():
        row = records["rows"][key]
        n = trimmed_length(np.array(row["loss_mask"]))
        assert s.length == n
        assert parts[s.part].input_ids[s.start : s.start + n].tolist() == row["input_ids"][:n]


def test_a_rank_holds_the_tokens_of_its_own_share_only(records):
    """The capture plans from every record but keeps only its share's tokens (load_records(keep_tokens=False), then
    `held`): the held arrays are exactly the share's trimmed tokens, each sample's slice the row written."""
    datasets = [DatasetRecords(name=ds, records_dir=str(d)) for ds, d in records["dirs"].items()]
    samples, parts, _ = load_records(datasets, 2048, keep_tokens=False)
    assert samples and all(p.input_ids.size == 0 and p.loss_mask.size == 0 for p in parts)  # the plan holds no tokens
    shares = deal(samples, 3)
    seen = 0
    for share in shares:
        mine, kept = held(share, parts)
        assert [(s.dataset, s.id, s.length) for s in mine] == [(s.dataset, s.id, s.length) for s in share]
        assert (
            sum(p.input_ids.size for p in kept) == sum(p.loss_mask.size for p in kept) == sum(s.length for s in share)
        )
        for s in mine:
            row = records["rows"][(s.dataset, s.id)]
            assert kept[s.part].input_ids[s.start : s.start + s.length].tolist() == row["input_ids"][: s.length]
            assert kept[s.part].loss_mask[s.start : s.start + s.length].tolist() == [
                int(bool(x)) for x in row["loss_mask"][: s.length]
            ]
        seen += len(mine)
    assert seen == len(samples)


def test_load_records_errors_name_file_and_row(tmp_path):
    d = tmp_path / "bad"
    d.mkdir()
    schema = pa.schema([("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))])
    rows = [
        {"id": "a", "input_ids": [1, 2], "loss_mask": [0, 1]},
        {"id": "b", "input_ids": [1, 2, 3], "loss_mask": [0, 1]},
    ]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), d / "part-000000.parquet")
    with pytest.raises(ValueError, match=r"part-000000.parquet: row 1 \(id 'b'\)"):
        load_records([DatasetRecords(name="bad", records_dir=str(d))])
    rows[1]["loss_mask"] = [0, 1, 1]
    rows[0]["input_ids"] = [1, 5000]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), d / "part-000000.parquet")
    with pytest.raises(ValueError, match=r"row 0 \(id 'a'\): token id 5000"):
        load_records([DatasetRecords(name="bad", records_dir=str(d))], vocab_size=2048)
    rows[0]["input_ids"] = [1, 2]
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), d / "part-000001.parquet")
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), d / "part-000000.parquet")
    with pytest.raises(ValueError, match="id 'a' in both"):
        load_records([DatasetRecords(name="bad", records_dir=str(d))])


def test_job_validation(tmp_path):
    base = {
        "target": {"path": "t"},
        "datasets": [{"name": "a", "records_dir": "r"}],
        "out_dir": "o",
        "launch_tokens": None,
    }
    job = CaptureJobFile.model_validate(base)
    assert (job.mode, job.dtype, job.aux_layers, job.offload) == ("replicate", "auto", None, "none")
    assert CaptureJobFile.model_validate_json(job.model_dump_json()) == job
    for bad, match in (
        ({"bogus": 1}, "bogus"),
        ({"mode": "zero2"}, "mode"),
        ({"offload": "cpu"}, "zero3"),
        ({"mode": "zero3", "offload": "nvme"}, "nvme_path"),
        ({"aux_layers": [1, 1, 2]}, "aux_layers"),
        ({"max_batch_tokens": 0}, "max_batch_tokens"),
        ({"datasets": [{"name": "a", "records_dir": "r"}] * 2}, "duplicate dataset names"),
    ):
        with pytest.raises(ValueError, match=match):
            CaptureJobFile.model_validate({**base, **bad})


def test_ds_config_and_moe_leaves():
    cfg = ds_inference_config(torch.bfloat16, "nvme", "/nvme", "cuda", largest_param_numel=163840 * 7168)
    assert cfg["zero_optimization"]["stage"] == 3 and cfg["train_micro_batch_size_per_gpu"] == 1
    assert cfg["zero_optimization"]["offload_param"]["buffer_size"] >= 163840 * 7168
    assert cfg["bf16"]["enabled"] and not cfg["fp16"]["enabled"]
    assert "offload_param" not in ds_inference_config(torch.float32, "none", None, "cpu")["zero_optimization"]

    class MixtralExperts(torch.nn.Module):
        pass

    class DeepseekV3MoE(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = MixtralExperts()

    class Layer(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.mlp = DeepseekV3MoE()

    assert moe_leaf_classes(torch.nn.Sequential(Layer(), Layer())) == [DeepseekV3MoE]
    assert moe_leaf_classes(torch.nn.Sequential(torch.nn.Linear(2, 2))) == []


def test_reference_last_hidden_is_post_norm(model):
    """transformers 5 ties hidden_states[-1] to the output of the final norm (what EAGLE-3 needs)."""
    seen = []
    handle = model.model.norm.register_forward_hook(lambda m, i, o: seen.append((i[0], o)))
    try:
        with torch.no_grad():
            hs = model(torch.tensor([[3, 10, 20, 30]]), output_hidden_states=True).hidden_states
    finally:
        handle.remove()
    pre, post = seen[0]
    assert len(hs) == 9 and torch.equal(hs[-1], post) and not torch.allclose(hs[-1], pre)


# --- single process, in process -----------------------------------------------------------------


def test_single_process_token_cap_then_rest(tiny_target_dir, records, expected, tmp_path, monkeypatch, capsys):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "hidden"
    # launch_tokens caps what one launch captures (the flow passes its cap minus earlier runs' tokens)
    assert main(["--job", str(_job(tiny_target_dir, records, out, "replicate", launch_tokens=600))]) == 0
    first = {(r["dataset"], r["id"]): r["length"] for r in iter_shard_index(out)}
    assert 0 < sum(first.values()) <= 600
    assert (
        main(["--job", str(_job(tiny_target_dir, records, out, "replicate", launch_tokens=600)), "--local_rank=0"]) == 0
    )  # what the deepspeed launcher appends
    second = {(r["dataset"], r["id"]): r["length"] for r in iter_shard_index(out)}
    assert sum(second.values()) - sum(first.values()) <= 600 and len(second) < len(expected)
    first = second
    assert main(["--job", str(_job(tiny_target_dir, records, out, "replicate"))]) == 0
    _check_capture(out, expected)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("CAPTURE_PROGRESS")]
    assert (
        lines[-1] == f"CAPTURE_PROGRESS rank=0 done={len(expected) - len(first)} total={len(expected) - len(first)} "
        f"tokens={sum(e['input_ids'].numel() for e in expected.values()) - sum(first.values())}"
    )
    # Nothing left: the launch ends before loading the target (several nodes launch it anyway), the index rewritten.
    (out / "index.parquet").unlink()
    assert main(["--job", str(_job(tiny_target_dir, records, out, "replicate"))]) == 0
    captured = capsys.readouterr()
    progress = [ln for ln in captured.out.splitlines() if ln.startswith("CAPTURE_PROGRESS")]
    assert progress[-1] == "CAPTURE_PROGRESS rank=0 done=0 total=0 tokens=0"
    assert "0 pending over 1 rank(s)" in captured.err and "batches" not in captured.err
    _check_capture(out, expected)


def test_errors_exit_nonzero_with_traceback(tiny_target_dir, records, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    job = _job(tiny_target_dir, {"dirs": {"gone": tmp_path / "nowhere"}}, tmp_path / "hidden", "replicate")
    assert main(["--job", str(job)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and "nowhere" in err
    # shards of another capture setting are not mixed in
    out = tmp_path / "other"
    with ShardWriter(out, rank=0, shard_tokens=1, aux_layers=[0, 1, 2]) as w:
        w.add("x", "alpha", *_tensors(2, h=128))
    assert main(["--job", str(_job(tiny_target_dir, records, out, "replicate"))]) == 1
    assert "captured with" in capsys.readouterr().err


# --- torchrun, 2 CPU ranks ----------------------------------------------------------------------


@pytest.mark.multiprocess
@pytest.mark.parametrize("mode", ["replicate", "zero3"])
def test_torchrun_two_ranks_match_plain_forward(mode, tiny_target_dir, records, expected, tmp_path):
    out = tmp_path / "hidden"
    start = time.monotonic()
    proc = _torchrun(_job(tiny_target_dir, records, out, mode))
    worst = _check_capture(out, expected)
    print(f"{mode}: {len(expected)} samples, max abs diff {worst:.3g}, {time.monotonic() - start:.1f}s")
    assert {p.name.split("-")[1] for p in list_shards(out)} == {"000", "001"}
    finals = {}
    for line in proc.stdout.splitlines():
        if line.startswith("CAPTURE_PROGRESS"):
            fields = dict(kv.split("=") for kv in line.split()[1:])
            finals[fields["rank"]] = fields
    assert set(finals) == {"0", "1"} and all(f["done"] == f["total"] for f in finals.values())
    assert sum(int(f["done"]) for f in finals.values()) == len(expected)
    if mode == "zero3":
        # beta-long is rank 0's whole share: rank 0 pads with dummy forwards while rank 1 works
        assert "rank 0 ran 1 batches and" in proc.stderr and "holds" in proc.stderr
        assert "rank 0 ran 1 batches and 0 padding" not in proc.stderr


@pytest.mark.multiprocess
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["replicate", "zero3"])
def test_killed_capture_resumes_exactly_once(mode, tiny_target_dir, records, expected, tmp_path, procs):
    out = tmp_path / "hidden"
    job = _job(tiny_target_dir, records, out, mode, shard_tokens=120)
    with open(tmp_path / "held.log", "wb") as log:
        held = subprocess.Popen(
            launch_cmd(job, [str(REPO / "tests" / "models" / "capture" / "capture_held.py")]),
            env=cpu_env(),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + LAUNCH_TIMEOUT_S
        while not list_shards(out) and held.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polling for the file, bounded by the deadline
        assert list_shards(out), (
            f"no shard appeared (exit {held.poll()}):\n{(tmp_path / 'held.log').read_text()[-4000:]}"
        )
    finally:
        assert not procs.kill(held), "capture ranks survived SIGKILL"
    partial = done_sample_keys(out)
    assert 0 < len(partial) < len(expected)
    (out / ".shard-000-000099.safetensors.1-dead.tmp").write_bytes(b"half a shard")
    (out / ".tmpAb12Cd").write_bytes(b"half a shard")  # safetensors' save_file writes here first

    _torchrun(job)
    _check_capture(out, expected)


# --- failures: a full disk, damaged files ---------------------------------------------------------


def _disk_for(expected: dict, share: float) -> int:
    """Bytes (whole pages) that hold about `share` of the capture: ~4H float32 values a token."""
    tokens = sum(e["input_ids"].numel() for e in expected.values())
    return int(tokens * (4 * 128 * 4 + 5) * share) // 4096 * 4096


def _fill(path: Path) -> None:
    """Take every byte left on the filesystem of `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 1024)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)


def _check_partial(out_dir: Path, expected: dict) -> int:
    """Every shard on disk is whole and holds the right values, no sample twice, no temp file; return samples."""
    rows = list(iter_shard_index(out_dir))
    keys = [(r["dataset"], r["id"]) for r in rows]
    assert len(keys) == len(set(keys)) and set(keys) <= set(expected)
    for r in rows:
        got = read_sample(out_dir / r["shard"], r["offset"], r["length"])
        assert torch.allclose(got["last_hidden"], expected[(r["dataset"], r["id"])]["last_hidden"], atol=ATOL, rtol=0)
    assert not [p.name for p in out_dir.iterdir() if p.name.startswith(".")], "temp files left behind"
    return len(rows)


def test_shard_write_failures_name_the_file_and_keep_every_shard(tmp_path, tmpfs):
    with tmpfs(tmp_path / "small", 64 * 1024) as small:
        out = small / "hidden"
        w = ShardWriter(out, rank=0, shard_tokens=200)
        with pytest.raises(WriteFailed) as failed:
            for i in range(100):  # 200 tokens x 16 values x 4 B = 12.8 KB a shard: the disk holds ~4
                w.add(f"s{i}", "d", *_tensors(100, seed=i))
        kept = list_shards(out)
        assert 1 <= len(kept) < 50
        message = str(failed.value)
        assert message.startswith(f"cannot write {out / f'shard-000-{len(kept):06d}.safetensors'}: disk full: ")
        assert (
            f"bytes free on {small}. kept: {len(kept)} complete shards in {out}; the 2 sample(s) (200 tokens) "
            "this shard would have held are captured again. to resume: make room there" in message
        )
        assert failed.value.errno == errno.ENOSPC and "\n" not in message
        assert done_sample_keys(out) == {("d", f"s{i}") for i in range(2 * len(kept))}
        assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []
        _fill(small / "filler")
        with pytest.raises(
            WriteFailed,
            match=rf"^cannot write {out / 'index.parquet'}: disk full: .* kept: {len(kept)} "
            rf"complete shards in {out}; the index is rebuilt from their headers",
        ):
            write_index(out)
        tmpfs.remount(small, f"size={1024 * 1024}")  # make room: the index is written from the shards kept
        assert pq.read_table(write_index(out)).num_rows == 2 * len(kept)


def test_damaged_shard_is_named_with_what_to_do(tmp_path):
    with ShardWriter(tmp_path, rank=0, shard_tokens=1) as w:
        for i in range(2):
            w.add(f"s{i}", "d", *_tensors(3, seed=i))
    bad = tmp_path / "shard-000-000001.safetensors"
    data = bad.read_bytes()
    bad.write_bytes(data[: len(data) - 10])  # a truncated copy
    advice = "Delete it and run the capture stage again: its samples are captured again, every other shard is kept"
    for read in (lambda: shard_metadata(bad), lambda: done_sample_keys(tmp_path), lambda: read_sample(bad, 0, 3)):
        with pytest.raises(DamagedShard) as failed:
            read()
        assert str(failed.value) == (
            f"{bad} is damaged ({len(data) - 10:,} bytes, not a complete safetensors file: "
            f"incomplete metadata, file not fully covered). {advice}"
        )
    bad.write_bytes(b"not a shard")
    with pytest.raises(DamagedShard, match=r"\(11 bytes, not a complete safetensors file: "):
        shard_metadata(bad)
    from safetensors.torch import save_file

    save_file({"input_ids": torch.zeros(1)}, str(bad), metadata={"samples": "[{not json"})
    with pytest.raises(DamagedShard, match=r"no valid sample list in its header: JSONDecodeError"):
        shard_metadata(bad)
    bad.unlink()  # the advice: what is left is whole
    assert done_sample_keys(tmp_path) == {("d", "s0")}


def test_damaged_files_stop_a_rank_with_one_line(tiny_target_dir, records, tmp_path, monkeypatch, capsys):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    out = tmp_path / "hidden"
    with ShardWriter(out, rank=0, shard_tokens=1, aux_layers=AUX_LAYERS) as w:
        w.add("alpha-000", "alpha", *_tensors(2, h=128))
    shard = list_shards(out)[0]
    shard.write_bytes(shard.read_bytes()[:100])
    assert main(["--job", str(_job(tiny_target_dir, records, out, "replicate"))]) == 1
    err = capsys.readouterr().err
    assert f"capture rank 0 failed: {shard} is damaged (100 bytes, not a complete safetensors file: " in err
    assert "Traceback" not in err
    report = json.loads(next(ln for ln in err.splitlines() if ln.startswith("CAPTURE_ERROR ")).split(" ", 1)[1])
    assert (report["kind"], report["type"], report["path"]) == ("damaged", "DamagedShard", str(shard))
    shard.unlink()
    # a damaged records part: named, with the records stage's advice
    copied = tmp_path / "records"
    for ds, d in records["dirs"].items():
        (copied / ds).mkdir(parents=True)
        for part in d.iterdir():
            (copied / ds / part.name).write_bytes(part.read_bytes())
    bad = copied / "beta" / "part-000001.parquet"
    bad.write_bytes(bad.read_bytes()[:-50])
    assert (
        main(
            [
                "--job",
                str(_job(tiny_target_dir, {"dirs": {ds: copied / ds for ds in records["dirs"]}}, out, "replicate")),
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert (
        f"capture rank 0 failed: {bad} is damaged ({bad.stat().st_size:,} bytes, not a readable Parquet file: Parquet "
        "magic bytes not found in footer." in err
    )
    assert "Delete it and run the records stage again (it is rebuilt from its responses), then capture" in err
    assert "Traceback" not in err


def test_single_process_full_disk_stops_keeps_shards_and_resumes(
    tiny_target_dir, records, expected, tmp_path, monkeypatch, capsys, tmpfs
):
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    # beta-long, half the tokens, is the first shard (longest first): the disk holds it and a few more
    with tmpfs(tmp_path / "small", _disk_for(expected, 0.75)) as small:
        out = small / "hidden"
        job = _job(tiny_target_dir, records, out, "replicate", shard_tokens=200)
        assert main(["--job", str(job)]) == 1
        err = capsys.readouterr().err
        line = next(ln for ln in err.splitlines() if ln.startswith("CAPTURE_ERROR "))
        report = json.loads(line.split(" ", 1)[1])
        assert (report["kind"], report["errno"], report["rank"]) == ("write_failed", errno.ENOSPC, 0)
        assert report["message"].startswith(f"cannot write {out}/shard-000-") and "disk full: " in report["message"]
        assert f"capture rank 0 failed: {report['message']}" in err and "Traceback" not in err
        partial = _check_partial(out, expected)
        assert 0 < partial < len(expected)
        tmpfs.remount(
            small, f"size={_disk_for(expected, 3)}"
        )  # the disk grows: the rerun captures the rest, exactly once
        assert main(["--job", str(job)]) == 0
        _check_capture(out, expected)


@pytest.mark.multiprocess
def test_a_rank_that_cannot_write_stops_the_job_at_once(tiny_target_dir, records, tmp_path):
    """Rank 1's disk is full at its first shard while rank 0 is held mid-run: the launch ends at once with one line."""
    from prefect.states import Failed

    from tasks.capture.tasks import capture_retryable, run_ranks

    out = tmp_path / "hidden"
    job = _job(tiny_target_dir, records, out, "replicate", shard_tokens=120)
    lines: list[str] = []
    start = time.monotonic()
    with pytest.raises(WriteFailed) as failed:
        run_ranks(
            launch_cmd(job, [str(REPO / "tests" / "models" / "capture" / "capture_failing.py")]),
            {**cpu_env(), "CAPTURE_FAIL_RANK": "1"},
            lines.append,
        )
    elapsed = time.monotonic() - start
    message = str(failed.value)
    assert (
        message.startswith(f"cannot write {out / 'shard-001-000000.safetensors'}: disk full: ") and "\n" not in message
    )
    assert f"kept: 0 complete shards in {out}; the " in message and "to resume: make room there" in message
    assert not capture_retryable(None, None, Failed(data=failed.value))  # a retry would fill the disk again
    # rank 0 was stopped by the launcher while held (it would otherwise wait HOLD_S = 300 s, then finish)
    assert elapsed < 200, f"the launch took {elapsed:.0f} s: the held rank was not stopped"
    assert any("SIGTERM" in ln for ln in lines), "torchrun did not terminate the held rank"
    assert not [
        ln for ln in lines if ln.startswith("CAPTURE_PROGRESS rank=0") and ln.split()[2][5:] == ln.split()[3][6:] != "0"
    ]
    assert list_shards(out) == [] and not [p for p in out.iterdir() if p.name.startswith(".shard")]


@pytest.mark.multiprocess
@pytest.mark.slow
def test_torchrun_full_disk_drill(tiny_target_dir, records, expected, tmp_path, tmpfs):
    """The hidden dir on a small tmpfs: two ranks fill it; the job stops with one line.

    A rerun after it grows completes.
    """
    from tasks.capture.tasks import run_ranks

    with tmpfs(tmp_path / "small", _disk_for(expected, 0.4)) as small:
        out = small / "hidden"
        job = _job(tiny_target_dir, records, out, "replicate", shard_tokens=120)
        with pytest.raises(WriteFailed) as failed:
            run_ranks(launch_cmd(job, ["-m", "models.capture"]), cpu_env(), lambda line: None)
        assert "disk full: " in str(failed.value) and f"bytes free on {small}" in str(failed.value)
        assert "\n" not in str(failed.value)
        partial = _check_partial(out, expected)
        assert 0 < partial < len(expected)
        print(f"{partial} of {len(expected)} samples kept; the job said: {failed.value}")
        tmpfs.remount(small, f"size={_disk_for(expected, 3)}")
        _torchrun(job)
        _check_capture(out, expected)
