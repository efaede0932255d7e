"""vLLM's speculators 0.9.0 as a peer trainer: the demo's EAGLE-3 draft trained by `python -m speculators.train`.

The venv (`ROOT/venv-speculators`) holds the CPU build of torch 2.13.0, speculators 0.9.0 installed against it
(a constraints file pins torch, else pip pulls CUDA torch 2.14.1), no torchvision/torchaudio (pip pulls builds for
another torch whose import breaks `import transformers`'s model classes), and the patches of patches/speculators/.

Data (speculators/train/data.py `ArrowDataset`, hs_connectors/transfer.py `FileTransfer`): DATA is a `datasets`
directory (`load_from_disk`, torch format) with columns input_ids [n] int64, loss_mask [n] int64 and seq_len, and
DATA/hidden_states/hs_{i}.safetensors for row i with token_ids [n] and hidden_states [n, 4, H]: the three aux
layers' states, then the verifier's last hidden state. Rows are our training split followed by our held-out split,
and `--train-data-ratio` cuts exactly between them, so speculators validates on our held-out samples and trains on
nothing else. Each sample is cut to max_batch_tokens, as our trainer cuts it (models/train/data.py HiddenSource).

The last hidden state: speculators/models/eagle3/core.py `Eagle3DraftModel.forward` computes its targets as
`verifier_lm_head(verifier_norm(verifier_last_hidden_states))`, verifier_norm being the target's final norm
(`model.norm.weight`, model.py `_load_verifier_weights`): it wants the state BEFORE the final norm (vLLM's
extract_hidden_states capture of layer id num_layers). Our shards hold it AFTER the norm, y = w * x / rms(x). RMSNorm
is scale-invariant, so we store y / w = x / rms(x): verifier_norm gives back w * x / rms(x) = y (to eps = 1e-6)
and the targets are the target's own logits over the draft vocabulary.

Settings from the job: 1 layer, ttt_steps, lr, epochs, max_batch_tokens as `--total-seq-len` (samples packed into
one sequence per optimizer step, one process), seed, our aux layers (as vLLM ids, `--target-layer-ids`) and our
draft vocabulary (d2t, t2d of RUN_DIR/draft/final, `--d2t-path/--t2d-path`: not recomputed). CPU-only choices,
which change no math: `--loss-implementation eager` (the default "fused" one is a Triton kernel, no CPU build),
`--draft-attn-impl sdpa` (the default simple_flex_attention raises "FlexAttention does not support backward on CPU";
sdpa applies the same document/sliding-window/TTT mask densely; it is not saved in config.json, so vLLM is not
affected) and `--num-workers 0` (the data is tiny; twelve spawned workers would compete for the CPUs).

speculators' own defaults, kept (their recipe, which ours differs from): the Muon optimizer for 2-D weights
(muon_lr = lr, momentum 0.95, weight decay 0.1, match_rms_adamw) with AdamW (weight decay 0.01) for the rest; a
linear schedule with 1% warmup, to zero; grad-norm clip 1.0; kl_div loss over the draft vocabulary, every TTT step
weighted equally; bf16 autocast (hidden states cast to bf16, fp32 master weights); lm_head initialised from the
target's lm_head rows of the draft vocabulary, embeddings from the target's and frozen; norm_before_residual,
norm_before_fc (an RMSNorm over the concatenated aux states) and norm_output all true; a 2048-token sliding
window on the layer's attention (longer than any pack here).
Ours (the demo config): AdamW (betas 0.9/0.95, no weight decay), cosine to zero after 5% warmup, clip 0.5, random
lm_head init, and all three norm flags false.

The draft is speculators' last epoch checkpoint, CHECKPOINTS/<epochs-1>: config.json (speculators_config) and
model.safetensors with layers.0.*, fc, norm, input_norm, lm_head, d2t, t2d and embed_tokens (the target's, frozen);
vLLM 0.32 loads it as an EAGLE-3 draft, `eagle3 eval --draft DIR` reads it (models/export/speculators.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from bench.peer_trainers import PeerJob, PeerRun

if TYPE_CHECKING:
    from models.train.data import TrainSample

VERSION = "0.9.0"
TRAINER = f"speculators {VERSION}"
TORCH_PIN = "torch==2.13.0"  # the CPU build, from this machine's wheel directory (Makefile $(VLLM_STAMP))
BROKEN_EXTRAS = ("torchvision", "torchaudio")  # pulled by speculators, built for another torch
VENV_NAME = "venv-speculators"
STAMP_NAME = ".installed"
PATCH_DIR = Path(__file__).parent / "patches" / "speculators"

DATA_DIR = "speculators-data"  # under `work`: the converted training data
CHECKPOINTS_DIR = "speculators-checkpoints"  # under `work`: speculators' --save-path, one directory per epoch
LOGS_DIR = "speculators-logs"  # under `work`: speculators' --log-dir
LOG_NAME = "speculators-train.log"  # under `work`: the training command's stdout and stderr
HIDDEN_STATES_DIR = "hidden_states"  # hs_connectors FileTransfer's default, DATA/hidden_states


# --- the venv -------------------------------------------------------------------------------------------------


def ensure_venv(root: Path) -> Path:
    """The python of ROOT/venv-speculators, made once: CPU torch, speculators 0.9.0, our patches; a stamp marks it done.

    A venv without its stamp is an interrupted install (maybe patched already): it is removed and made again.
    """
    venv = Path(root) / VENV_NAME
    python = venv / "bin" / "python"
    stamp = venv / STAMP_NAME
    if stamp.is_file():
        return python
    if venv.exists():
        shutil.rmtree(venv)
    _run([sys.executable, "-m", "venv", str(venv)], f"making the venv {venv}")
    _install(python, venv)
    site = _site_packages(python)
    for patch in sorted(PATCH_DIR.glob("*.patch")):
        _run(["patch", "-p1", "--batch", "-d", str(site), "-i", str(patch)], f"applying {patch} to {site}")
    _run([str(python), "-c", "import speculators.train.cli"], f"importing speculators in {venv}")
    stamp.write_text(f"{TRAINER}, {TORCH_PIN} (cpu), patches: {[p.name for p in sorted(PATCH_DIR.glob('*.patch'))]}\n")
    return python


def _install(python: Path, venv: Path) -> None:
    """CPU torch first, then speculators with torch pinned to it, then drop the extras built for another torch."""
    pip = [str(python), "-m", "pip", "install", "-q"]
    _run([*pip, TORCH_PIN], f"installing {TORCH_PIN} into {venv}")
    constraints = venv / "constraints.txt"
    constraints.write_text(TORCH_PIN + "\n")
    _run([*pip, "-c", str(constraints), f"speculators=={VERSION}"], f"installing speculators {VERSION} into {venv}")
    uninstall = [str(python), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS]
    _run(uninstall, f"removing {', '.join(BROKEN_EXTRAS)} from {venv}")


def _site_packages(python: Path) -> Path:
    """The venv's site-packages directory, as its python reports it."""
    code = "import sysconfig; print(sysconfig.get_paths()['purelib'])"
    return Path(subprocess.run([str(python), "-c", code], check=True, capture_output=True, text=True).stdout.strip())


