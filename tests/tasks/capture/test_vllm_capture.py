"""The capture through a vLLM server (tasks/capture/vllm_capture.py) against the dev server's emulation of vLLM's
extraction.

The emulation (emulators/vllm_extract.py) is served in process through httpx's ASGI transport, so most
of these tests start no process: the vLLM backend's shards equal the DeepSpeed backend's (the rank
entry point, one process, fp32) sample by sample; replies that name a missing, truncated or
misshapen file stop the capture with nothing recorded; statuses mean what they say; a full disk
stops it at once. The kill -9 test runs the capture in a child process (tests/tasks/capture/vllm_held.py).
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import save_file

from emulators.dev_server.app import create_app
from emulators.vllm_extract import Extraction
from models.capture.job import main as capture_main
from models.capture.records import trimmed_length
from models.capture.shards import done_sample_keys, iter_shard_index, list_shards, read_sample, shard_metadata
from models.capture.vllm_hidden import ExtractionFailed, FinalNorm, engine_layer_ids, extraction_config
from models.common.file_errors import WriteFailed
from models.common.job_files import CaptureJobFile, DatasetRecords
from models.target.tiny import SAMPLES_DIR
from settings.capture import VllmCaptureSettings
from settings.target import Target
from tasks.capture.vllm_capture import RecordsRefused, capture_with_vllm, clean_connector_files
from tasks.serving.errors import AuthError, ServerOutage

REPO = Path(__file__).resolve().parents[3]
AUX_LAYERS = [1, 3, 4]  # default_aux_layers(8) of the tiny target
ATOL = 1e-5


@pytest.fixture(scope="module")
def records(tiny_target_dir, tmp_path_factory) -> dict:
    """Two datasets of records as the records stage writes them.

    {"datasets": [...], "keys": {(ds, id): trimmed length}}
    """
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_dir)
    texts = [
        json.loads(line).get("prompt") or ""
        for f in sorted(SAMPLES_DIR.glob("gen_*.jsonl"))
        for line in f.read_text(encoding="utf-8").splitlines()
    ]
    rng = random.Random(1)
    root = tmp_path_factory.mktemp("engine-records")
    datasets, keys = [], {}
    for ds, n in (("alpha", 14), ("beta", 10)):
        rows = []
        for i in range(n):
            ids = []
            while len(ids) < 6:
                ids = tok.encode(rng.choice(texts), add_special_tokens=False)[: rng.randint(6, 120)]
            tail = 2 if i % 4 == 0 else 0  # trimmed away: they train nothing
            prompt = rng.randint(1, len(ids) - 1 - tail)
            mask = [0] * prompt + [1] * (len(ids) - prompt - tail) + [0] * tail
            rows.append({"id": f"{ds}-{i:02d}", "input_ids": ids, "loss_mask": mask})
        rows[3]["loss_mask"] = [0] * len(rows[3]["loss_mask"])  # no loss token: never captured
        d = root / ds
        d.mkdir()
        schema = pa.schema(
            [("id", pa.string()), ("input_ids", pa.list_(pa.int32())), ("loss_mask", pa.list_(pa.uint8()))]
        )
        pq.write_table(pa.Table.from_pylist(rows, schema=schema), d / "part-000000.parquet")
        datasets.append(DatasetRecords(name=ds, records_dir=str(d)))
        keys.update({(ds, r["id"]): trimmed_length(np.array(r["loss_mask"])) for r in rows if any(r["loss_mask"])})
    return {"datasets": datasets, "keys": keys}


@pytest.fixture(scope="module")
def shared(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("engine-shared")


@pytest.fixture(scope="module")
def app(tiny_target_dir, shared):
    """The dev server started with vLLM's extraction flags for this capture's layers."""
    speculative, kv = extraction_config(AUX_LAYERS, 8, shared)
    return create_app(tiny_target_dir, extraction=Extraction.from_flags(json.dumps(speculative), json.dumps(kv)))


def job(target: Path, records: dict, out: Path, **over) -> CaptureJobFile:
    return CaptureJobFile(
        **{
            "target": Target(path=str(target)),
            "datasets": records["datasets"],
            "out_dir": str(out),
            "launch_tokens": None,
            "device": "cpu",
            "max_batch_tokens": 256,
            "shard_tokens": 200,
            **over,
        }
    )


def engine(**over) -> VllmCaptureSettings:
    return VllmCaptureSettings(
        **{"url": "http://vllm.test", "max_concurrency": 4, "request_timeout_s": 30, "outage_window_s": 2, **over}
    )


def run(capture_job: CaptureJobFile, settings: VllmCaptureSettings, shared_dir: Path, transport, **kw) -> dict:
    return asyncio.run(capture_with_vllm(capture_job, settings, shared_dir, transport=transport, **kw))


def deepspeed_backend(target: Path, records: dict, out: Path, monkeypatch) -> None:
    """The DeepSpeed backend's rank entry point in this process (one rank, replicate, the job file the flow writes)."""
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    path = out.parent / "capture.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(job(target, records, out, mode="replicate").model_dump_json())
    assert capture_main(["--job", str(path)]) == 0


