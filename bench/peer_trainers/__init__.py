"""The reference trainers bench/peers.py compares ours with: vLLM's speculators and SGLang's SpecForge.

Each peer is one module here (speculators.py, specforge.py) with the same two functions:

    ensure_venv(root: Path) -> Path
        the peer's own virtual environment under `root` (made once, a stamp file marks it complete), with the CPU
        build of torch==2.13.0 pinned so no CUDA torch is pulled, the peer's pinned version installed and the
        patches of patches/<peer>/ applied to its installed source; returns its python.

    train(python: Path, job: PeerJob, work: Path) -> PeerRun
        the demo's training split converted to the peer's data format (in this process, with our readers), then the
        peer's own training command run in its venv on CPU with the job's settings; returns where its draft is and
        what the training cost.

A patch is a file of ours under patches/<peer>/ that says at its top what it changes and why (CPU only: a device
hard-coded to cuda, an import of a GPU-only package, an op without a CPU kernel); nothing else in the peer changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class PeerJob:
    """One draft to train: the same data and settings for every trainer.

    `run_dir` is a finished demo run (settings/layout.py RunLayout): its resolved config (RUN_DIR/config.yaml),
    its records, its captured hidden states (RUN_DIR/hidden, models/capture/shards.py) and its trained draft
    (RUN_DIR/draft/final: config.json, model.safetensors with `d2t` and `t2d`, the draft vocabulary every trainer
    uses). Training samples are the run's training split (models/train/data.py `split_samples` with the config's
    held-out fraction): the held-out ones are not trained on, by anyone.
    """

    run_dir: Path
    target: Path  # the target checkpoint (embeddings, lm_head, tokenizer)
    epochs: int = 20
    lr: float = 0.002
    ttt_steps: int = 7  # training-time test steps (our train.ttt_steps; speculators/SpecForge `ttt_length`)
    max_batch_tokens: int = 512  # tokens packed per optimizer step (one rank, no accumulation)
    num_layers: int = 1
    seed: int = 0


@dataclass(frozen=True)
class PeerRun:
    """What a peer's training produced and cost."""

    trainer: str  # e.g. "speculators 0.9.0"
    draft_dir: Path  # loads in vLLM 0.32 (speculative method eagle3) and in `eagle3 eval --draft DIR`
    optimizer_steps: int
    trained_tokens: int  # tokens the optimizer saw over all epochs (every position of every packed sample)
    train_s: float  # wall seconds of the peer's training command (its start-up included)
    prepare_s: float  # wall seconds of converting the data to its format
