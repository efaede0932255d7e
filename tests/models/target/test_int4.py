"""Kimi-K2.5's INT4 format (models/target/int4.py): the tiny target written in it, and the loader reading it dense.

The independent source for the packing is compressed-tensors' own decompressor (PackedQuantizationCompressor, the
version vLLM 0.32 pins); for the model, a plain transformers forward of a dense checkpoint of those decompressed
weights; for ZeRO-3, the capture's replicate mode.
"""

from __future__ import annotations

import json
import random
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from models.target import int4
from models.target.loader import load_language_model
from models.target.tiny import build_int4_target, build_kimi_target
from settings.target import Target
from tests.models.torchrun import REPO, cpu_env, launch_cmd

IDS = torch.tensor([[9, 300, 17, 1200, 5, 44, 801, 2, 66, 1500, 12, 3, 700, 31, 1999, 8]])


def _decompressed(packed: dict[str, torch.Tensor]) -> torch.Tensor:
    """compressed-tensors' own decompression of one module's tensors."""
    from compressed_tensors.compressors import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationScheme

    scheme = QuantizationScheme.model_validate(int4.QUANTIZATION_CONFIG["config_groups"]["group_0"])
    return PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]


def _modules(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's packed modules: name -> {weight_packed, weight_scale, weight_shape}."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for name in f.keys():
            if name.endswith(int4.PACKED):
                module = name.removesuffix(int4.PACKED)
                out[module] = {k: f.get_tensor(module + k) for k in (int4.PACKED, int4.SCALE, int4.SHAPE)}
    return out


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> tuple[Path, Path]:
    """(the float32 Kimi build, its INT4 build), random weights (seconds): the format needs the shape only."""
    root = tmp_path_factory.mktemp("int4")
    base = build_kimi_target(root / "kimi", train_steps=0)
    return base, build_int4_target(root / "kimi-int4", base_dir=base, train_steps=0)


def test_the_config_is_kimi_k25s_recipe_and_only_routed_experts_are_packed(builds):
    base, quantized = builds
    config = json.loads((quantized / "config.json").read_text())
    assert "quantization_config" not in config  # Kimi-K2.5 keeps it under text_config
    recipe = config["text_config"]["quantization_config"]
    assert recipe == int4.QUANTIZATION_CONFIG
    weights = recipe["config_groups"]["group_0"]["weights"]
    assert (weights["num_bits"], weights["group_size"], weights["symmetric"], weights["strategy"]) == (
        4,
        32,
        True,
        "group",
    )
    assert (recipe["format"], recipe["quantization_status"]) == ("pack-quantized", "compressed")
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        base_names = set(f.keys())
    with safe_open(str(quantized / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        dtypes = {f.get_slice(n).get_dtype() for n in names if not n.endswith((int4.PACKED, int4.SHAPE))}
    routed = {n for n in base_names if ".mlp.experts." in n}
    assert len(routed) == 7 * 8 * 3  # layers 1-7 MoE, 8 experts, gate/up/down
    assert names == (base_names - routed) | {
        n.removesuffix("weight") + k for n in routed for k in (int4.PACKED, int4.SCALE, int4.SHAPE)
    }
    assert dtypes == {"F32"}  # everything else keeps the base's dtype
    for module, t in _modules(quantized).items():
        out_features, in_features = t[int4.SHAPE].tolist()
        assert t[int4.PACKED].dtype == torch.int32 and t[int4.PACKED].shape == (out_features, in_features // 8)
        assert t[int4.SCALE].shape == (out_features, in_features // 32), module


def test_packing_round_trips_like_compressed_tensors_decompressor(builds):
    """Our dequantize equals compressed-tensors' decompression bit for bit, and stays within half a step (scale / 2)
    of the float32 weight it packed, the 7.5-step range's top clamped to 7 (min-max symmetric int4)."""
    base, quantized = builds
    modules = _modules(quantized)
    assert modules
    with safe_open(str(base / "model.safetensors"), framework="pt") as f:
        for module, t in modules.items():
            ours = int4.dequantize(t[int4.PACKED], t[int4.SCALE], t[int4.SHAPE])
            assert torch.equal(ours, _decompressed(t)), module
            w = f.get_tensor(module + "weight")
            step = t[int4.SCALE].repeat_interleave(32, dim=1)
            assert ((ours - w).abs() <= step * 0.5001).all(), module  # 0.5 and float rounding
            assert ours.unique().numel() > 16  # scaled per group: more values than one group's 16


def test_the_int4_build_is_reproducible_byte_for_byte(builds, tmp_path):
    from typer.testing import CliRunner

    from cli.app import app

    base, quantized = builds
    again = tmp_path / "again"
    result = CliRunner().invoke(
        app, ["tiny-target", str(again), "--shape", "kimi", "--quantize", "int4", "--train-steps", "0"]
    )
    assert result.exit_code == 0, result.output
    files = sorted(p.name for p in quantized.iterdir())
    assert sorted(p.name for p in again.iterdir()) == files
    for name in files:
        assert (again / name).read_bytes() == (quantized / name).read_bytes(), name
    assert json.loads((quantized / "tiny_target.json").read_text())["quantize"] == "int4"
    refused = CliRunner().invoke(app, ["tiny-target", str(tmp_path / "x"), "--quantize", "int4"])
    assert refused.exit_code == 2 and "kimi shape" in refused.output


def test_the_loaded_int4_model_is_transformers_on_the_dequantized_weights(builds, tmp_path):
    """load_language_model reads the INT4 checkpoint dense; the reference is a plain kimi_k25 checkpoint of
    compressed-tensors' decompressed weights, loaded by transformers (from_pretrained) with no quantizer."""
    _, quantized = builds
    dense = tmp_path / "dense"
    dense.mkdir()
    for p in quantized.iterdir():
        if p.name not in ("model.safetensors", "config.json"):
            (dense / p.name).write_bytes(p.read_bytes())
    config = json.loads((quantized / "config.json").read_text())
    del config["text_config"]["quantization_config"]
    (dense / "config.json").write_text(json.dumps(config))
    modules = _modules(quantized)
    with safe_open(str(quantized / "model.safetensors"), framework="pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys() if not n.endswith((int4.PACKED, int4.SCALE, int4.SHAPE))}
    tensors.update({module + "weight": _decompressed(t) for module, t in modules.items()})
    save_file(tensors, str(dense / "model.safetensors"), metadata={"format": "pt"})

    ours = load_language_model(str(quantized), dtype=torch.float32)
    reference = load_language_model(str(dense), dtype=torch.float32)
    assert not ours.training and type(ours) is type(reference)
    with torch.no_grad():
        a = ours(IDS, output_hidden_states=True)
        b = reference(IDS, output_hidden_states=True)
    worst = max((x - y).abs().max().item() for x, y in zip(a.hidden_states, b.hidden_states, strict=True))
    print(f"INT4 load vs transformers on the decompressed weights: max |diff| of hidden states {worst:.3g}")
    assert worst == 0.0  # the same float32 weights, the same forward
    assert torch.equal(a.logits, b.logits)
    routed = ours.model.layers[1].mlp.experts.gate_up_proj  # [E, 2I, H]: expert 3's gate rows first, then its up rows
    prefix = "language_model.model.layers.1.mlp.experts.3."
    want = torch.cat([_decompressed(modules[prefix + "gate_proj."]), _decompressed(modules[prefix + "up_proj."])])
    assert torch.equal(routed[3], want)


def test_an_unhandled_quantization_format_is_refused_with_what_to_do(builds, tmp_path):
    _, quantized = builds
    other = tmp_path / "fp8"
    other.mkdir()
    for p in quantized.iterdir():
        (other / p.name).symlink_to(p)
    (other / "config.json").unlink()
    config = json.loads((quantized / "config.json").read_text())
    recipe = config["text_config"]["quantization_config"]
    recipe["format"] = "float-quantized"
    recipe["config_groups"]["group_0"]["weights"].update(num_bits=8, type="float")
    (other / "config.json").write_text(json.dumps(config))
    with pytest.raises(NotImplementedError, match=r"fp8/config.json: quantization_config .*float-quantized.*BF16"):
        load_language_model(str(other), dtype=torch.float32)


# --- under ZeRO-3: the capture's two modes --------------------------------------------------------------------------


def _capture_job(target: Path, tmp_path: Path, mode: str) -> tuple[Path, Path]:
    """(job JSON, out dir): 6 records of 12-40 tokens on `target`, captured in `mode`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from models.common.job_files import CaptureJobFile, DatasetRecords
    from tasks.records.build import RECORD_SCHEMA
    from tasks.runtime.launch_ranks import write_job

    records = tmp_path / "records"
    if not records.exists():
        rng = random.Random(0)
        rows = []
        for i in range(6):
            n, prompt = rng.randint(12, 40), rng.randint(2, 8)
            ids = [rng.randrange(8, 2000) for _ in range(n)]
            rows.append(
                {
                    "id": f"r{i}",
                    "input_ids": ids,
                    "loss_mask": [0] * prompt + [1] * (n - prompt),
                    "num_tokens": n,
                    "num_loss_tokens": n - prompt,
                    "truncated": False,
                }
            )
        records.mkdir()
        pq.write_table(pa.Table.from_pylist(rows, schema=RECORD_SCHEMA), records / "part-000000.parquet")
    out = tmp_path / f"hidden-{mode}"
    job = CaptureJobFile(
        target=Target(path=str(target)),
        datasets=[DatasetRecords(name="d", records_dir=str(records))],
        out_dir=str(out),
        device="cpu",
        mode=mode,
        launch_tokens=None,
    )
    path = tmp_path / f"capture-{mode}.json"
    write_job(job, path, kept=lambda: "nothing", resume="rerun")
    return path, out


def _captured(out: Path) -> dict[str, dict[str, torch.Tensor]]:
    from models.capture.shards import iter_shard_index, read_sample

    return {r["id"]: read_sample(out / r["shard"], r["offset"], r["length"]) for r in iter_shard_index(out)}


@pytest.mark.multiprocess
def test_zero3_capture_of_the_int4_target_equals_the_replicated_one(builds, tmp_path):
    """Two gloo ranks under ZeRO-3 load the INT4 target partitioned, layer by layer, and capture what one process
    captures with the whole model (replicate mode, no DeepSpeed)."""
    from models.capture.job import main

    _, quantized = builds
    job, replicated = _capture_job(quantized, tmp_path, "replicate")
    assert main(["--job", str(job)]) == 0
    job, zero3 = _capture_job(quantized, tmp_path, "zero3")
    proc = subprocess.run(
        launch_cmd(job, ["-m", "models.capture"]),
        env=cpu_env(),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"capture failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "holds" in proc.stderr  # each rank holds its partition only (models/capture/job.py logs it)
    want, got = _captured(replicated), _captured(zero3)
    assert set(got) == set(want) and len(want) == 6
    worst = 0.0
    for key, sample in want.items():
        assert torch.equal(got[key]["input_ids"], sample["input_ids"])
        for name in ("aux_hidden", "last_hidden"):
            worst = max(worst, (got[key][name] - sample[name]).abs().max().item())
    print(f"ZeRO-3 (2 ranks) vs replicate capture of the INT4 target: max |diff| {worst:.3g}")
    assert worst <= 1e-5  # float32; batching and padding differ between the modes' ranks
