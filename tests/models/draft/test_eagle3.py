"""EAGLE-3 draft: the vectorized training-time test against a plain loop reference, the draft
vocab, gradients, and inference steps against TTT steps."""

from __future__ import annotations

import math
import types

import numpy as np
import pytest
import torch

from models.draft.caches import KVCache
from models.draft.config import Eagle3Config, default_aux_layers
from models.draft.eagle3 import Eagle3Draft
from models.draft.layers import RotaryEmbedding, apply_rope
from models.draft.target_head import TargetHead
from models.draft.vocab import draft_to_target_ids, draft_vocab, draft_vocab_coverage, load_token_counts
from models.target.tiny_kimi import KIMI_FIXED
from settings.train import STEP_DECAY
from tests.kimi_k25 import kimi_k25_config

V, D = 12, 5  # small vocabs: some target argmaxes fall outside the draft vocab, some draft guesses hit

pytestmark = pytest.mark.usefixtures("one_torch_thread_in_module")  # these tensors are tiny


def _config(num_kv_heads: int = 1, **kw) -> Eagle3Config:
    values = dict(
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=num_kv_heads,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=64,
        vocab_size=V,
        draft_vocab_size=D,
        aux_layers=[1, 3, 4],
    )
    values.update(kw)
    return Eagle3Config(**values)


# the two variants as the EAGLE-3.1 report and both engines define them: (fc_norm, norm_output)
VARIANTS = {"eagle3": (False, False), "eagle3.1": (True, True)}


def random_batch(
    seed: int,
    num_kv_heads: int = 1,
    B: int = 2,
    T: int = 9,
    padding: bool = True,
    variant: str = "eagle3",
    cfg: Eagle3Config | None = None,
):
    """A random fp64 draft (random norm weights too), a random target head and a random batch; `cfg` instead of
    the Llama-style test config of `num_kv_heads` and `variant` (tests/models/draft/test_mla.py)."""
    g = torch.Generator().manual_seed(seed)
    fc_norm, norm_output = VARIANTS[variant]
    cfg = cfg or _config(num_kv_heads, fc_norm=fc_norm, norm_output=norm_output)
    model = Eagle3Draft(cfg).double()
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(
                torch.randn(p.shape, generator=g, dtype=torch.float64) * (0.3 if p.ndim > 1 else 0.2) + (p.ndim == 1)
            )
    counts = torch.randint(0, 50, (V,), generator=g).numpy()
    d2t, t2d = draft_vocab(counts, V, D)
    model.set_draft_vocab(d2t, t2d)
    ids = torch.randint(0, V, (B, T), generator=g)
    # three features of different scales, as a target's early, middle and late layers are
    aux = torch.randn(B, T, 3 * cfg.hidden_size, generator=g, dtype=torch.float64)
    aux *= torch.tensor([0.5, 4.0, 20.0], dtype=torch.float64).repeat_interleave(cfg.hidden_size)
    last = torch.randn(B, T, cfg.hidden_size, generator=g, dtype=torch.float64)
    lm_head = torch.randn(V, cfg.hidden_size, generator=g, dtype=torch.float64)
    loss_mask = torch.rand(B, T, generator=g) > 0.25
    attention_mask = torch.ones(B, T, dtype=torch.bool)
    if padding:  # sample 1 is left-padded by 2 (its positions start at 0 on the first real token)
        attention_mask[1, :2] = False
        loss_mask[1, :2] = False
    position_ids = (attention_mask.long().cumsum(1) - 1).clamp(min=0)
    return model, ids, aux, last, lm_head, loss_mask, attention_mask, position_ids


# ----------------------------------------------------------------------------- loop reference


def rms_reference(x, w, eps):
    return w * x / math.sqrt(float((x * x).mean()) + eps)


