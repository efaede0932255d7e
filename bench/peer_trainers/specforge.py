"""SGLang's SpecForge 0.2.0 as a peer trainer: its offline EAGLE-3 training (`specforge train`) on our split, on CPU.

The data: the demo run's training split (models/train/data.py `HiddenSource` + `split_samples`, the code path
models/train/job.py takes, samples cut to `max_batch_tokens` as ours are) written one sample per `.ckpt` file in
SpecForge's offline feature format, with our draft vocabulary (d2t/t2d of RUN_DIR/draft/final) as its
`vocab_mapping_path`, so SpecForge does not count its own. Its draft config is a 1-layer `LlamaForCausalLMEagle3`
built from the target's config, with our draft vocabulary size and the captured aux layers.

Batching: SpecForge cannot pack; its loader pads `batch_size` whole samples to the longest one and drops the
epoch's last incomplete batch. We give it the batch size whose steps per epoch come nearest ours (training samples /
our 512-token packs per epoch: 98 / 34 -> 3 on the demo), so both take about as many optimizer steps over about as
many tokens each.

Set from the job: epochs, learning rate, ttt_length, seed, layers (1; SpecForge fixes EAGLE-3 at 1), data.max_length
(= max_batch_tokens, the cut ours makes). Everything else is SpecForge's recipe (specforge/config/schema.py,
optimizer.py, modeling/draft/llama3_eagle.py), left at its defaults:

- optimizer: `BF16Optimizer`, AdamW (betas (0.9, 0.999), the torch default; no weight decay) over fp32 master
  weights of a bf16 model, grad clip 0.5, cosine schedule to 0 with 1.5 % warm-up (ours: betas (0.9, 0.95), 5 %
  warm-up);
- precision: the draft, the frozen target lm_head (`TargetHead`) and the stored hidden states in bfloat16 (ours: fp32
  on CPU);
- init: embedding copied from the target and frozen; lm_head, fc and the decoder layer randomly initialised
  (transformers `post_init`, normal std `initializer_range`); no fc norms, final `norm` on the output (its
  `norm_output` default);
- loss: per-TTT-step losses weighted 0.8**i (`ploss_decay`), soft targets = the target's softmax over the draft
  vocabulary; data loader with 4 prefetch workers.

For CPU, two of its settings change (its own config keys, no code): `training.fsdp_sharding: NO_SHARD` (DDP over
gloo; FSDP refuses a machine without an accelerator) and `training.attention_backend: sdpa` (its default
flex_attention has no CPU backward); on one process both compute the same as the defaults. One patch
(patches/specforge/01-loss-without-triton.patch, applied to the installed package; its header says why) runs its
triton loss kernel's math in eager torch.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

from bench.peer_trainers import PeerJob, PeerRun

VERSION = "0.2.0"
TRAINER = f"SpecForge {VERSION}"
TORCH = "torch==2.13.0"  # the CPU build on this machine's disk (Makefile $(VLLM_STAMP)); a constraint for every install
# What its offline training imports (cli.py, training/, launch.py, data/, modeling/), at SpecForge's own pins where
# it has one (transformers); the rest of its declared dependencies (sglang, its CUDA torch, wandb, yunchang, ...) is
# for online capture, tracking and sequence parallelism, none of which an offline CPU run touches.
RUNTIME_DEPS = (
    "transformers==5.8.1",
    "accelerate",
    "safetensors",
    "pydantic",
    "pyyaml",
    "numpy",
    "tqdm",
    "psutil",
    "huggingface-hub",
    "datasets",  # imported by specforge/data/utils.py, the offline collator's module
)
PATCHES = Path(__file__).parent / "patches" / "specforge"
VENV = "venv-specforge"
STAMP = ".installed"
RUN_ID = "peer"  # SpecForge's run_id: checkpoints are OUTPUT/{RUN_ID}-step{N}
# The target config fields SpecForge's own generator copies into a draft config (training/model_loading.py
# _TARGET_ARCHITECTURE_FIELDS), plus transformers 5's rope_parameters.
TARGET_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rms_norm_eps",
    "hidden_act",
    "initializer_range",
    "attention_bias",
    "attention_dropout",
    "head_dim",
    "rope_theta",
    "rope_scaling",
    "rope_parameters",
    "bos_token_id",
    "eos_token_id",
    "pad_token_id",
)


# --- the venv


def _recipe() -> str:
    """What the stamp records: the packages and each patch's digest (a changed recipe makes a fresh venv)."""
    patches = [f"{p.name} {hashlib.sha256(p.read_bytes()).hexdigest()[:16]}" for p in sorted(PATCHES.glob("*.patch"))]
    return "\n".join([TORCH, f"specforge=={VERSION} --no-deps", *RUNTIME_DEPS, *patches]) + "\n"


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "install", "-q", *args], check=True)