def _run(cmd: list[str], what: str) -> None:
    """Run a set-up command; on failure raise with its output and what to do."""
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"{what} failed (exit {done.returncode}): {' '.join(cmd)}\n{done.stdout[-3000:]}{done.stderr[-3000:]}\n"
            "Fix the cause above, then call ensure_venv again (it starts the venv over)."
        )


# --- the data -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Prepared:
    """The converted data: where it is and what speculators needs to read it as we split it."""

    data_dir: Path
    d2t_path: Path
    t2d_path: Path
    draft_vocab_size: int
    vllm_aux_layers: list[int]  # speculators' --target-layer-ids (vLLM capture indices)
    train_samples: int
    train_tokens: int  # tokens of one epoch of the training split
    held_out_samples: int

    @property
    def train_data_ratio(self) -> float:
        """The ratio whose int(rows * ratio) is exactly the training rows (data.py ArrowDataset's split)."""
        return (self.train_samples + 0.5) / (self.train_samples + self.held_out_samples)


def prepare_data(job: PeerJob, out: Path) -> Prepared:
    """Write the run's training split, then its held-out split, in speculators' offline format under `out`."""
    from flows.config.file import load_config
    from models.export.format import vllm_aux_ids
    from models.train.data import HiddenSource, split_samples
    from settings.layout import RunLayout

    layout = RunLayout(job.run_dir)
    config = load_config(layout.config)
    source = HiddenSource(layout.hidden_dir, job.max_batch_tokens)  # samples cut to max_batch_tokens, as ours
    train, held = split_samples(source.samples, config.train.eval_fraction)
    if not train or not held:
        raise ValueError(
            f"{layout.hidden_dir}: {len(train)} training and {len(held)} held-out samples; speculators needs both "
            f"(train.eval_fraction {config.train.eval_fraction} in {layout.config}): capture more records"
        )
    if out.exists():
        shutil.rmtree(out)
    (out / HIDDEN_STATES_DIR).mkdir(parents=True)
    final_norm = _final_norm(job.target)
    rows = [_write_sample(s, i, final_norm, out / HIDDEN_STATES_DIR) for i, s in enumerate(train + held)]
    _write_rows(rows, out)
    d2t_path, t2d_path, vocab = _write_vocab(layout.final / "model.safetensors", out)
    return Prepared(
        data_dir=out,
        d2t_path=d2t_path,
        t2d_path=t2d_path,
        draft_vocab_size=vocab,
        vllm_aux_layers=vllm_aux_ids(_aux_layers(layout.hidden_dir)),
        train_samples=len(train),
        train_tokens=sum(s.length for s in train),
        held_out_samples=len(held),
    )