def rows(out: Path) -> dict:
    """(dataset, id) -> the sample's four tensors; fails on a sample stored twice."""
    index = list(iter_shard_index(out))
    keys = [(r["dataset"], r["id"]) for r in index]
    assert len(keys) == len(set(keys)), "a sample was captured twice"
    return {(r["dataset"], r["id"]): read_sample(out / r["shard"], r["offset"], r["length"]) for r in index}


# --- the contract pieces ------------------------------------------------------------------------


def test_layer_ids_and_final_norm_match_hf(tiny_target_dir, app, shared):
    """vLLM id k+1 is HF hidden_states[k+1] (the output of layer k), id L is the last layer before the norm."""
    from transformers import AutoModelForCausalLM

    assert engine_layer_ids(AUX_LAYERS, 8) == [2, 4, 5, 8]
    assert engine_layer_ids([1, 29, 57], 61) == [2, 30, 58, 61]  # Kimi-K2.5
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    ids = [5, 17, 230, 9, 41, 77]
    transport = httpx.ASGITransport(app=app)

    async def ask() -> dict:
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm.test") as client:
            reply = await client.post(
                "/v1/completions",
                json={"model": str(tiny_target_dir), "prompt": ids, "max_tokens": 1, "return_token_ids": True},
            )
            assert reply.status_code == 200, reply.text
            return reply.json()

    body = asyncio.run(ask())
    assert body["choices"][0]["prompt_token_ids"] == ids and body["usage"]["prompt_tokens"] == len(ids)
    path = Path(body["kv_transfer_params"]["hidden_states_path"])
    assert path.parent == shared and path.name.endswith(".safetensors") and Path(f"{path}.lock").exists()
    from safetensors.torch import load_file

    data = load_file(str(path))
    assert data["token_ids"].dtype == torch.int64 and data["token_ids"].tolist() == ids
    assert data["hidden_states"].shape == (len(ids), 4, 128)
    with torch.no_grad():
        hs = model(torch.tensor([ids]), output_hidden_states=True).hidden_states
    for slot, k in enumerate(AUX_LAYERS):
        assert torch.equal(data["hidden_states"][:, slot], hs[k + 1][0])
    pre = data["hidden_states"][:, 3]
    assert not torch.allclose(pre, hs[-1][0], atol=1e-3)  # not normed
    assert torch.allclose(FinalNorm.load(tiny_target_dir)(pre), hs[-1][0], atol=1e-6, rtol=0)
    path.unlink()
    Path(f"{path}.lock").unlink()