def _site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def _apply_patches(python: Path) -> None:
    """Apply every patches/specforge/*.patch to the installed package, in name order."""
    site = _site_packages(python)
    for patch in sorted(PATCHES.glob("*.patch")):
        done = subprocess.run(
            ["patch", "-p1", "--forward", "-d", str(site), "-i", str(patch)], capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"{patch} does not apply to specforge {VERSION} in {site}:\n{done.stdout}{done.stderr}\n"
                f"fix the patch against that version, then delete {site.parents[2]} and run again"
            )


def ensure_venv(root: Path) -> Path:
    """ROOT/venv-specforge with CPU torch, specforge 0.2.0 (no deps), its offline runtime deps and our patches."""
    venv = Path(root) / VENV
    python = venv / "bin" / "python"
    stamp = venv / STAMP
    recipe = _recipe()
    if stamp.is_file() and stamp.read_text() == recipe:
        return python
    if venv.exists():  # half made, or made by another recipe: patches do not apply twice
        shutil.rmtree(venv)
    venv.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH + "\n")
    _pip(python, TORCH)
    _pip(python, "-c", str(constraints), "--no-deps", f"specforge=={VERSION}")
    _pip(python, "-c", str(constraints), *RUNTIME_DEPS)
    _apply_patches(python)
    stamp.write_text(recipe)
    return python


# --- the data, in SpecForge's formats


def _run_config(run_dir: Path):
    """The run's resolved config (RUN_DIR/config.yaml, else the demo's demo-config.yaml)."""
    from flows.config.file import load_config
    from settings.layout import RunLayout

    layout = RunLayout(run_dir)
    for path in (layout.config, layout.demo_config):
        if path.is_file():
            return load_config(path)
    raise FileNotFoundError(f"{run_dir}: neither config.yaml nor demo-config.yaml; give PeerJob.run_dir a finished run")


def _training_samples(job: PeerJob) -> list:
    """Our training split, exactly as models/train/job.py builds it (same cut, same held-out hash), in a stable
    order."""
    from models.train.data import HiddenSource, split_samples

    config = _run_config(job.run_dir)
    source = HiddenSource(config.layout.hidden_dir, job.max_batch_tokens)
    train, _ = split_samples(source.samples, config.train.eval_fraction)
    if not train:
        raise ValueError(f"{config.layout.hidden_dir}: no training samples (all held out or none captured)")
    return sorted(train, key=lambda s: (s.dataset, s.id))


def _write_features(samples: list, out: Path) -> None:
    """One `.ckpt` per sample, SpecForge's offline EAGLE-3 features (runtime/data_plane/offline_reader.py keys).

    algorithms/eagle3/data.py `normalize_offline_sample` reads `aux_hidden_state` [1, T, 3H] as the draft's input and
    `hidden_state` [1, T, H] as the teacher, which training/strategies/base.py `_prepare_eagle_target` feeds straight
    to the target's lm_head (modeling/target/target_head.py `TargetHead.forward` = `fc` only, no norm): so it is
    the final hidden state after the final norm, our `last_hidden`. bfloat16, the dtype its capture stores and its
    bf16 model takes without a cast.
    """
    from models.capture.shards import read_sample

    out.mkdir(parents=True, exist_ok=True)
    for i, s in enumerate(samples):  # file names sort in this order: SpecForge lists them sorted
        part = read_sample(s.ref[0], s.ref[1], s.length)
        torch.save(
            {
                "input_ids": part["input_ids"].to(torch.int64),
                "loss_mask": part["loss_mask"].to(torch.int64),
                "hidden_state": part["last_hidden"].to(torch.bfloat16)[None],
                "aux_hidden_state": part["aux_hidden"].to(torch.bfloat16)[None],
            },
            out / f"{i:06d}.ckpt",
        )


