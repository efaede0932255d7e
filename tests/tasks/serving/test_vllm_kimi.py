"""The Kimi-K2.5-shaped tiny target (a kimi_k25 checkpoint: MLA, MoE, YaRN) against a REAL vLLM (.venv-vllm).

- Layer ids: the aux hidden states our capture stores (2 torchrun ranks under DeepSpeed ZeRO-3, the MoE blocks
  as leaf modules, the target read through models/target/loader.py) equal, numerically, the states vLLM's own
  DeepSeek model selects for the ids our export writes for vLLM (`vllm_aux_ids`), read through vLLM's offline
  API with its CPU MLA kernels (tests/tasks/serving/vllm_aux_states.py); vLLM's end-layer id L is the state
  BEFORE the final norm, ours after it: the final norm of vLLM's state is ours.
- The demo on that target through vLLM: generate, capture, train, and the engine eval with the draft, whose
  verify rounds equal the in-process eval's prompt by prompt and round by round. Its draft is the EAGLE-3.1 variant
  with the target's whole vocabulary (no d2t): the other loader paths vLLM has, beside test_vllm_real.py's EAGLE-3
  draft with a smaller draft vocabulary on the Llama target. The layer-id test reads this demo's capture.
- An MLA draft (`train.draft_arch: mla`, D < V) trained once on the demo's capture and served by each engine's own
  MLA draft class, vLLM's and (marked `sglang`) SGLang's, each counting the in-process eval's verify rounds; the
  demo's EAGLE-3.1 draft served by SGLang too (its D == V path, which test_sglang_eagle3_real.py leaves to this one).
- SGLang's own aux states (srt/models/deepseek_v2.py, read by a test plugin through SGLang's hook registry:
  tests/tasks/serving/sglang_aux_dump.py) equal, numerically, the states the demo's capture stored, at the ids our
  export writes; SGLang's greedy tokens with the demo's draft equal transformers'. (Its greedy tokens without a draft,
  through the pipeline's generate: tests/tasks/serving/test_sglang_real.py.)

Without .venv-vllm every test here skips, saying so (and the SGLang ones without .venv-sglang).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pyarrow.parquet as pq
import pytest
import torch
from safetensors import safe_open

from models.capture.shards import iter_shard_index, read_sample
from models.draft.config import default_aux_layers
from models.export.format import vllm_aux_ids
from models.target.weights import load_final_norm
from tasks.serving.vllm import shape_words
from tests.models.torchrun import cpu_env
from tests.run_configs import TEST_RANKS, TEST_TTT_STEPS
from tests.sglang_real import sglang_python
from tests.tasks.serving.test_sglang_eagle3_real import sglang_equals_in_process
from tests.tasks.serving.test_vllm_real import engine_equals_in_process
from tests.tasks.serving.vllm_capture_runs import compare_captures, recapture_with_vllm

# The module's first test builds the target (~3.5 min, unless tests/targets.py built it before) and the demo fixture
# runs every stage (~6 min on idle cores): on a busy machine they may pass pyproject's 600 s per test, so this module
# allows 30 minutes.
pytestmark = [pytest.mark.vllm, pytest.mark.multiprocess, pytest.mark.timeout(1800)]

REPO = Path(__file__).resolve().parents[3]
VLLM_PYTHON = REPO / ".venv-vllm" / "bin" / "python"
AUX_SCRIPT = Path(__file__).with_name("vllm_aux_states.py")
NUM_LAYERS = 8
# Relative to the largest value of the state: float32 through two implementations (vLLM's CPU MLA kernels,
# transformers under ZeRO-3), residual streams in the hundreds. Measured against a plain forward: up to 5e-6.
RTOL = 5e-5
# The last state is the final norm of the residual stream, whose largest values (~700 on this target) are far above
# its RMS: the norm turns the residual's float32 differences (<= ~2e-5 of 700) into up to ~2e-4 of the normed state's
# largest value (~4). Measured over the 160 records of the demo, vLLM's capture against DeepSpeed's: aux 2.0e-5,
# last 2.1e-4 (one 397-token record; most below 1e-5). A wrong layer id or a missing norm differs by more than 1e-2.
RTOL_LAST = 1e-3


def rel(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    """Max abs difference over the largest abs value of `theirs`."""
    return ((mine - theirs).abs().max() / theirs.abs().max()).item()


@pytest.fixture(scope="module")
def vllm_python() -> Path:
    if not VLLM_PYTHON.is_file():
        pytest.skip(f"no real vLLM: {VLLM_PYTHON} is missing (`make vllm` installs it; CI does)")
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def kimi_demo(vllm_python, kimi_target_dir, tmp_path_factory, prefect_harness):
    """`eagle3 demo --target kimi`, shorter (2 epochs of 3 TTT steps, TEST_TTT_STEPS: an acceptance of about 1.3
    against 1.0 untrained, measured; 24 prompts) and with an EAGLE-3.1 draft over the target's whole vocabulary:
    generate and the engine eval through vLLM (MLA as plain attention, so the Llama-style draft runs on CPU:
    tasks/serving/vllm.py shape_words), capture under ZeRO-3, train, the in-process eval. (config, what it printed)."""
    import io

    from rich.console import Console

    from cli.demo import run_demo

    out = io.StringIO()
    # no pass without the draft (eval.baseline): its speedup says nothing on CPU, and greedy with and without the
    # draft is compared on the Llama target (test_vllm_real.py); this saves a third vLLM start
    vocab = json.loads((kimi_target_dir / "config.json").read_text())["text_config"]["vocab_size"]
    short = {
        "train": {
            "epochs": 2,
            "ttt_steps": TEST_TTT_STEPS,
            "num_gpus": TEST_RANKS,  # the capture keeps the demo's 2 ranks under ZeRO-3: the layer-id test's subject
            "draft_variant": "eagle3.1",
            "draft_vocab_size": vocab,
        },
        "eval": {"prompts": 24, "max_new_tokens": 32, "baseline": False},
    }
    config = run_demo(
        run_dir=tmp_path_factory.mktemp("kimi-demo") / "run",
        console=Console(file=out, width=200),
        target_dir=kimi_target_dir,
        overrides=short,
        engine="vllm",
        target="kimi",
    )
    return config, out.getvalue()


def shortest_samples(hidden: Path, n: int = 6) -> list[dict]:
    """The `n` shortest samples (of more than 8 tokens) of the capture in `hidden`."""
    index = sorted(iter_shard_index(hidden), key=lambda r: (r["length"], r["dataset"], r["id"]))
    samples = [read_sample(hidden / r["shard"], r["offset"], r["length"]) for r in index if r["length"] > 8][:n]
    assert len(samples) == n
    return samples


def vllm_own_states(vllm_python: Path, target: Path, hidden: Path, ids: list[int], out: Path) -> tuple[list, Path]:
    """The 6 shortest samples of the capture in `hidden` (`shortest_samples`), and the file of the states vLLM's own
    model selects for them with layer ids `ids` + the end layer, read through vLLM's offline API with its CPU MLA
    kernels (tests/tasks/serving/vllm_aux_states.py): `p{i}.id{k}`."""
    samples = shortest_samples(hidden)
    request = out.with_suffix(".json")
    _, flags = shape_words(str(target))
    request.write_text(
        json.dumps(
            {
                "target": str(target),
                "layer_ids": [*ids, NUM_LAYERS],
                "prompts": [s["input_ids"].tolist() for s in samples],
                "max_model_len": 1024,
                "limit_mm_per_prompt": json.loads(flags[1]),
            }
        )
    )
    proc = subprocess.run(
        [str(vllm_python), str(AUX_SCRIPT), str(request), str(out)],
        capture_output=True,
        text=True,
        timeout=900,
        env={k: v for k, v in cpu_env().items() if k != "VLLM_MLA_DISABLE"},
    )
    assert proc.returncode == 0, f"vLLM aux script failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    assert "vllm text model: ['DeepseekV2ForCausalLM']" in proc.stdout  # vLLM's DeepSeek class (deepseek_v2.py)
    assert "Using CPU_MLA backend" in proc.stdout + proc.stderr  # vLLM ran its MLA kernels, not plain attention
    return samples, out


def check_against_vllm_own(samples: list, own: Path, target: Path, ids: list[int], rtol: float) -> float:
    """Each sample's aux states equal vLLM's own for `ids`; the final norm of vLLM's end-layer state (the state BEFORE
    the final norm) equals our stored last state; the largest relative difference."""
    cfg = json.loads((target / "config.json").read_text())["text_config"]
    norm_w = load_final_norm(target).to(torch.float32)
    worst = 0.0
    with safe_open(str(own), framework="pt") as f:
        for i, s in enumerate(samples):
            ours = s["aux_hidden"].to(torch.float32).split(cfg["hidden_size"], dim=-1)
            for k, mine in zip(ids, ours):
                theirs = f.get_tensor(f"p{i}.id{k}")
                assert theirs.shape == mine.shape
                assert rel(mine, theirs) < rtol, (i, k, rel(mine, theirs))
                worst = max(worst, rel(mine, theirs))
            end = f.get_tensor(f"p{i}.id{NUM_LAYERS}")
            last = s["last_hidden"].to(torch.float32)
            normed = end * torch.rsqrt(end.pow(2).mean(-1, keepdim=True) + cfg["rms_norm_eps"]) * norm_w
            assert rel(normed, last) < rtol, (i, rel(normed, last))
            worst = max(worst, rel(normed, last))
            assert rel(end, last) > 0.1  # not the same state: the conventions differ
        # a wrong rule (ours a -> vLLM a) selects other states: the check can fail
        first = samples[0]["aux_hidden"].to(torch.float32).split(cfg["hidden_size"], dim=-1)
        assert rel(first[1], f.get_tensor(f"p0.id{ids[1]}")) < rtol  # ours 3 == vLLM 4
        assert rel(first[2], f.get_tensor(f"p0.id{ids[1]}")) > 0.01  # ours 4 != vLLM 4
    return worst


@pytest.fixture(scope="module")
def kimi_vllm_own(vllm_python, kimi_target_dir, kimi_demo, tmp_path_factory):
    """(samples of the demo's DeepSpeed capture, vLLM's own states for them)."""
    config, _ = kimi_demo
    ids = vllm_aux_ids(default_aux_layers(NUM_LAYERS))
    out = tmp_path_factory.mktemp("vllm-own") / "vllm_aux.safetensors"
    return vllm_own_states(vllm_python, kimi_target_dir, config.layout.hidden_dir, ids, out)


def test_our_aux_states_are_the_ones_vllm_selects_with_the_ids_we_export(kimi_target_dir, kimi_demo, kimi_vllm_own):
    config, _ = kimi_demo
    # the default aux layers, 2 ranks under ZeRO-3 with the MoE blocks as leaf modules (models/capture/job.py)
    assert config.capture.mode == "zero3" and config.capture.num_gpus == 2
    ids = vllm_aux_ids(default_aux_layers(NUM_LAYERS))
    assert ids == [2, 4, 5]
    samples, own = kimi_vllm_own
    worst = check_against_vllm_own(samples, own, kimi_target_dir, ids, RTOL)
    print(f"aux states: ours vs vLLM ids {ids} (+ end layer {NUM_LAYERS}): max relative diff {worst:.2e}")


def test_the_capture_through_the_real_vllm_equals_the_deepspeed_capture_and_vllm_s_own_states(
    kimi_target_dir, kimi_demo, kimi_vllm_own, tmp_path, prefect_harness
):
    """capture.backend: vllm on the Kimi shape: the real vLLM (its CPU MLA kernels, its MoE) with our connector, over
    the demo's records, gives for every record the states the demo's DeepSpeed capture stored (ZeRO-3, 2 ranks), and,
    on the samples read through vLLM's offline API, the states vLLM's own model selects."""
    config, _ = kimi_demo
    hidden = recapture_with_vllm(config, tmp_path / "run")
    assert "Using CPU_MLA backend" in (tmp_path / "run" / "logs" / "capture-server.log").read_text()
    compared, worst_ds = compare_captures(hidden, config.layout.hidden_dir, RTOL, RTOL_LAST)
    assert compared > 40
    samples, own = kimi_vllm_own
    by_ids = {}
    for r in iter_shard_index(hidden):
        sample = read_sample(hidden / r["shard"], r["offset"], r["length"])
        by_ids[tuple(sample["input_ids"].tolist())] = sample
    ours = [by_ids[tuple(s["input_ids"].tolist())] for s in samples]  # the same records, captured through vLLM
    assert len(ours) == len(samples)
    worst_own = check_against_vllm_own(ours, own, kimi_target_dir, vllm_aux_ids(default_aux_layers(NUM_LAYERS)), RTOL)
    print(
        f"Kimi shape, vLLM capture vs DeepSpeed capture ({compared} samples): max relative diff aux "
        f"{worst_ds['aux_hidden']:.2e}, last {worst_ds['last_hidden']:.2e}; vs vLLM's own states {worst_own:.2e}"
    )


def test_the_kimi_demo_through_vllm_measures_what_the_in_process_eval_measures_prompt_by_prompt(kimi_demo):
    from models.export.sglang import validate_export
    from models.export.vllm import validate_export_vllm
    from tasks.responses.checkpoints import live_parts

    config, printed = kimi_demo
    assert config.target.tiny_shape == "kimi" and config.capture.mode == "zero3"
    command = " ".join(config.server.command or [])
    assert "VLLM_MLA_DISABLE=1" in command and "--limit-mm-per-prompt" in command
    generated = [
        r
        for d in config.datasets
        if d.kind == "generate"
        for p in live_parts(config.run_dir / "responses" / d.name)
        for r in pq.read_table(p).to_pylist()
    ]
    assert len(generated) > 40 and any(r["finish_reason"] == "stop" for r in generated)

    final = config.layout.draft_dir / "final"
    assert validate_export(final) == [] and validate_export_vllm(final) == []
    exported = json.loads((final / "config.json").read_text())
    assert exported["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's ids for ours [1, 3, 4]
    # the target's YaRN, applied as vLLM's Llama layer applies it (YaRNScalingRotaryEmbedding: models/draft/rope.py)
    assert exported["rope_scaling"]["type"] == "yarn" and exported["rope_scaling"]["factor"] == 64.0
    assert exported["fc_norm"] is True and exported["norm_output"] is True  # EAGLE-3.1
    assert exported["draft_vocab_size"] == exported["vocab_size"]
    with safe_open(str(final / "model.safetensors"), framework="pt") as f:
        assert "d2t" not in f.keys() and "t2d" not in f.keys()  # the whole vocabulary: vLLM refuses a d2t there
        norms = [f.get_tensor(f"fc_norm.{i}.weight").float() for i in range(3)]  # trained norms, not the initial
    assert not any(torch.allclose(w, torch.ones_like(w)) for w in norms)  # ones: a loader that dropped them would
    # serve other rounds, which the equality below would see
    report = json.loads(config.layout.eval_report.read_text())
    engine_equals_in_process(report, 24)
    assert report["trained"]["acceptance_length"] > report["untrained"]["acceptance_length"] + 0.05
    said = " ".join(printed.split())  # the console wraps long lines at 200 columns
    assert "engine and HF EQUAL on the same 24 prompts (24 with the same verify rounds)" in said
    assert "trained, measured by the engine (vLLM + draft)" in said


MLA_PROMPTS = 8  # each further engine eval (the MLA draft's, SGLang's): the equality needs some tokens right


@pytest.fixture(scope="module")
def mla_draft(kimi_demo, tmp_path_factory, harness_api_url) -> tuple[dict, Path]:
    """`train.draft_arch: mla` trained on the demo's capture, once for both engines: EAGLE-3 with a draft vocabulary
    smaller than the target's (the d2t path of the MLA classes; the demo's draft above is EAGLE-3.1 over the whole
    vocabulary), 2 epochs of the demo's 3 TTT steps (the equality needs a draft that gets some tokens right, not a
    good one: CI's time). (the config it was trained with, as data; the exported draft)."""
    import yaml

    from tests.tasks.serving.test_vllm_real import eagle3

    config, _ = kimi_demo
    data = yaml.safe_load(config.layout.demo_config.read_text())
    out = tmp_path_factory.mktemp("mla") / "mla-draft"
    data["train"].update(
        {"draft_arch": "mla", "draft_variant": "eagle3", "draft_vocab_size": 1024, "out_dir": str(out), "epochs": 2}
    )
    data["eval"].update({"prompts": MLA_PROMPTS, "compare_untrained": False, "benchmarks": [], "baseline": False})
    path = out.parent / "mla-train.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    done = eagle3("run", str(path), "--stages", "train", api_url=harness_api_url)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    exported = json.loads((out / "final" / "config.json").read_text())
    assert exported["architectures"] == ["Eagle3DeepseekV2ForCausalLM"] and exported["model_type"] == "deepseek_v2"
    assert exported["rope_scaling"]["factor"] == 64.0  # the target's YaRN, as trained (train.draft_rope: target)
    assert exported["kv_lora_rank"] == 512 and exported["qk_rope_head_dim"] == 64
    return data, out / "final"