def test_emulation_errors_have_vllms_body(app, tiny_target_dir):
    transport = httpx.ASGITransport(app=app)

    async def post(body: dict) -> httpx.Response:
        async with httpx.AsyncClient(transport=transport, base_url="http://vllm.test") as client:
            return await client.post("/v1/completions", json=body)

    too_long = asyncio.run(post({"prompt": [5] * 5000, "max_tokens": 1}))
    assert too_long.status_code == 400
    error = too_long.json()["error"]
    assert error["type"] == "BadRequestError" and error["code"] == 400 and error["param"] is None
    assert "maximum context length" in error["message"] and "5000 input tokens" in error["message"]
    assert (
        asyncio.run(post({"prompt": [5, 10**6], "max_tokens": 1})).json()["error"]["message"]
        == "Token id 1000000 is out of vocabulary"
    )
    missing = asyncio.run(post({"model": "other", "prompt": [5], "max_tokens": 1}))
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(ValueError, match="beyond the model's 8 layers"):
        speculative, kv = extraction_config([1, 3, 8], 8, "/tmp/x")
        create_app(tiny_target_dir, extraction=Extraction.from_flags(json.dumps(speculative), json.dumps(kv)))


# --- the backends agree -------------------------------------------------------------------------


def test_vllm_backend_shards_equal_the_deepspeed_backends(tiny_target_dir, records, app, shared, tmp_path, monkeypatch):
    deepspeed_backend(tiny_target_dir, records, tmp_path / "ds" / "hidden", monkeypatch)
    out = tmp_path / "vllm" / "hidden"
    progress = []
    start = time.monotonic()
    done = run(
        job(tiny_target_dir, records, out),
        engine(model=str(tiny_target_dir)),
        shared,
        httpx.ASGITransport(app=app),
        on_progress=lambda *a: progress.append(a),
    )
    seconds = time.monotonic() - start
    want, got = rows(tmp_path / "ds" / "hidden"), rows(out)
    assert set(got) == set(want) == set(records["keys"])
    assert done == {"samples": len(want), "tokens": sum(records["keys"].values())}
    assert progress[0] == (0, len(want), 0) and progress[-1] == (len(want), len(want), done["tokens"])
    worst = 0.0
    for key, w in want.items():
        g = got[key]
        assert torch.equal(g["input_ids"], w["input_ids"]) and torch.equal(g["loss_mask"], w["loss_mask"]), key
        for name in ("aux_hidden", "last_hidden"):
            assert g[name].dtype == w[name].dtype == torch.float32 and g[name].shape == w[name].shape, (key, name)
            worst = max(worst, (g[name] - w[name]).abs().max().item())
    assert worst <= ATOL, worst
    for a, b in zip(list_shards(out)[:1], list_shards(tmp_path / "ds" / "hidden")[:1]):
        ma, mb = shard_metadata(a), shard_metadata(b)
        assert {k: ma[k] for k in ("format", "hidden_size", "aux_layers", "dtype")} == {
            k: mb[k] for k in ("format", "hidden_size", "aux_layers", "dtype")
        }
    assert pq.read_table(out / "index.parquet").num_rows == len(want)
    assert not list(shared.iterdir()), "connector files left behind"
    print(f"vllm backend: {len(want)} samples, {done['tokens']} tokens in {seconds:.2f}s; max abs diff {worst:.2g}")
    # Run again: nothing pending, nothing sent.
    assert run(
        job(tiny_target_dir, records, out),
        engine(model=str(tiny_target_dir)),
        shared,
        httpx.MockTransport(lambda request: pytest.fail("nothing should be sent")),
    ) == {"samples": 0, "tokens": 0}


def test_token_cap_then_rest_is_exactly_once(tiny_target_dir, records, app, shared, tmp_path):
    out = tmp_path / "hidden"
    first = run(job(tiny_target_dir, records, out, launch_tokens=300), engine(), shared, httpx.ASGITransport(app=app))
    assert 0 < first["tokens"] <= 300
    rest = run(job(tiny_target_dir, records, out), engine(), shared, httpx.ASGITransport(app=app))
    assert first["samples"] + rest["samples"] == len(records["keys"])
    assert set(rows(out)) == set(records["keys"])
    assert not list(shared.iterdir())


# --- a faulty server, a full disk ---------------------------------------------------------------


