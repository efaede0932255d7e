"""Random EAGLE-3 drafts over a target, exported as the engines read them: for tests where equality or loading, not
quality, is the point. And the target and random prompts such drafts are run on."""

from __future__ import annotations

import torch

from models.draft.config import DRAFT_VARIANTS, Eagle3Config, default_aux_layers
from models.draft.eagle3 import Eagle3Draft
from models.draft.vocab import draft_vocab
from models.export.eagle3 import export_draft


def random_draft(
    config: Eagle3Config, embedding: torch.Tensor, *, seed: int = 0, counts=None, cls: type[Eagle3Draft] = Eagle3Draft
) -> Eagle3Draft:
    """A draft (`cls`) of `config` with random weights (seed `seed`), the target's `embedding`, and the vocab of
    `counts` (token frequencies; default: drawn at random after the weights)."""
    draft = cls(config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "embed_tokens.weight":
                p.copy_(torch.randn(p.shape, generator=g) * (0.2 if p.ndim > 1 else 0.1) + (p.ndim == 1))
    draft.load_target_embedding(embedding)
    if counts is None:
        counts = torch.randint(0, 100, (config.vocab_size,), generator=g).numpy()
    draft.set_draft_vocab(*draft_vocab(counts, config.vocab_size, config.draft_vocab_size))
    return draft.eval()


def export_random_draft(model, out_dir, *, draft_vocab_size: int, variant: str = "eagle3"):
    """A random draft (seed 0; `variant` of DRAFT_VARIANTS) over `model`'s embedding, exported in float32
    (models/export/eagle3.py) to out_dir."""
    cfg = Eagle3Config.from_target_config(
        model.config,
        draft_vocab_size=draft_vocab_size,
        aux_layers=default_aux_layers(model.config.num_hidden_layers),
        **DRAFT_VARIANTS[variant],
    )
    draft = random_draft(cfg, model.get_input_embeddings().weight)
    return export_draft(draft, out_dir, target_config=model.config, dtype=torch.float32)


def load_target(model_dir):
    """The target at `model_dir` (a Hugging Face model directory: the tiny target) in float32, in eval mode."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def random_prompts(vocab_size: int, lengths, *, seed: int) -> list[list[int]]:
    """A prompt of each length in `lengths`, its tokens drawn (seed `seed`) from the vocab past the tiny target's
    8 special tokens."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(8, vocab_size, (n,), generator=g).tolist() for n in lengths]
