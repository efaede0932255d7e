"""The served draft: `load_served_draft`, an EAGLE-3 export loaded as SGLang 0.5.23 (or 0.4.x) serves it.

srt/models/llama_eagle3.py: fc_norm and norm_output read by 0.5.23 only, ``norm_before_residual`` by
neither, and the target's input embedding taken when the hidden sizes match (SGLang's EAGLEWorker). An MLA draft
(Eagle3DeepseekV2ForCausalLM) is 0.5.23's srt/models/kimi_k25_eagle3.py, with the same three rules; whether 0.4.x
has that class was not checked.
"""

from __future__ import annotations

from pathlib import Path

import torch

from emulators.sglang_protocol.versions import V05, SGLangVersion


def load_served_draft(draft_dir: str | Path, target, version: SGLangVersion = V05):
    """The exported draft in float32, checked against the target; SGLang's embedding rule (create_app).

    As SGLang `version` serves it: 0.4 reads no EAGLE-3.1 keys (`SGLangVersion.reads_eagle31_keys`), so
    its draft has no fc_norm and feeds each step the pre-norm state, whatever the export says. No version
    reads the speculators format (no `speculators_config` in sglang 0.5.23) or `norm_before_residual`
    (srt/models/llama_eagle3.py `LlamaDecoderLayer.forward` keeps the raw hidden state as the residual).
    """
    from models.export.eagle3 import load_exported_draft
    from models.export.rules import read_export_config

    if read_export_config(Path(draft_dir))[1]:
        raise ValueError(
            f"--speculative-draft-model-path {draft_dir}: a speculators-format draft, which SGLang does not read "
            "(eagle3 export CONFIG --draft DIR --format sglang writes one it reads)"
        )
    draft = load_exported_draft(draft_dir, dtype=torch.float32).eval()
    draft.midlayer.norm_before_residual = draft.config.norm_before_residual = False  # as SGLang serves it
    if not version.reads_eagle31_keys:
        draft.fc_norm = None
        draft.config.fc_norm = draft.config.norm_output = False
    cfg, tcfg = draft.config, target.config
    if cfg.vocab_size != tcfg.vocab_size or cfg.target_hidden_size != tcfg.hidden_size:
        raise ValueError(
            f"draft {draft_dir} (vocab {cfg.vocab_size}, target hidden {cfg.target_hidden_size}) does not "
            f"fit the target (vocab {tcfg.vocab_size}, hidden {tcfg.hidden_size})"
        )
    if max(cfg.aux_layers) >= tcfg.num_hidden_layers:
        raise ValueError(
            f"draft {draft_dir}: aux layers {cfg.aux_layers} beyond the target's {tcfg.num_hidden_layers} layers"
        )
    if cfg.hidden_size == tcfg.hidden_size:  # SGLang's EAGLEWorker: set_embed(target embedding)
        draft.load_target_embedding(target.get_input_embeddings().weight.detach().float())
    return draft