def _draft_vocab(run_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(d2t [D] int64 offsets, t2d [V] bool) of the run's trained draft: the vocabulary every trainer uses."""
    from settings.layout import RunLayout

    path = RunLayout(run_dir).final / "model.safetensors"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no trained draft; let the demo run finish its train stage first")
    with safe_open(str(path), framework="pt") as f:
        return f.get_tensor("d2t").to(torch.int64), f.get_tensor("t2d").bool()


def _write_target(target: Path, out: Path) -> None:
    """The target as SpecForge's TargetHead reads it: its files linked, plus a safetensors index if it has none.

    modeling/target/target_head.py `load_weights` finds lm_head only through `*.index.json`; a single-file
    checkpoint (the tiny target) has none, so one is written here, mapping every tensor to model.safetensors.
    """
    out.mkdir(parents=True, exist_ok=True)
    for f in target.iterdir():
        link = out / f.name
        if not link.exists():
            link.symlink_to(f.resolve())
    if list(target.glob("*.index.json")):
        return
    weights = target / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"{target}: neither model.safetensors nor a *.index.json; give a HF checkpoint")
    with safe_open(str(weights), framework="pt") as f:
        weight_map = {k: weights.name for k in f.keys()}
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def _draft_config(job: PeerJob, draft_vocab_size: int) -> dict:
    """A `LlamaForCausalLMEagle3` config from the target's (SpecForge's own field list) with our vocab and aux layers.

    The aux layers come from our draft's config.json (both SGLang's `eagle_config` and vLLM's top-level ids), so a
    server feeds this draft the layers its data was captured from; SpecForge's norm and fc options stay unset.
    """
    from settings.layout import RunLayout

    target = json.loads((job.target / "config.json").read_text())
    target = target.get("text_config", target)
    ours = json.loads((RunLayout(job.run_dir).final / "config.json").read_text())
    config = {k: target[k] for k in TARGET_FIELDS if target.get(k) is not None}
    config.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=job.num_layers,
        draft_vocab_size=draft_vocab_size,
        # fc's input is 3 x this (SpecForge, SGLang and vLLM default it to hidden_size); `eagle3 eval`'s loader
        # (models/export/sglang.py) wants it written
        target_hidden_size=target["hidden_size"],
        tie_word_embeddings=False,
        use_cache=True,
    )
    config.setdefault("pad_token_id", 0)  # SpecForge's generator does the same
    for key in ("eagle_config", "eagle_aux_hidden_state_layer_ids"):
        if key in ours:
            config[key] = ours[key]
    return config


def _batch_size(samples: list, max_batch_tokens: int, seed: int) -> int:
    """Samples per SpecForge step whose steps per epoch come nearest ours (models/train/data.py `epoch_batches`)."""
    from models.train.data import epoch_batches

    packs = len(epoch_batches(samples, max_batch_tokens, seed, 0))
    return max(1, round(len(samples) / packs))


def _run_yaml(job: PeerJob, work: Path, batch_size: int) -> dict:
    """SpecForge's run config (config/schema.py `Config`): only what the job sets and where the files are."""
    return {
        "run_id": RUN_ID,
        "output_dir": str(work / "output"),
        "model": {
            "target_model_path": str(work / "target"),
            "draft_model_config": str(work / "draft_config.json"),
            "draft_num_hidden_layers": job.num_layers,
            "vocab_mapping_path": str(work / "vocab_mapping.pt"),
        },
        "data": {
            "hidden_states_path": str(work / "features"),
            "max_length": job.max_batch_tokens,
            "cache_dir": str(work / "cache"),
        },
        "training": {
            "num_epochs": job.epochs,
            "batch_size": batch_size,
            "learning_rate": job.lr,
            "ttt_length": job.ttt_steps,
            "seed": job.seed,
            "log_interval": 10,
            # CPU, through SpecForge's own settings (no patch): FSDP refuses a CPU-only machine ("FSDP needs a non-CPU
            # accelerator device"); NO_SHARD is its DDP path over gloo, the same math on one process.
            "fsdp_sharding": "NO_SHARD",
            # Its default flex_attention has no CPU backward ("FlexAttention does not support backward on CPU"); sdpa
            # is its other exact attention for EAGLE-3.
            "attention_backend": "sdpa",
        },
    }


