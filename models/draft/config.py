"""The draft's shape: `Eagle3Config`, its variants and defaults (models/draft/eagle3.py is the model)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from models.draft.rope import rope_scaling_problems, rope_type

AUX_FEATURES = 3  # target hidden states fused by fc (the engines' num_aux_hidden_states)
# `train.draft_arch`: the draft layer's attention. llama: Llama attention (q/k/v/o_proj, RoPE); mla: DeepSeek's
# multi-head latent attention with the target's MLA widths and rope (models/draft/mla.py)
DRAFT_ARCHS = ("llama", "mla")
MLA_KEYS = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")  # the target's
# `train.draft_variant` -> the Eagle3Config flags (and config.json keys) that both engines read
DRAFT_VARIANTS: dict[str, dict[str, bool]] = {
    "eagle3": {"fc_norm": False, "norm_output": False},
    "eagle3.1": {"fc_norm": True, "norm_output": True},
}
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
}


def default_aux_layers(num_layers: int) -> list[int]:
    """EAGLE-3 aux layers: outputs of 0-based decoder layers [1, L//2-1, L-4] (Kimi, L=61: [1, 29, 57])."""
    if num_layers < 8:
        raise ValueError(f"EAGLE-3 needs at least 8 target layers for distinct aux layers, got {num_layers}")
    layers = [1, num_layers // 2 - 1, num_layers - 4]
    if len(set(layers)) != 3:  # unreachable for L >= 8; kept as the invariant callers rely on
        raise ValueError(f"aux layers {layers} for {num_layers} layers are not distinct")
    return layers


@dataclass(kw_only=True)
class Eagle3Config:
    """Shape of the draft; `vocab_size` is the target's, `draft_vocab_size` the draft lm_head's."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int | None = None  # None: hidden_size // num_attention_heads (resolved on init)
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 4096  # the target's: SGLang sizes the draft's RoPE cache from it
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int | None = None  # None: hidden_size; fc input is 3 * this
    aux_layers: list[int] = field(default_factory=list)  # 0-based target layers fused by fc
    hidden_act: str = "silu"
    fc_norm: bool = False  # EAGLE-3.1: one RMSNorm(target_hidden_size) per aux feature before fc
    norm_output: bool = False  # EAGLE-3.1: the next draft step reads norm(h_out), not h_out
    # Two options other trainers use (speculators' training defaults), never set by our trainer: we read them to
    # evaluate such drafts. norm_before_fc: one RMSNorm over all 3*Ht aux features before fc (`input_norm`);
    # norm_before_residual: the layer's residual is hidden_norm(h), not h. vLLM 0.32 serves both; SGLang 0.5.23
    # only the first (models/export/sglang.py).
    norm_before_fc: bool = False
    norm_before_residual: bool = False
    # draft_arch "mla": DeepSeek-V3's attention (models/draft/mla.py), its widths the target's. rope_scaling: the
    # target's YaRN (Kimi), or None for plain RoPE; each shape applies it as its engines do (models/draft/rope.py).
    draft_arch: str = "llama"
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None
    rope_scaling: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if self.draft_arch not in DRAFT_ARCHS:
            raise ValueError(f"draft_arch {self.draft_arch!r} not one of {list(DRAFT_ARCHS)}")
        if self.draft_arch == "mla":
            self._check_mla()
        problems = rope_scaling_problems(self.rope_scaling)
        if problems:  # train.draft_rope: plain leaves the target's scaling out
            raise ValueError("; ".join(problems) + " (train.draft_rope: plain trains plain rope at the target's base)")
        if self.head_dim is None and self.draft_arch == "mla":
            self.head_dim = int(self.qk_nope_head_dim or 0) + int(self.qk_rope_head_dim or 0)  # MLA's q/k width
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"hidden_size {self.hidden_size} is not divisible by "
                    f"num_attention_heads {self.num_attention_heads}; set head_dim"
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not a multiple of "
                f"num_key_value_heads {self.num_key_value_heads}"
            )
        if not 1 <= self.draft_vocab_size <= self.vocab_size:
            raise ValueError(f"draft_vocab_size {self.draft_vocab_size} must be in [1, vocab_size={self.vocab_size}]")
        if len(self.aux_layers) != AUX_FEATURES or len(set(self.aux_layers)) != AUX_FEATURES:
            raise ValueError(f"aux_layers must be {AUX_FEATURES} distinct layer ids, got {self.aux_layers}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"hidden_act {self.hidden_act!r} not one of {sorted(ACTIVATIONS)}")
        if self.fc_norm and self.norm_before_fc:
            raise ValueError("fc_norm and norm_before_fc are exclusive: one RMSNorm per aux feature, or one over all")
        self.aux_layers = [int(i) for i in self.aux_layers]

    def _check_mla(self) -> None:
        missing = [key for key in MLA_KEYS if not isinstance(getattr(self, key), int)]
        if missing:  # q_lora_rank too: both engines fuse q_a_proj with kv_a_proj_with_mqa (no plain q_proj)
            raise ValueError(
                f"draft_arch mla needs the target's MLA widths, q_lora_rank included (SGLang 0.5.23 "
                f"kimi_k25_eagle3.py and vLLM 0.32 deepseek_eagle3.py fuse q_a_proj into the latent projection); "
                f"missing {missing}"
            )
        if int(self.qk_rope_head_dim or 0) % 2:
            raise ValueError(f"qk_rope_head_dim must be even for RoPE, got {self.qk_rope_head_dim}")
        if self.num_key_value_heads != self.num_attention_heads:
            raise ValueError("draft_arch mla: num_key_value_heads must equal num_attention_heads (MLA has no groups)")
        if self.norm_before_fc:
            raise ValueError(
                "draft_arch mla and norm_before_fc are exclusive: neither vLLM 0.32 "
                "(model_executor/models/deepseek_eagle3.py) nor SGLang 0.5.23 (srt/models/kimi_k25_eagle3.py) has an "
                "input_norm in its MLA draft"
            )

    @property
    def variant(self) -> str:
        """The `DRAFT_VARIANTS` name of the two flags (`train.draft_variant`)."""
        flags = {"fc_norm": self.fc_norm, "norm_output": self.norm_output}
        for name, want in DRAFT_VARIANTS.items():
            if flags == want:
                return name
        return f"fc_norm={self.fc_norm}, norm_output={self.norm_output}"

    @classmethod
    def from_target_config(
        cls,
        hf_config,
        draft_vocab_size: int,
        aux_layers: list[int],
        *,
        draft_arch: str = "llama",
        target_rope: bool = True,
        **overrides,
    ) -> Eagle3Config:
        """The usual draft for a target: its hidden size, heads, MLP width, RoPE base and context.

        Reads a transformers config (a multimodal one through its text config). draft_arch llama: for attention
        that is not Llama-like (MLA: Kimi/DeepSeek) the target's head_dim is ignored and hidden_size // heads is
        used; pass `overrides` (e.g. head_dim=128, rope_theta=1e6) to choose. draft_arch mla: the target's MLA
        widths. The rope: the target's scaling when it is YaRN (Kimi), for both shapes, unless `target_rope` is false
        (plain rope at the same base); another scaling type is refused for mla and left out (plain) for llama.
        """
        cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None)
        if not isinstance(head_dim, int) or hasattr(cfg, "kv_lora_rank"):
            head_dim = None
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        rope_theta = getattr(cfg, "rope_theta", None) or rope.get("rope_theta") or 10000.0
        layers = getattr(cfg, "num_hidden_layers", None)
        if layers is not None and any(not 0 <= i < layers for i in aux_layers):
            raise ValueError(f"aux_layers {aux_layers} outside the target's {layers} layers")
        values: dict[str, Any] = dict(
            hidden_size=int(cfg.hidden_size),
            intermediate_size=int(cfg.intermediate_size),
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=head_dim,
            rms_norm_eps=float(getattr(cfg, "rms_norm_eps", 1e-6)),
            rope_theta=float(rope_theta),
            max_position_embeddings=int(cfg.max_position_embeddings),
            vocab_size=int(cfg.vocab_size),
            draft_vocab_size=int(draft_vocab_size),
            target_hidden_size=int(cfg.hidden_size),
            aux_layers=list(aux_layers),
            hidden_act=str(getattr(cfg, "hidden_act", "silu")),
        )
        if draft_arch == "mla":
            if not isinstance(getattr(cfg, "kv_lora_rank", None), int):
                raise ValueError(
                    f"draft_arch mla needs an MLA target (DeepSeek-V3, Kimi-K2.x: kv_lora_rank in its config); "
                    f"this target is {getattr(cfg, 'model_type', 'unknown')!r}: use draft_arch llama"
                )
            values.update({key: getattr(cfg, key, None) for key in MLA_KEYS}, num_key_value_heads=heads, head_dim=None)
            values.update(draft_arch="mla", rope_scaling=target_rope_scaling(rope) if target_rope else None)
        elif target_rope and rope_type(target_rope_scaling(rope)) == "yarn":  # Llama-style: YaRN only (else plain)
            values.update(rope_scaling=target_rope_scaling(rope))
        values.update(overrides)
        return cls(**values)


def target_rope_scaling(rope: dict[str, Any]) -> dict[str, Any] | None:
    """A target's rope scaling as a draft config.json writes it (`rope_scaling`, the target's keys, rope_type named
    `type` too as the target's own config.json does), or None when the target has none."""
    scaling = {k: v for k, v in dict(rope).items() if k not in ("rope_theta", "partial_rotary_factor")}
    kind = scaling.get("rope_type") or scaling.get("type") or "default"
    if kind == "default":
        return None
    return {**scaling, "type": kind, "rope_type": kind}


def resolved_size(size: int | None, name: str) -> int:
    """A size Eagle3Config.__post_init__ resolves from None (head_dim, target_hidden_size)."""
    if size is None:
        raise ValueError(f"Eagle3Config.{name} is None: __post_init__ resolves it, so it was set to None afterwards")
    return size