def served(data: dict, final: Path, engine: str, path: Path, harness_api_url: str) -> dict:
    """`eagle3 eval CONFIG --draft FINAL` (CONFIG: `data` written to `path`), the engine eval through `engine`, which
    the eval starts (the demo's server for that engine): its report."""
    import yaml

    from cli.demo import demo_server
    from flows.config.file import load_config
    from tests.tasks.serving.test_vllm_real import eagle3

    if engine == "sglang":
        sglang_python()  # a skip that says how to get it
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    server = demo_server(load_config(path), engine, data["server"]["url"])
    data = {**data, "server": server.model_dump(mode="json", exclude_none=True)}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    config = load_config(path)
    if engine == "vllm" and config.train.draft_arch == "mla":
        assert "VLLM_MLA_DISABLE" not in " ".join(config.server.command or [])  # the MLA draft needs MLA on
    done = eagle3("eval", str(path), "--draft", str(final), api_url=harness_api_url)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, report_path, _ = config.layout.eval_of(str(final))
    return json.loads(report_path.read_text())


def test_an_mla_draft_is_served_by_vllm_with_the_in_process_eval_s_rounds(mla_draft, tmp_path, harness_api_url):
    """The MLA draft vLLM 0.32 serves as Eagle3DeepseekV2ForCausalLM (deepseek_eagle3.py: the target's MLA attention
    over [embedding; hidden], its YaRN rope, MLA kept ON so the draft and the target share the CPU MLA kernel) counts
    the in-process eval's tokens and verify rounds prompt by prompt."""
    data, final = mla_draft
    report = served(data, final, "vllm", tmp_path / "mla-vllm.yaml", harness_api_url)
    engine_equals_in_process(report, MLA_PROMPTS)
    print(f"MLA draft: acceptance {report['trained']['acceptance_length']:.3f} in-process and through vLLM")


