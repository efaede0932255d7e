"""The MLA draft (`draft_arch: mla`, models/draft/mla.py) against independent computations.

- Its attention and YaRN rope against transformers' own DeepSeek-V3 attention (modeling_deepseek_v3.py
  `DeepseekV3Attention` with `DeepseekV3RotaryEmbedding`: another implementation of the math vLLM's
  deepseek_v2.py serves), given the same weights and a 2H-wide input;
- its training-time test against tests/models/draft/test_eagle3.py's loop reference with an MLA query/key/value
  written out per head, its rope angles and scale taken from transformers' YaRN (`ROPE_INIT_FUNCTIONS["yarn"]`,
  `DeepseekV3Attention.scaling`): a wrong step-k mask or rope offset changes the per-step losses;
- its decoding steps on the KV cache against its TTT steps.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import DeepseekV3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3Attention, DeepseekV3RotaryEmbedding

from models.draft.caches import KVCache
from models.draft.config import Eagle3Config
from models.draft.target_head import TargetHead
from tests.models.draft.test_eagle3 import D, V, random_batch, reference_ttt, rms_reference

pytestmark = pytest.mark.usefixtures("one_torch_thread_in_module")

H = 32
# a ramp between the correction dims (beta_fast 4) and mscale != mscale_all_dim: every YaRN term is exercised
YARN = {
    "type": "yarn",
    "factor": 16.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 4.0,
    "beta_slow": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.7,
}


def mla_config(rope_scaling: dict | None = YARN, **kw) -> Eagle3Config:
    values = dict(
        hidden_size=H,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=2,
        rms_norm_eps=1e-6,
        rope_theta=50000.0,
        max_position_embeddings=1024,
        vocab_size=V,
        draft_vocab_size=D,
        aux_layers=[1, 3, 4],
        draft_arch="mla",
        q_lora_rank=24,
        kv_lora_rank=16,
        qk_nope_head_dim=8,
        qk_rope_head_dim=8,
        v_head_dim=6,  # unlike the q/k width: the value path has its own size
        rope_scaling=rope_scaling,
    )
    values.update(kw)
    return Eagle3Config(**values)


def hf_config(cfg: Eagle3Config, width: int) -> DeepseekV3Config:
    """transformers' DeepSeek-V3 config of the same attention over a `width`-wide input."""
    return DeepseekV3Config(
        vocab_size=cfg.vocab_size,
        hidden_size=width,
        intermediate_size=cfg.intermediate_size,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_attention_heads,
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_theta=cfg.rope_theta,
        rope_scaling=dict(cfg.rope_scaling) if cfg.rope_scaling else None,
        max_position_embeddings=cfg.max_position_embeddings,
        rms_norm_eps=cfg.rms_norm_eps,
        attention_bias=False,
        num_hidden_layers=1,
    )


@pytest.mark.parametrize("rope_scaling", [YARN, None], ids=["yarn", "plain"])
def test_attention_matches_transformers_deepseek_v3(rope_scaling):
    torch.manual_seed(0)
    cfg = mla_config(rope_scaling=rope_scaling)
    from models.draft.eagle3 import Eagle3Draft

    draft = Eagle3Draft(cfg).double()
    ours = draft.midlayer.self_attn
    theirs_cfg = hf_config(cfg, 2 * H)
    theirs_cfg._attn_implementation = "eager"
    theirs = DeepseekV3Attention(theirs_cfg, layer_idx=0).double()
    rotary = DeepseekV3RotaryEmbedding(theirs_cfg).double()
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim > 1 else 0.2) + (p.ndim == 1))
        for name, p in theirs.named_parameters():
            mine = ours.get_parameter(name)
            p.copy_(torch.cat([mine, torch.randn_like(mine)]) if name == "o_proj.weight" else mine)  # o_proj: 2H out

    b, s = 2, 7
    x = torch.randn(b, s, 2 * H, dtype=torch.float64)
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6], [300, 301, 302, 303, 304, 305, 306]])  # beyond the original 64
    cos, sin = draft.rotary(positions, torch.float64)
    got = ours(x, cos, sin, KVCache())  # [B, S, H], causal over the S new keys

    causal = torch.full((s, s), float("-inf"), dtype=torch.float64).triu(1)[None, None]
    want, _ = theirs(x, rotary(x, positions), attention_mask=causal)  # [B, S, 2H]
    # their rope angles are fp32 (ours fp64 in an fp64 draft): measured up to 2.7e-7 apart, outputs of size ~10
    torch.testing.assert_close(got, want[..., :H], rtol=1e-5, atol=2e-6)
    if rope_scaling:
        assert ours.score_factor == pytest.approx(theirs.scaling * math.sqrt(16)) != 1.0