def fake_server(tmp_path: Path, write) -> httpx.MockTransport:
    """A server that answers 200 and writes (with `write(path, ids)`) whatever file the test wants."""
    count = [0]

    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        count[0] += 1
        path = tmp_path / f"cmpl-{count[0]}.safetensors"
        write(path, body["prompt"])
        return httpx.Response(
            200,
            json={
                "choices": [{"index": 0, "text": "x"}],
                "usage": {"prompt_tokens": len(body["prompt"])},
                "kv_transfer_params": {"hidden_states_path": str(path)},
            },
        )

    return httpx.MockTransport(handle)


@pytest.mark.parametrize(
    "fault, message",
    [
        ("missing", "does not exist here"),
        ("truncated", "not a complete safetensors file"),
        ("three_layers", "expected [{n}, 4, 128]"),
        ("other_ids", "are not the"),
    ],
)
def test_unusable_reply_files_stop_with_nothing_recorded(fault, message, tiny_target_dir, records, tmp_path):
    def write(path: Path, ids: list[int]) -> None:
        n = len(ids)
        if fault == "missing":
            return
        tensors = {
            "token_ids": torch.tensor(ids if fault != "other_ids" else ids[::-1][:-1] + [0]),
            "hidden_states": torch.zeros(n, 3 if fault == "three_layers" else 4, 128),
        }
        save_file(tensors, str(path))
        if fault == "truncated":
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    out = tmp_path / "hidden"
    with pytest.raises(ExtractionFailed) as info:
        run(
            job(tiny_target_dir, records, out, shard_tokens=1),
            engine(max_concurrency=1),
            tmp_path / "shared",
            fake_server(tmp_path / "shared", write),
        )
    longest = max(records["keys"].values())
    assert message.format(n=longest) in str(info.value)
    assert not list_shards(out) and not done_sample_keys(out)