@pytest.mark.sglang
def test_the_same_mla_draft_is_served_by_sglang_s_kimi_class_with_the_in_process_rounds(
    mla_draft, tmp_path, harness_api_url
):
    """The same draft in the real SGLang 0.5.23 (.venv-sglang), which builds it as its Kimi-K2.5 MLA draft
    (srt/models/kimi_k25_eagle3.py `Eagle3DeepseekV2ForCausalLM`; its set_embed's CUDA synchronize answered by
    deploy/sglang-cpu's plugin on a CPU torch): its own verify rounds (`spec_verify_ct`) and completion tokens equal the
    in-process eval's, prompt by prompt. Trained here once for both engines."""
    data, final = mla_draft
    report = served(data, final, "sglang", tmp_path / "mla-sglang.yaml", harness_api_url)
    sglang_equals_in_process(report, MLA_PROMPTS)
    print(f"MLA draft: acceptance {report['trained']['acceptance_length']:.3f} in-process and through SGLang")


AUX_NEW = 16  # tokens each sample is continued by in the aux test's server, greedy, against transformers'


@pytest.fixture(scope="module")
def sglang_with_the_demo_draft(kimi_demo, kimi_target_dir, tmp_path_factory):
    """One real SGLang (.venv-sglang) for the two tests below: the Kimi target, the demo's EAGLE-3.1 draft speculating
    3 tokens a round, the radix cache off (each prefill covers every token of its prompt), and the aux dump plugin on
    its path (tests/tasks/serving/sglang_aux_dump.py: the aux states SGLang's own DeepSeek model captures for EAGLE-3,
    srt/models/deepseek_v2.py, read through SGLang's hook registry, one file per request). (server, dump directory)."""
    from tasks.serving.sglang import SGLangClient
    from tests.sglang_real import start_sglang
    from tests.tasks.serving.sglang_aux_dump import ENV as AUX_DUMP_ENV
    from tests.tasks.serving.sglang_aux_dump import plugin_path

    sglang_python()  # a skip that says how to get it
    config, _ = kimi_demo
    tmp = tmp_path_factory.mktemp("sglang-eagle3.1")
    dumps = tmp / "dumps"
    dumps.mkdir()
    extra = [*SGLangClient.speculative_args(str(config.layout.draft_dir / "final"), 3), "--disable-radix-cache"]
    env = {"PYTHONPATH": str(plugin_path(tmp / "plugin")), AUX_DUMP_ENV: str(dumps)}
    server = start_sglang(kimi_target_dir, tmp / "sglang.log", context_length=1024, extra=extra, env=env)
    try:
        yield server, dumps
    finally:
        server.stop()