def _final_norm(target: Path) -> torch.Tensor:
    """The target's final-norm weight [H] in float32; refused when an entry is 0 (the state could not be un-normed)."""
    from models.target.weights import load_final_norm

    weight = load_final_norm(target).float()
    if bool((weight == 0).any()):
        raise ValueError(f"{target}: the final norm weight has zeros; the pre-norm state cannot be recovered from ours")
    return weight


def _write_sample(sample: TrainSample, index: int, norm: torch.Tensor, hidden_dir: Path) -> dict[str, torch.Tensor]:
    """hs_{index}.safetensors for one sample; returns its dataset row (input_ids, loss_mask: int64 [n])."""
    from models.capture.shards import read_sample

    part = read_sample(sample.ref[0], sample.ref[1], sample.length)
    n, h = part["last_hidden"].shape
    aux = part["aux_hidden"].float().view(n, 3, h)  # [n, 3H] -> [n, 3, H]: the aux layers in capture order
    pre_norm = (part["last_hidden"].float() / norm).view(n, 1, h)  # [n, 1, H], rms 1: see the module docstring
    input_ids = part["input_ids"].long()
    tensors = {"hidden_states": torch.cat([aux, pre_norm], dim=1).contiguous(), "token_ids": input_ids}  # [n, 4, H]
    save_file(tensors, str(hidden_dir / f"hs_{index}.safetensors"))
    return {"input_ids": input_ids, "loss_mask": part["loss_mask"].long()}


def _write_rows(rows: list[dict[str, torch.Tensor]], out: Path) -> None:
    """The `datasets` directory ArrowDataset loads: input_ids, loss_mask, seq_len, torch format."""
    from datasets import Dataset

    data = Dataset.from_dict(
        {
            "input_ids": [r["input_ids"].tolist() for r in rows],
            "loss_mask": [r["loss_mask"].tolist() for r in rows],
            "seq_len": [len(r["input_ids"]) for r in rows],
        }
    )
    data.set_format(type="torch")
    data.save_to_disk(str(out))


def _write_vocab(draft_weights: Path, out: Path) -> tuple[Path, Path, int]:
    """Our draft vocabulary as speculators' .npy files: d2t int64 offsets [D], t2d bool [V] (the same convention)."""
    if not draft_weights.is_file():
        raise FileNotFoundError(f"{draft_weights}: no trained draft; finish the demo run's train stage first")
    tensors = load_file(str(draft_weights))
    d2t, t2d = tensors["d2t"].long(), tensors["t2d"].bool()
    d2t_path, t2d_path = out / f"d2t-{len(d2t)}.npy", out / f"t2d-{len(d2t)}.npy"
    np.save(d2t_path, d2t.numpy())
    np.save(t2d_path, t2d.numpy())
    return d2t_path, t2d_path, len(d2t)