def test_a_file_outside_shared_dir_is_neither_read_nor_deleted(tiny_target_dir, records, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()

    def write(path: Path, ids: list[int]) -> None:  # a usable file, but not where the capture's server must write
        save_file({"token_ids": torch.tensor(ids), "hidden_states": torch.zeros(len(ids), 4, 128)}, str(path))

    out = tmp_path / "hidden"
    with pytest.raises(ExtractionFailed, match="outside capture.engine.shared_dir"):
        run(
            job(tiny_target_dir, records, out, shard_tokens=1),
            engine(max_concurrency=1),
            tmp_path / "shared",
            fake_server(elsewhere, write),
        )
    assert list(elsewhere.iterdir()) and not list_shards(out) and not done_sample_keys(out)


def test_statuses_mean_what_they_say(tiny_target_dir, records, app, shared, tmp_path):
    calls = []

    def answer(status: int, text: str = "refused"):
        def handle(request: httpx.Request) -> httpx.Response:
            calls.append(status)
            return httpx.Response(status, json={"error": {"message": text, "type": "X", "param": None, "code": status}})

        return httpx.MockTransport(handle)

    out = tmp_path / "hidden"
    with pytest.raises(AuthError):
        run(job(tiny_target_dir, records, out), engine(max_concurrency=1), tmp_path / "s", answer(401))
    assert calls == [401]  # stops at once: nothing else sent, nothing retried
    calls.clear()
    with pytest.raises(ServerOutage):
        run(
            job(tiny_target_dir, records, out),
            engine(max_concurrency=1, outage_window_s=0.3),
            tmp_path / "s",
            answer(503),
        )
    assert len(calls) >= 2 and set(calls) == {503}  # retried within the window, then a clean failure
    assert not list_shards(out)

    # 400 refuses that record only: the others are captured, then the stage names the refused one.
    real = httpx.ASGITransport(app=app)
    longest = max(records["keys"], key=records["keys"].get)

    class OneRefused(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
            if len(json.loads(request.content)["prompt"]) == records["keys"][longest]:
                return httpx.Response(
                    400,
                    json={
                        "error": {
                            "message": "This model's maximum context length is 64 tokens.",
                            "type": "BadRequestError",
                            "param": None,
                            "code": 400,
                        }
                    },
                )
            return await real.handle_async_request(request)

    with pytest.raises(RecordsRefused) as info:
        run(job(tiny_target_dir, records, out), engine(), shared, OneRefused())
    assert f"{longest[0]}/{longest[1]}" in str(info.value) and "maximum context length" in str(info.value)
    assert set(done_sample_keys(out)) == set(records["keys"]) - {longest}


def test_full_disk_stops_at_once_and_resumes(tiny_target_dir, records, app, shared, tmp_path, tmpfs):
    with tmpfs(tmp_path / "small", "160k") as small:
        out = small / "hidden"
        with pytest.raises(WriteFailed) as info:
            run(job(tiny_target_dir, records, out, shard_tokens=60), engine(), shared, httpx.ASGITransport(app=app))
        assert "No space left" in str(info.value) or "ENOSPC" in str(info.value) or "full" in str(info.value)
        partial = done_sample_keys(out)
        assert len(partial) < len(records["keys"])
        tmpfs.remount(small, "size=4m")
        run(job(tiny_target_dir, records, out, shard_tokens=60), engine(), shared, httpx.ASGITransport(app=app))
        assert set(rows(out)) == set(records["keys"])
    assert not list(shared.iterdir())


# --- kill -9 and resume -------------------------------------------------------------------------


@pytest.mark.multiprocess
def test_a_server_killed_inside_safetensors_save_file_leaves_a_temp_the_cleanup_removes(tmp_path):
    """safetensors itself (not our emulation) makes the temp name: a child killed mid-write by SIGXFSZ leaves it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    script = (
        "import resource, signal, sys, torch\n"
        "from safetensors.torch import save_file\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_DFL)\n"  # Python ignores it; the default kills, like kill -9
        "resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))\n"
        "save_file({'hidden_states': torch.zeros(100_000)}, sys.argv[1])\n"
    )
    killed = subprocess.run([sys.executable, "-c", script, str(shared / "cmpl-0-0.safetensors")], check=False)
    assert killed.returncode == -signal.SIGXFSZ
    (left,) = [p.name for p in shared.iterdir()]
    assert left.startswith(".tmp") and len(left) == 10, left  # Rust's tempfile crate: ".tmp" + 6 characters
    (shared / "notes.txt").write_text("not the connector's")
    (shared / ".tmp-mine").write_text("not safetensors' name either")
    assert clean_connector_files(shared) == 1
    assert sorted(p.name for p in shared.iterdir()) == [".tmp-mine", "notes.txt"]


def test_killed_capture_resumes_exactly_once(tiny_target_dir, records, app, shared, tmp_path, procs):
    out = tmp_path / "hidden"
    capture_job = job(tiny_target_dir, records, out, shard_tokens=120)
    (tmp_path / "job.json").write_text(capture_job.model_dump_json())
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    with open(tmp_path / "held.log", "wb") as log:
        held = subprocess.Popen(
            [sys.executable, str(REPO / "tests/tasks/capture/vllm_held.py"), str(tmp_path / "job.json"), str(shared)],
            env=env,
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 120
        while not list_shards(out) and held.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)  # polling for the file, bounded by the deadline
        assert list_shards(out), (
            f"no shard appeared (exit {held.poll()}):\n{(tmp_path / 'held.log').read_text()[-4000:]}"
        )
    finally:
        os.killpg(held.pid, signal.SIGKILL)
        held.wait(timeout=30)
    partial = done_sample_keys(out)
    assert 0 < len(partial) < len(records["keys"])
    left = [p.name for p in shared.iterdir()]
    assert left, "the killed capture held connector files (its window and its requests in flight)"

    resumed = run(capture_job, engine(), shared, httpx.ASGITransport(app=app))
    assert resumed["samples"] == len(records["keys"]) - len(partial)  # exactly the rest, once
    assert set(rows(out)) == set(records["keys"])
    assert not list(shared.iterdir()), "the killed capture's connector files were not deleted"