def hf_rope(cfg: Eagle3Config) -> tuple[torch.Tensor, float, float]:
    """transformers' inverse frequencies and cos/sin factor for the rope part (ROPE_INIT_FUNCTIONS), and its
    attention score scale (`DeepseekV3Attention.scaling`)."""
    theirs = hf_config(cfg, 2 * H)
    kind = "yarn" if cfg.rope_scaling else "default"
    inv_freq, factor = ROPE_INIT_FUNCTIONS[kind](theirs, "cpu") if kind == "yarn" else (None, 1.0)
    if inv_freq is None:
        r = int(cfg.qk_rope_head_dim or 0)
        inv_freq = 1.0 / cfg.rope_theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r)
    return inv_freq.double(), float(factor), DeepseekV3Attention(theirs, layer_idx=0).scaling


def mla_qkv_reference(cfg: Eagle3Config):
    """An MLA query, key, value per head of one 2H input at a position, written out (the loop reference's qkv)."""
    inv_freq, cos_factor, scale = hf_rope(cfg)
    n, r, vd = int(cfg.qk_nope_head_dim or 0), int(cfg.qk_rope_head_dim or 0), int(cfg.v_head_dim or 0)
    nh, eps, lora = cfg.num_attention_heads, cfg.rms_norm_eps, int(cfg.kv_lora_rank or 0)

    def rotate(vec: torch.Tensor, pos: int) -> torch.Tensor:  # pairs (2j, 2j + 1), DeepSeek's interleaved rope
        out = vec.clone()
        for j in range(r // 2):
            a = pos * float(inv_freq[j])
            c, s = math.cos(a) * cos_factor, math.sin(a) * cos_factor
            out[2 * j] = vec[2 * j] * c - vec[2 * j + 1] * s
            out[2 * j + 1] = vec[2 * j + 1] * c + vec[2 * j] * s
        return out

    def qkv(P: dict, _cfg: Eagle3Config, x: torch.Tensor, pos: int):
        a = "midlayer.self_attn."
        q = P[a + "q_b_proj.weight"] @ rms_reference(P[a + "q_a_proj.weight"] @ x, P[a + "q_a_layernorm.weight"], eps)
        q = q.view(nh, n + r)
        latent = P[a + "kv_a_proj_with_mqa.weight"] @ x
        kv = (P[a + "kv_b_proj.weight"] @ rms_reference(latent[:lora], P[a + "kv_a_layernorm.weight"], eps)).view(
            nh, n + vd
        )
        k_rope = rotate(latent[lora:], pos)  # one rope key for every head
        queries = torch.stack([torch.cat([q[h, :n], rotate(q[h, n:], pos)]) for h in range(nh)])
        keys = torch.stack([torch.cat([kv[h, :n], k_rope]) for h in range(nh)])
        return queries, keys, kv[:, n:], scale

    return qkv


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize("seed,rope_scaling", [(0, YARN), (1, YARN), (2, None)])
def test_ttt_matches_loop_reference(seed, rope_scaling, impl):
    cfg = mla_config(rope_scaling)
    model, ids, aux, last, lm_head, loss_mask, attention_mask, position_ids = random_batch(seed, cfg=cfg)
    K = 3
    out = model.forward_ttt(
        ids,
        aux,
        TargetHead(lm_head, model.d2t)(last),
        loss_mask,
        attention_mask,
        position_ids,
        ttt_steps=K,
        attn_impl=impl,
    )
    ref = reference_ttt(
        model, ids, aux, last @ lm_head.T, loss_mask, attention_mask, position_ids, K, qkv=mla_qkv_reference(cfg)
    )
    assert out.tokens.tolist() == ref["tokens"]
    assert out.correct.tolist() == ref["correct"]
    assert out.chain_accepted.tolist() == ref["accepted"]
    torch.testing.assert_close(
        out.per_step_loss, torch.tensor(ref["per_step_loss"], dtype=torch.float64), rtol=1e-6, atol=1e-8
    )
    assert out.acceptance_length.item() == pytest.approx(ref["acceptance_length"], abs=1e-12)


def test_the_loop_reference_catches_a_missing_rope_offset():
    """The comparison is sharp enough for the bug it is there for: a draft whose step-k rope sits at pos instead of
    pos + k (its rotary called once per step, in order, and handed pos + k - k) misses the reference's losses at
    every later step by far more than the tolerance above, and still matches at step 0."""
    cfg = mla_config()
    model, ids, aux, last, lm_head, loss_mask, attention_mask, position_ids = random_batch(0, cfg=cfg)
    ref = reference_ttt(
        model, ids, aux, last @ lm_head.T, loss_mask, attention_mask, position_ids, 3, qkv=mla_qkv_reference(cfg)
    )
    calls: list[int] = []

    class WithoutOffset(torch.nn.Module):
        def __init__(self, rotary: torch.nn.Module):
            super().__init__()
            self.rotary = rotary

        def forward(self, pos: torch.Tensor, dtype: torch.dtype):
            calls.append(1)
            return self.rotary(pos - (len(calls) - 1), dtype)

    model.rotary = WithoutOffset(model.rotary)
    out = model.forward_ttt(
        ids, aux, TargetHead(lm_head, model.d2t)(last), loss_mask, attention_mask, position_ids, ttt_steps=3
    )
    gap = (out.per_step_loss - torch.tensor(ref["per_step_loss"], dtype=torch.float64)).abs()
    assert len(calls) == 3 and gap[0] < 1e-8 and gap[1:].min() > 1e-3


def test_inference_steps_equal_ttt_steps():
    model, ids, aux, last, lm_head, loss_mask, _, _ = random_batch(7, padding=False, cfg=mla_config())
    T, K = ids.shape[1], 4
    out = model.forward_ttt(ids, aux, TargetHead(lm_head, model.d2t)(last), loss_mask, ttt_steps=K, return_steps=True)
    for t in (0, 2, T - K - 1):
        step = model(ids[:, 1 : t + 2], aux[:, : t + 1])
        torch.testing.assert_close(step.logits[:, -1], out.step_logits[0][:, t], rtol=1e-10, atol=1e-10)
        for k in range(1, K):
            step = model(ids[:, t + k + 1 : t + k + 2], step.hidden[:, -1:], cache=step.cache)
            torch.testing.assert_close(step.logits[:, 0], out.step_logits[k][:, t], rtol=1e-10, atol=1e-10)


def test_config_refuses_what_no_engine_serves():
    with pytest.raises(ValueError, match="norm_before_fc"):
        mla_config(norm_before_fc=True)
    with pytest.raises(ValueError, match="missing"):
        mla_config(kv_lora_rank=None)
    with pytest.raises(ValueError, match=r"missing \['q_lora_rank'\]"):
        mla_config(q_lora_rank=None)
    with pytest.raises(ValueError, match="not supported"):
        mla_config(rope_scaling={"type": "dynamic", "factor": 2.0})