@pytest.mark.sglang
def test_sglang_serves_the_demo_s_eagle3_1_draft_over_the_whole_vocabulary_with_the_in_process_rounds(
    kimi_demo, sglang_with_the_demo_draft, tmp_path, harness_api_url
):
    """The demo's draft (EAGLE-3.1: `fc_norm`, `norm_output`, which SGLang 0.5.23's llama_eagle3.py reads; D == V,
    so no d2t and SGLang takes the draft's ids as they are) in the real SGLang: its own verify rounds and completion
    tokens equal the in-process eval's, prompt by prompt. `eagle3 eval` against that running server (server.launch:
    none); the MLA test above has the eval start SGLang itself with a draft."""
    import yaml

    from flows.config.file import load_config
    from tests.tasks.serving.test_vllm_real import eagle3

    config, _ = kimi_demo
    server, _ = sglang_with_the_demo_draft
    data = yaml.safe_load(config.layout.demo_config.read_text())
    data["eval"].update({"prompts": MLA_PROMPTS, "compare_untrained": False, "benchmarks": [], "baseline": False})
    data["server"] = {**data["server"], "engine": "sglang", "url": server.url, "launch": "none", "command": None}
    path = tmp_path / "eagle3.1-sglang.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    final = config.layout.draft_dir / "final"
    done = eagle3("eval", str(path), "--draft", str(final), api_url=harness_api_url)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    _, report_path, _ = load_config(path).layout.eval_of(str(final))
    report = json.loads(report_path.read_text())
    assert report["engine"]["server"]["speculative_draft_model_path"] == str(final)
    sglang_equals_in_process(report, MLA_PROMPTS)