def _aux_layers(hidden_dir: Path) -> list[int]:
    """Our aux layer ids (0-based layer outputs), from the capture's shard metadata."""
    from models.capture.shards import list_shards, shard_metadata

    layers = {tuple(shard_metadata(p)["aux_layers"]) for p in list_shards(hidden_dir)}
    if len(layers) != 1:
        raise ValueError(f"{hidden_dir}: shards name aux layers {sorted(layers)}; expected one set, capture again")
    return list(layers.pop())


# --- training -------------------------------------------------------------------------------------------------


def train(python: Path, job: PeerJob, work: Path) -> PeerRun:
    """Convert the demo's data, run speculators' trainer on it on CPU, return its last-epoch draft and its cost."""
    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    prepared = prepare_data(job, work / DATA_DIR)
    prepare_s = time.perf_counter() - started

    save_path = work / CHECKPOINTS_DIR
    if save_path.exists():  # speculators resumes from what it finds there: start clean
        shutil.rmtree(save_path)
    log_path = work / LOG_NAME
    started = time.perf_counter()
    _run_training(python, train_command(python, job, prepared, work), log_path, work)
    train_s = time.perf_counter() - started

    draft_dir = save_path / str(job.epochs - 1)
    steps = _optimizer_steps(draft_dir, log_path)
    return PeerRun(
        trainer=TRAINER,
        draft_dir=draft_dir,
        optimizer_steps=steps,
        trained_tokens=prepared.train_tokens * job.epochs,  # each sample once an epoch: none is longer than a pack
        train_s=train_s,
        prepare_s=prepare_s,
    )


def train_command(python: Path, job: PeerJob, prepared: Prepared, work: Path) -> list[str]:
    """`python -m speculators.train` with the job's settings; everything else is speculators' default."""
    return [
        str(python),
        "-m",
        "speculators.train",
        *("--speculator-type", "eagle3"),
        *("--verifier-name-or-path", str(job.target)),
        *("--data-path", str(prepared.data_dir)),
        *("--on-missing", "raise"),  # every sample is on disk; never ask a vLLM server for one
        *("--train-data-ratio", repr(prepared.train_data_ratio)),
        *("--d2t-path", str(prepared.d2t_path)),
        *("--t2d-path", str(prepared.t2d_path)),
        *("--draft-vocab-size", str(prepared.draft_vocab_size)),
        *("--target-layer-ids", *map(str, prepared.vllm_aux_layers)),
        *("--num-layers", str(job.num_layers)),
        *("--ttt-steps", str(job.ttt_steps)),
        *("--lr", repr(job.lr)),
        *("--epochs", str(job.epochs)),
        *("--total-seq-len", str(job.max_batch_tokens)),
        *("--seed", str(job.seed)),
        *("--loss-implementation", "eager"),  # CPU: the fused loss is a Triton kernel
        *("--draft-attn-impl", "sdpa"),  # CPU: torch's flex_attention has no CPU backward
        *("--num-workers", "0"),
        # CPU: fp32 compute, as ours trains on a CPU. Its default, bf16 autocast, runs a step of this tiny draft in
        # ~7 s here (bf16 matmuls without AMX), fp32 in a fraction of that; master weights are fp32 either way
        *("--hidden-states-dtype", "float32"),
        *("--save-path", str(work / CHECKPOINTS_DIR)),
        *("--log-dir", str(work / LOGS_DIR)),
    ]


def _run_training(python: Path, cmd: list[str], log_path: Path, cwd: Path) -> None:
    """Run the training command, its output to `log_path`; raise naming the log when it fails."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "CUDA_VISIBLE_DEVICES": ""}
    with log_path.open("w") as log:
        log.write(" ".join(cmd) + "\n\n")
        log.flush()
        code = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=cwd, env=env).returncode
    if code != 0:
        raise RuntimeError(
            f"speculators training failed (exit {code}); its output is in {log_path}. Fix the cause there; if it "
            f"is speculators' own code, add a patch under {PATCH_DIR} and remove {python.parent.parent} to reinstall."
        )


def _optimizer_steps(draft_dir: Path, log_path: Path) -> int:
    """Optimizer steps taken, from the last checkpoint's training_state.json (trainer.py `_save_training_state`)."""
    state_path = draft_dir / "training_state.json"
    for needed in (draft_dir / "config.json", draft_dir / "model.safetensors", state_path):
        if not needed.is_file():
            raise FileNotFoundError(f"{needed}: missing after training; see {log_path}")
    return int(json.loads(state_path.read_text())["global_step"])