def prepare(job: PeerJob, work: Path) -> tuple[int, int]:
    """Write features, vocab, target view, draft config and run config under `work`; (batch size, samples)."""
    import yaml

    samples = _training_samples(job)
    _write_features(samples, work / "features")
    d2t, t2d = _draft_vocab(job.run_dir)
    torch.save({"d2t": d2t, "t2d": t2d}, work / "vocab_mapping.pt")  # modeling/draft/base.py load_vocab_mapping
    _write_target(job.target, work / "target")
    (work / "draft_config.json").write_text(json.dumps(_draft_config(job, int(d2t.shape[0])), indent=2))
    batch_size = _batch_size(samples, job.max_batch_tokens, job.seed)
    (work / "specforge.yaml").write_text(yaml.safe_dump(_run_yaml(job, work, batch_size), sort_keys=False))
    (work / "lengths.json").write_text(json.dumps([s.length for s in samples]))
    return batch_size, len(samples)


# --- training and export


def _specforge(python: Path, args: list[str], log: Path) -> None:
    """`python -m specforge.cli ARGS` on CPU, its output appended to `log`; raises naming the log on failure."""
    env = {**os.environ, "SPECFORGE_DEVICE": "cpu", "CUDA_VISIBLE_DEVICES": ""}
    with log.open("a") as out:
        out.write(f"$ {python} -m specforge.cli {' '.join(args)}\n")
        out.flush()
        command = [str(python), "-m", "specforge.cli", *args]
        done = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    if done.returncode != 0:
        raise RuntimeError(f"specforge {args[0]} failed (exit {done.returncode}); its output is in {log}")


def _final_checkpoint(output: Path) -> tuple[Path, int]:
    """(checkpoint dir, optimizer steps) of the run's last checkpoint, OUTPUT/peer-step{N} (training/checkpoint.py)."""
    pattern = re.compile(rf"{RUN_ID}-step(\d+)")
    steps = [(int(m.group(1)), p) for p in output.iterdir() if (m := pattern.fullmatch(p.name))]
    if not steps:
        raise FileNotFoundError(f"{output}: SpecForge wrote no checkpoint; see train.log beside it")
    step, path = max(steps)
    return path, step


def _trained_tokens(lengths: list[int], batch_size: int, epochs: int, seed: int) -> int:
    """Positions the optimizer saw: each epoch's first (n // B) * B samples of SpecForge's shuffled order.

    The order is launch.py `_distributed_sampler_indices` on one rank (randperm under seed + epoch); the loader
    (training/trainer.py, drop_last=True) drops the incomplete last batch. Padding is not counted.
    """
    n = len(lengths)
    used = (n // batch_size) * batch_size
    total = 0
    for epoch in range(epochs):
        generator = torch.Generator()
        generator.manual_seed(seed + epoch)
        total += sum(lengths[i] for i in torch.randperm(n, generator=generator).tolist()[:used])
    return total


def train(python: Path, job: PeerJob, work: Path) -> PeerRun:
    """Convert our split to SpecForge's format, run `specforge train` on CPU, export the final draft SGLang-style."""
    work = Path(work)
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.monotonic()
    batch_size, _ = prepare(job, work)
    prepare_s = time.monotonic() - started

    log = work / "train.log"
    started = time.monotonic()
    _specforge(python, ["train", "--config", str(work / "specforge.yaml")], log)
    train_s = time.monotonic() - started

    checkpoint, steps = _final_checkpoint(work / "output")
    draft = work / "exported"  # the SGLang-style export of the last checkpoint
    _specforge(
        python,
        [
            "export",
            "--to",
            "sglang",
            "--checkpoint",
            str(checkpoint),
            "--draft-config",
            str(work / "draft_config.json"),
            "--output-dir",
            str(draft),
        ],
        log,
    )
    lengths = json.loads((work / "lengths.json").read_text())
    return PeerRun(
        trainer=TRAINER,
        draft_dir=draft,
        optimizer_steps=steps,
        trained_tokens=_trained_tokens(lengths, batch_size, job.epochs, job.seed),
        train_s=round(train_s, 1),
        prepare_s=round(prepare_s, 1),
    )