def _rope(vec, pos, theta):
    """Rotate pairs (i, i + hd/2) by pos * theta^(-2i/hd), one pair at a time."""
    hd = vec.shape[0]
    out = vec.clone()
    for i in range(hd // 2):
        a = pos * theta ** (-2.0 * i / hd)
        x1, x2 = vec[i], vec[i + hd // 2]
        out[i] = x1 * math.cos(a) - x2 * math.sin(a)
        out[i + hd // 2] = x2 * math.cos(a) + x1 * math.sin(a)
    return out


def _softmax(xs):
    m = max(xs)
    e = [math.exp(x - m) for x in xs]
    return [x / sum(e) for x in e]


def llama_qkv(P: dict, cfg: Eagle3Config, x: torch.Tensor, pos: int):
    """Llama attention's query [nh, hd], key and value [nkv, hd] of one 2H input at `pos`, and the score scale."""
    nh, nkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    q = (P["midlayer.self_attn.q_proj.weight"] @ x).view(nh, hd)
    kk = (P["midlayer.self_attn.k_proj.weight"] @ x).view(nkv, hd)
    q = torch.stack([_rope(q[h], pos, cfg.rope_theta) for h in range(nh)])
    kk = torch.stack([_rope(kk[h], pos, cfg.rope_theta) for h in range(nkv)])
    return q, kk, (P["midlayer.self_attn.v_proj.weight"] @ x).view(nkv, hd), 1 / math.sqrt(hd)


def reference_ttt(
    model,
    ids,
    aux,
    full_target_logits,
    loss_mask,
    attention_mask,
    position_ids,
    K,
    fc_norm=False,
    norm_output=False,
    qkv=llama_qkv,
):
    """Training-time test written out position by position, from the spec, with Python loops.

    full_target_logits[b, j] is the target's [V] logits at position j (predicting token j+1).
    EAGLE-3.1 (`fc_norm`, `norm_output`): each of the three aux features goes through its own RMSNorm
    before fc, and the next step reads the post-norm output instead of the pre-norm one.
    `qkv(params, config, x, position)`: one input's query, key, value per head and the score scale (Llama's here;
    MLA's in tests/models/draft/test_mla.py).
    """
    cfg = model.config
    P = {name: p.detach() for name, p in model.named_parameters()}
    emb = model.embed_tokens.weight.detach()
    t2d = model.t2d.tolist()
    draft_ids = [j for j in range(cfg.vocab_size) if t2d[j]]
    nh, nkv, eps = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.rms_norm_eps
    B, T = ids.shape
    loss_sum, valid, tokens, correct = [0.0] * K, [0] * K, [0] * K, [0] * K
    reached, accepted = [0] * K, [0] * K
    for b in range(B):
        if fc_norm:
            H = cfg.hidden_size
            hidden = [
                P["fc.weight"]
                @ torch.cat(
                    [rms_reference(aux[b, t, i * H : (i + 1) * H], P[f"fc_norm.{i}.weight"], eps) for i in range(3)]
                )
                for t in range(T)
            ]
        else:
            hidden = [P["fc.weight"] @ aux[b, t] for t in range(T)]
        keys, values, scale = {}, {}, 0.0  # (step, position) -> [nkv, hd]
        hit = [[False] * K for _ in range(T)]
        counted = [[False] * K for _ in range(T)]
        for k in range(K):
            queries = []
            for t in range(T):
                tok = int(ids[b, t + k + 1]) if t + k + 1 < T else 0
                x = torch.cat(
                    [
                        rms_reference(emb[tok], P["midlayer.input_layernorm.weight"], eps),
                        rms_reference(hidden[t], P["midlayer.hidden_norm.weight"], eps),
                    ]
                )
                pos = int(position_ids[b, t]) + k
                q, keys[(k, t)], values[(k, t)], scale = qkv(P, cfg, x, pos)
                queries.append(q)
            new_hidden = []
            for t in range(T):
                # The keys query (k, t) may see: step 0 causally (no padding but itself), then its own chain.
                visible = [(0, j) for j in range(t + 1) if attention_mask[b, j] or j == t]
                visible += [(i, t) for i in range(1, k + 1)]
                heads = []
                for h in range(nh):
                    g = h // (nh // nkv)
                    scores = [float(queries[t][h] @ keys[s][g]) * scale for s in visible]
                    w = _softmax(scores)
                    heads.append(sum(wi * values[s][g] for wi, s in zip(w, visible)))
                h1 = hidden[t] + P["midlayer.self_attn.o_proj.weight"] @ torch.cat(heads)
                y = rms_reference(h1, P["midlayer.post_attention_layernorm.weight"], eps)
                gate = P["midlayer.mlp.gate_proj.weight"] @ y
                up = P["midlayer.mlp.up_proj.weight"] @ y
                new_hidden.append(h1 + P["midlayer.mlp.down_proj.weight"] @ (gate * torch.sigmoid(gate) * up))
            hidden = new_hidden
            step_out = hidden  # what the step's logits read through the final norm
            for t in range(T):
                j = t + k + 2  # the token this step predicts
                if not (j < T and loss_mask[b, j] and attention_mask[b, j]):
                    continue
                counted[t][k] = True
                tokens[k] += 1
                logits = P["lm_head.weight"] @ rms_reference(step_out[t], P["norm.weight"], eps)  # [D]
                z = full_target_logits[b, j - 1]  # [V]
                top = int(torch.argmax(z))
                if not t2d[top]:
                    continue
                p = _softmax([float(z[i]) for i in draft_ids])
                logq = [math.log(x) for x in _softmax([float(v) for v in logits])]
                loss_sum[k] += sum(pi * (math.log(pi) - lq) for pi, lq in zip(p, logq))
                valid[k] += 1
                if draft_ids[int(torch.argmax(logits))] == top:
                    correct[k] += 1
                    hit[t][k] = True
            if norm_output:  # the next step reads norm(h_out)
                hidden = [rms_reference(h, P["norm.weight"], eps) for h in step_out]
        for t in range(T):  # greedy chains rooted at t
            for k in range(K):
                if not all(counted[t][: k + 1]):
                    break
                if all(hit[t][:k]):
                    reached[k] += 1
                    accepted[k] += hit[t][k]
    per_step_loss = [loss_sum[k] / max(valid[k], 1) for k in range(K)]
    rates = [accepted[k] / max(reached[k], 1) for k in range(K)]
    return dict(
        loss=sum(STEP_DECAY**k * per_step_loss[k] for k in range(K)),
        per_step_loss=per_step_loss,
        per_step_acc=[correct[k] / max(tokens[k], 1) for k in range(K)],
        tokens=tokens,
        valid=valid,
        correct=correct,
        reached=reached,
        accepted=accepted,
        acceptance_length=1 + sum(math.prod(rates[: k + 1]) for k in range(K)),
    )


# ----------------------------------------------------------------------------- (a) TTT == loop reference


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
@pytest.mark.parametrize(
    "seed,num_kv_heads,variant",
    [(0, 1, "eagle3"), (1, 2, "eagle3"), (2, 1, "eagle3"), (3, 2, "eagle3"), (4, 1, "eagle3.1"), (5, 2, "eagle3.1")],
)
def test_ttt_matches_loop_reference(seed, num_kv_heads, variant, impl):
    setup = random_batch(seed, num_kv_heads, variant=variant)
    model, ids, aux, last, lm_head, loss_mask, attention_mask, position_ids = setup
    assert model.config.variant == variant
    K = 3
    head = TargetHead(lm_head, model.d2t, chunk_size=5)
    target = head(last)
    assert 0 < int(target.in_draft.sum()) < target.in_draft.numel()  # both kinds of positions present

    out = model.forward_ttt(ids, aux, target, loss_mask, attention_mask, position_ids, ttt_steps=K, attn_impl=impl)
    fc_norm, norm_output = VARIANTS[variant]
    ref = reference_ttt(
        model, ids, aux, last @ lm_head.T, loss_mask, attention_mask, position_ids, K, fc_norm, norm_output
    )

    assert out.tokens.tolist() == ref["tokens"]
    assert out.valid.tolist() == ref["valid"]
    assert out.correct.tolist() == ref["correct"]
    assert out.chain_reached.tolist() == ref["reached"]
    assert out.chain_accepted.tolist() == ref["accepted"]
    torch.testing.assert_close(
        out.per_step_loss, torch.tensor(ref["per_step_loss"], dtype=torch.float64), rtol=1e-9, atol=1e-10
    )
    torch.testing.assert_close(out.loss.detach(), torch.tensor(ref["loss"], dtype=torch.float64), rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(out.per_step_acc, torch.tensor(ref["per_step_acc"], dtype=torch.float64))
    assert out.acceptance_length.item() == pytest.approx(ref["acceptance_length"], abs=1e-12)
    assert out.loss.item() > 0


def test_reference_cases_exercise_every_branch():
    """The seeds above see in-draft and out-of-draft targets, hits and misses, and accepted chains."""
    totals = np.zeros(5, dtype=int)
    for seed, kv in [(0, 1), (1, 2), (2, 1), (3, 2)]:
        model, ids, aux, last, lm_head, loss_mask, attention_mask, position_ids = random_batch(seed, kv)
        out = model.forward_ttt(
            ids, aux, TargetHead(lm_head, model.d2t)(last), loss_mask, attention_mask, position_ids, ttt_steps=3
        )
        totals += np.array(
            [out.tokens.sum(), out.valid.sum(), out.correct.sum(), out.chain_accepted[0], out.chain_accepted[1:].sum()]
        )
    tokens, valid, correct, accepted0, accepted_later = totals
    assert tokens > valid > correct > 0
    assert accepted0 > 0 and accepted_later > 0


def test_ttt_without_padding_and_longer_unroll_than_sequence():
    model, ids, aux, last, lm_head, loss_mask, _, _ = random_batch(5, padding=False, T=5)
    target = TargetHead(lm_head, model.d2t)(last)
    K = 6  # steps past the end of the sequence have nothing to score and add nothing
    out = model.forward_ttt(ids, aux, target, loss_mask, ttt_steps=K)
    ref = reference_ttt(
        model, ids, aux, last @ lm_head.T, loss_mask, torch.ones_like(loss_mask), torch.arange(5).expand(2, 5), K
    )
    torch.testing.assert_close(out.per_step_loss, torch.tensor(ref["per_step_loss"], dtype=torch.float64))
    assert out.tokens.tolist()[3:] == [0, 0, 0]
    assert out.per_step_loss[3:].tolist() == [0.0, 0.0, 0.0]


KIMI_YARN = dict(KIMI_FIXED["rope_scaling"])  # Kimi-K2.5's: mscale == mscale_all_dim, so cos/sin keep their size
PLAIN_YARN = {"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64}  # cos/sin times 0.1 ln 8 + 1


@pytest.mark.parametrize("scaling", [None, KIMI_YARN, PLAIN_YARN], ids=["plain", "kimi-yarn", "yarn-no-mscale"])
def test_rope_matches_transformers_llama(scaling):
    """Llama attention's rope, YaRN included, against transformers' LlamaRotaryEmbedding (its YaRN frequencies and
    attention factor: modeling_rope_utils.py `_compute_yarn_parameters`), the rope vLLM's and SGLang's Llama layer
    build from the same rope_scaling (YaRNScalingRotaryEmbedding)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    params = {"rope_theta": 500000.0, **({**scaling, "rope_type": "yarn"} if scaling else {"rope_type": "default"})}
    params.pop("type", None)
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, max_position_embeddings=262144, rope_parameters=params)
    pos = torch.tensor([[0, 1, 7, 300, 4095, 70000]])
    q = torch.randn(1, 4, 6, 16)
    hf_cos, hf_sin = LlamaRotaryEmbedding(hf)(q, pos)
    want, _ = apply_rotary_pos_emb(q, q, hf_cos, hf_sin)
    cos, sin = RotaryEmbedding(16, 500000.0, scaling)(pos, torch.float32)
    torch.testing.assert_close(apply_rope(q, cos, sin), want, rtol=1e-5, atol=2e-5)  # fp32 angles at 70,000
    if scaling is PLAIN_YARN:
        assert cos.abs().max() == pytest.approx(0.1 * math.log(8) + 1, rel=1e-6)


# ----------------------------------------------------------------------------- target head


def test_target_head_chunks_match_full_logits_and_break_ties_low():
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(V, 16, generator=g, dtype=torch.float64)
    weight[10] = weight[3] = torch.full((16,), 3.0, dtype=torch.float64)  # identical rows, different chunks
    d2t, _ = draft_vocab(np.arange(V)[::-1].copy(), V, D)  # draft ids 0..4
    hidden = torch.randn(2, 4, 16, generator=g, dtype=torch.float64)
    hidden[0, 0] = 10.0  # rows 3 and 10 tie for the max
    out = TargetHead(weight, d2t, chunk_size=4)(hidden)
    full = hidden @ weight.T
    torch.testing.assert_close(out.logits, full[..., draft_to_target_ids(d2t)])
    assert torch.equal(out.argmax, full.argmax(-1))
    assert out.argmax[0, 0].item() == 3 and out.in_draft[0, 0].item()
    assert torch.equal(out.in_draft, out.argmax < D)


# ----------------------------------------------------------------------------- (b) draft vocab


def test_draft_vocab_ranks_by_count_then_id_and_sorts_by_id():
    d2t, t2d = draft_vocab({5: 10, 2: 10, 9: 3, 7: 3, 1: 1}, 12, 3)
    assert draft_to_target_ids(d2t).tolist() == [2, 5, 7]  # 7 beats 9 on the tie
    assert d2t.dtype == torch.int64 and d2t.tolist() == [2, 4, 5]
    assert t2d.dtype == torch.bool and t2d.nonzero().flatten().tolist() == [2, 5, 7]


def test_draft_vocab_fills_with_unseen_ids_in_id_order_and_caps_at_vocab():
    d2t, t2d = draft_vocab({4: 2}, 6, 3)
    assert draft_to_target_ids(d2t).tolist() == [0, 1, 4]
    d2t, t2d = draft_vocab(np.array([0, 3, 1]), 6, 100)  # shorter than V: zero-padded; D capped to V
    assert d2t.shape == (6,) and d2t.tolist() == [0] * 6 and bool(t2d.all())


def test_draft_vocab_random_counts_consistent_and_maximal():
    rng = np.random.default_rng(0)
    counts = rng.zipf(1.3, size=1000) % 50  # many ties and zeros
    d2t, t2d = draft_vocab(counts, 1000, 100)
    ids = draft_to_target_ids(d2t)
    assert ids.shape == (100,) and bool(torch.all(ids[1:] > ids[:-1]))
    assert torch.equal(t2d.nonzero().flatten(), ids) and int(t2d.sum()) == 100
    expected = sorted(sorted(range(1000), key=lambda j: (-counts[j], j))[:100])
    assert ids.tolist() == expected
    assert counts[ids.numpy()].sum() == np.sort(counts)[::-1][:100].sum()  # covers as much as possible
    assert draft_vocab_coverage(counts, t2d) == pytest.approx(counts[ids.numpy()].sum() / counts.sum())


def test_draft_vocab_rejects_bad_counts():
    with pytest.raises(ValueError, match="outside the target vocab"):
        draft_vocab({12: 1}, 12, 3)
    with pytest.raises(ValueError, match="negative"):
        draft_vocab(np.array([1, -1, 0]), 3, 2)
    with pytest.raises(ValueError, match="nonzero entries"):
        draft_vocab(np.array([1, 0, 0, 5]), 3, 2)
    d2t, _ = draft_vocab(np.array([0, 0, 9, 0, 0]), 3, 1)  # zeros past the vocab are fine
    assert draft_to_target_ids(d2t).tolist() == [2]


def test_load_token_counts_sums_repeated_ids(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "token_counts.parquet"
    pq.write_table(
        pa.table({"token_id": pa.array([3, 0, 3, 5], pa.int32()), "count": pa.array([2, 7, 4, 1], pa.int64())}), path
    )
    assert load_token_counts(path, 6).tolist() == [7, 0, 0, 6, 0, 1]
    with pytest.raises(ValueError, match="outside the target vocab"):
        load_token_counts(path, 5)


def test_set_draft_vocab_rejects_inconsistent_maps():
    model = Eagle3Draft(_config())
    d2t, t2d = draft_vocab({1: 5, 4: 3}, V, D)
    bad = t2d.clone()
    bad[int(draft_to_target_ids(d2t)[0])] = False
    bad[11] = True
    with pytest.raises(ValueError, match="t2d"):
        model.set_draft_vocab(d2t, bad)
    model.set_draft_vocab(d2t, t2d)
    assert torch.equal(model.draft_to_target(torch.arange(D)), draft_to_target_ids(d2t))


# ----------------------------------------------------------------------------- (c) gradients, names


def test_gradients_reach_trainable_weights_but_not_the_embedding():
    model, ids, aux, last, lm_head, loss_mask, attention_mask, position_ids = random_batch(0)
    out = model.forward_ttt(
        ids, aux, TargetHead(lm_head, model.d2t)(last), loss_mask, attention_mask, position_ids, ttt_steps=3
    )
    out.loss.backward()
    assert not model.embed_tokens.weight.requires_grad and model.embed_tokens.weight.grad is None
    names = [n for n, _ in model.named_parameters() if not n.startswith("embed_tokens")]
    assert len(names) == 13  # fc, q/k/v/o, gate/up/down, 3 layer norms, norm, lm_head
    for name, p in model.named_parameters():
        if name.startswith("embed_tokens"):
            continue
        assert p.grad is not None and p.grad.abs().sum() > 0, name
    assert [n for n, p in model.named_parameters() if p.requires_grad] == names


def test_state_dict_uses_serving_names():
    model = Eagle3Draft(_config())
    assert sorted(model.state_dict()) == sorted(
        [
            "embed_tokens.weight",
            "fc.weight",
            "norm.weight",
            "lm_head.weight",
            "d2t",
            "t2d",
            *(f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"),
            *(f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
            *(f"midlayer.{n}.weight" for n in ("hidden_norm", "input_layernorm", "post_attention_layernorm")),
        ]
    )
    sd = model.state_dict()
    assert sd["fc.weight"].shape == (32, 96) and sd["lm_head.weight"].shape == (D, 32)
    assert sd["midlayer.self_attn.q_proj.weight"].shape == (32, 64)
    assert sd["midlayer.self_attn.k_proj.weight"].shape == (16, 64)
    assert sd["d2t"].dtype == torch.int64 and sd["t2d"].dtype == torch.bool and sd["t2d"].shape == (V,)


def test_config_from_target_config():
    from transformers import LlamaConfig

    hf = LlamaConfig(
        vocab_size=2048,
        hidden_size=128,
        intermediate_size=352,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    )
    cfg = Eagle3Config.from_target_config(hf, draft_vocab_size=512, aux_layers=[1, 3, 4])
    assert (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.num_attention_heads,
        cfg.num_key_value_heads,
        cfg.head_dim,
        cfg.vocab_size,
        cfg.draft_vocab_size,
        cfg.target_hidden_size,
    ) == (128, 352, 4, 2, 32, 2048, 512, 128)
    assert cfg.rope_theta == 10000.0 and cfg.max_position_embeddings == 4096 and cfg.aux_layers == [1, 3, 4]
    text = kimi_k25_config()["text_config"]
    # transformers' DeepseekV3Config sets head_dim = qk_rope_head_dim: MLA's, not the attention's
    mla = types.SimpleNamespace(**text, head_dim=text["qk_rope_head_dim"])
    cfg = Eagle3Config.from_target_config(mla, 32000, [1, 29, 57])
    assert cfg.head_dim == 112 and cfg.rope_theta == 50000.0
    assert Eagle3Config.from_target_config(mla, 32000, [1, 29, 57], head_dim=128).head_dim == 128
    with pytest.raises(ValueError, match="aux_layers"):
        Eagle3Config.from_target_config(hf, 512, [1, 3, 8])


def test_default_aux_layers():
    assert default_aux_layers(8) == [1, 3, 4]
    assert default_aux_layers(61) == [1, 29, 57]  # Kimi-K2.5
    assert default_aux_layers(32) == [1, 15, 28]
    for n in (0, 4, 7):
        with pytest.raises(ValueError):
            default_aux_layers(n)


# ----------------------------------------------------------------------------- (d) inference == TTT


@pytest.mark.parametrize("variant", VARIANTS)
def test_inference_steps_equal_ttt_steps(variant):
    model, ids, aux, last, lm_head, loss_mask, _, _ = random_batch(7, num_kv_heads=1, padding=False, variant=variant)
    T, K = ids.shape[1], 4
    out = model.forward_ttt(ids, aux, TargetHead(lm_head, model.d2t)(last), loss_mask, ttt_steps=K, return_steps=True)
    # Step 0 over the whole sequence: the token after each position, the target's features.
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    step = model(next_ids, aux)
    torch.testing.assert_close(step.logits, out.step_logits[0], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(step.hidden, out.step_hidden[0], rtol=1e-10, atol=1e-10)
    full = model(next_ids, aux, target_vocab_logits=True).logits
    assert torch.equal(full.argmax(-1), model.draft_to_target(step.logits.argmax(-1)))
    assert torch.isinf(full[..., ~model.t2d]).all()

    # A chain as a server drafts it: extend over 0..t, then one token per step on the KV cache.
    for t in (0, 2, T - K - 1):
        step = model(ids[:, 1 : t + 2], aux[:, : t + 1])
        for k in range(1, K):
            assert len(step.cache) == t + k
            step = model(ids[:, t + k + 1 : t + k + 2], step.hidden[:, -1:], cache=step.cache)
            torch.testing.assert_close(step.logits[:, 0], out.step_logits[k][:, t], rtol=1e-10, atol=1e-10)


def test_kv_cache_crop_rolls_back():
    model, ids, aux, *_ = random_batch(8, padding=False)
    base = model(ids[:, 1:5], aux[:, :4])
    h = base.hidden[:, -1:]
    first = model(ids[:, 5:6], h, cache=base.cache)
    model(ids[:, 6:7], first.hidden, cache=first.cache)  # a rejected second draft
    first.cache.crop(5)
    again = model(ids[:, 6:7], first.hidden, cache=first.cache)
    fresh_cache = KVCache()
    model(ids[:, 1:5], aux[:, :4], cache=fresh_cache)
    model(ids[:, 5:6], h, cache=fresh_cache)
    want = model(ids[:, 6:7], first.hidden, cache=fresh_cache)
    torch.testing.assert_close(again.logits, want.logits)


# ----------------------------------------------------------------------------- it learns


def test_a_few_steps_of_training_fit_a_batch():
    torch.manual_seed(0)
    model, ids, aux, last, lm_head, loss_mask, _, _ = random_batch(9, padding=False, B=2, T=12)
    model = model.float()
    for name, p in model.named_parameters():  # restart from a sane init
        if not name.startswith("embed_tokens"):
            torch.nn.init.normal_(p, std=0.05) if p.ndim > 1 else torch.nn.init.ones_(p)
    target = TargetHead(lm_head.float(), model.d2t)(last.float())
    loss_mask = torch.ones_like(loss_mask)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    first = None
    for _ in range(40):
        out = model.forward_ttt(ids, aux.float(), target, loss_mask, ttt_steps=3)
        opt.zero_grad()
        out.loss.backward()
        opt.step()
        first = out if first is None else first
    assert out.loss.item() < 0.1 * first.loss.item()
    # Every position whose target argmax the draft vocab holds is now right, at every step; the
    # rest stay misses (accuracy counts them, the loss does not).
    assert torch.equal(out.correct, out.valid) and bool((out.valid < out.tokens).all())
    assert out.acceptance_length > first.acceptance_length + 0.5