@pytest.mark.sglang
def test_sglang_captures_for_eagle3_the_aux_states_our_capture_stored(
    kimi_demo, kimi_target_dir, sglang_with_the_demo_draft
):
    """SGLang serving the demo's draft with the dump plugin (`sglang_with_the_demo_draft`): each of 6 samples of the
    demo's capture sent as a prompt, and the states SGLang captured for it equal, numerically, the states our capture
    stored, at the ids our export writes (SGLang adds 1 to them: its rule for ids starting at 1). Its greedy
    continuation of each sample, the draft speculating, equals transformers' greedy tokens."""
    from models.target.loader import load_language_model

    config, _ = kimi_demo
    server, dumps = sglang_with_the_demo_draft
    samples = shortest_samples(config.layout.hidden_dir)
    params = {"max_new_tokens": AUX_NEW, "temperature": 0, "ignore_eos": True}
    outputs = []
    for s in samples:
        body = {"input_ids": s["input_ids"].tolist(), "sampling_params": params}
        r = httpx.post(server.url + "/generate", json=body, timeout=300)
        assert r.status_code == 200, r.text
        outputs.append(r.json()["output_ids"])
    theirs = {}
    for path in sorted(dumps.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            theirs[tuple(f.get_tensor("input_ids").tolist())] = (f.get_tensor("aux"), f.get_tensor("layers").tolist())
    hidden = json.loads((kimi_target_dir / "config.json").read_text())["text_config"]["hidden_size"]
    ours_ids = default_aux_layers(NUM_LAYERS)
    exported = json.loads((config.layout.draft_dir / "final" / "config.json").read_text())
    # what our export writes for SGLang, which reads eagle_config first (speculative/eagle_utils.py)
    assert exported["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ours_ids == [1, 3, 4]
    worst = 0.0
    for s in samples:
        aux, layers = theirs[tuple(s["input_ids"].tolist())]
        assert layers == vllm_aux_ids(ours_ids) == [2, 4, 5]  # SGLang's +1 for ids starting at 1 (deepseek_v2.py)
        mine = s["aux_hidden"].to(torch.float32)
        assert aux.shape == mine.shape == (len(s["input_ids"]), 3 * hidden)
        for k in range(3):
            part = slice(k * hidden, (k + 1) * hidden)
            assert rel(mine[:, part], aux[:, part]) < RTOL, (k, rel(mine[:, part], aux[:, part]))
            worst = max(worst, rel(mine[:, part], aux[:, part]))
    # a wrong rule (no +1) selects other states: the check can fail
    first, (aux, _) = samples[0], theirs[tuple(samples[0]["input_ids"].tolist())]
    assert rel(first["aux_hidden"].to(torch.float32)[:, 2 * hidden :], aux[:, hidden : 2 * hidden]) > 0.01
    model = load_language_model(str(kimi_target_dir), dtype=torch.float32).eval()
    with torch.no_grad():  # greedy, whole forwards, no stop token (SGLang's ignore_eos)
        for s, output in zip(samples, outputs):
            ids = s["input_ids"].long().tolist()
            for _ in range(AUX_NEW):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            assert output == ids[len(s["input_ids"]) :]
    print(f"aux states: ours vs SGLang's own (layers {layers}): max relative diff {worst:.2e}")
