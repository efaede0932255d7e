"""The EAGLE-3 draft model: one Llama decoder layer over the target's fused features, trained with TTT.

Names follow SGLang's `LlamaForCausalLMEagle3` so a state dict exports as is: `embed_tokens`
(frozen copy of the target's embedding), `fc` (3*Ht -> H), `midlayer.{self_attn,mlp,hidden_norm,
input_layernorm,post_attention_layernorm}`, `norm`, `lm_head` (H -> D draft tokens), buffers `d2t`,
`t2d` (see models/draft/vocab.py).

One draft step, at every position t of a sequence (B batch, T tokens, H hidden, D draft vocab):

    h      = fc(aux_hidden[t])                 at step 0 (the target's three aux layers, [3*Ht] -> [H]);
             the step's own previous output    at later steps
    x      = cat(input_layernorm(embed(token)), hidden_norm(h))      [2H]  (embedding first)
    h'     = h + o_proj(attention(q/k/v_proj(x)))                    residual = h, not x
    h_out  = h' + mlp(post_attention_layernorm(h'))                  fed to the next step
    logits = lm_head(norm(h_out))                                    [D]

EAGLE-3.1 (`Eagle3Config.fc_norm`, `norm_output`; `DRAFT_VARIANTS`) changes two lines, as vLLM 0.32
`model_executor/models/llama_eagle3.py` and SGLang 0.5.23 `srt/models/llama_eagle3.py` serve it:

    h      = fc(cat(fc_norm[0](a0), fc_norm[1](a1), fc_norm[2](a2)))  at step 0, aux_hidden[t] = cat(a0, a1, a2)
    fed to the next step: norm(h_out) instead of h_out                 (the engines' `aux_output` / `aux`)

Two options of other trainers' drafts (speculators 0.9.0's training defaults, `Eagle3Config.norm_before_fc`,
`norm_before_residual`), which we read and evaluate but never train:

    h      = fc(input_norm(aux_hidden[t]))                            norm_before_fc: one RMSNorm over all 3*Ht
    h'     = hidden_norm(h) + o_proj(attention(...))                  norm_before_residual: residual = hidden_norm(h)

Training-time test (TTT), `Eagle3Draft.forward_ttt`, unrolls K steps over the whole sequence at
once. With x = input_ids, z = target logits (z[j] is the target's distribution for x[j+1]) and
pos = position_ids (default arange(T)), step k = 0..K-1 at position t:

    token embedded    x[t+k+1]                       (step 0: the token after t)
    hidden input      fc(aux[t]) at k = 0, else h_out of step k-1 at the SAME t (not shifted)
    RoPE position     pos[t] + k                     (queries and this step's keys)
    attends to        step-0 keys/values at t' <= t (causal, padding masked)
                      + the same-position key/value of steps 1..k (the "diagonal")
    target            softmax(z[t+k+1]) over the draft vocab, renormalized: the token x[t+k+2]
    counted when      loss_mask[t+k+2] (the predicted token is a trained token) and
                      t+k+2 < T; dropped from the loss (not from accuracy) when the
                      target's full-vocab argmax of z[t+k+1] is outside the draft vocab

So the steps at one t form the chain a serving engine drafts after verifying up to t+1: step 0
is the draft-extend position t (target features of t, the verified token t+1), step k drafts
token t+k+2 at position t+k and sees the extend cache (keys <= t) plus its own chain. This is
the attention of SafeAILab/EAGLE `eagle/traineagle3/cnets.py` and SpecForge
`specforge/modeling/draft/llama3_eagle.py` (cache list, causal step-0 block + per-step diagonal,
`position_ids + len(cache)`), without the later-removed causal-mask shift (SpecForge PR #244
"remove attention mask shift & add pe shift"). The loss mask differs on purpose: both references
gate step k at t by loss_mask[t+k] (SpecForge PR #895 proposes [t+k+1]); here it is the
predicted token's own mask, [t+k+2], as in any causal-LM loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.draft.caches import KVCache, TTTCache, at_least_fp32
from models.draft.config import AUX_FEATURES, Eagle3Config, resolved_size
from models.draft.layers import Eagle3DecoderLayer, RotaryEmbedding
from models.draft.mla import MLARotary
from models.draft.norm import RMSNorm
from models.draft.target_head import TargetLogits
from models.draft.vocab import draft_to_target_ids
from settings.train import STEP_DECAY


@dataclass
class Eagle3Output:
    """TTT result. Counts are per step (summed over the batch) so metrics aggregate over many batches.

    per_step_loss[k]  mean over counted positions with in-draft target argmax of
                      KL(target restricted to the draft vocab, renormalized || draft)
    loss              sum_k STEP_DECAY**k * per_step_loss[k]  (the only tensor with a graph)
    per_step_acc[k]   correct[k] / tokens[k]: draft argmax == target full-vocab argmax among
                      positions whose predicted token is a loss token; out-of-draft-vocab
                      argmaxes count as misses (the draft can never propose them)
    chain_accepted[k] / chain_reached[k]: of the chains (roots t) whose predicted tokens
                      x[t+2..t+k+2] are all loss tokens and whose steps 0..k-1 were all correct,
                      how many got step k right too: the conditional acceptance a_k
    acceptance_length 1 + sum_k prod_{i<=k} a_i: tokens per target forward of a greedy chain
                      draft of K tokens (the 1 is the token the target adds itself), like
                      SGLang's accept length; simulated with the true tokens as draft inputs
    """

    loss: torch.Tensor
    per_step_loss: torch.Tensor  # [K] (detached)
    per_step_acc: torch.Tensor  # [K]
    acceptance_length: torch.Tensor  # scalar
    per_step_cond_acc: torch.Tensor  # [K] a_k
    tokens: torch.Tensor  # [K] positions whose predicted token is a loss token
    valid: torch.Tensor  # [K] ... and whose target argmax is in the draft vocab (loss denominators)
    correct: torch.Tensor  # [K]
    chain_reached: torch.Tensor  # [K]
    chain_accepted: torch.Tensor  # [K]
    step_logits: list[torch.Tensor] | None = None  # K x [B, T, D] when return_steps
    step_hidden: list[torch.Tensor] | None = None  # K x [B, T, H] when return_steps: what step k+1 reads


def acceptance_length(chain_accepted: torch.Tensor, chain_reached: torch.Tensor) -> torch.Tensor:
    """1 + sum_k prod_{i<=k} a_i with a_i = accepted_i / reached_i (0 where nothing reached step i)."""
    rate = chain_accepted.double() / chain_reached.double().clamp(min=1)
    return 1.0 + torch.cumprod(rate, 0).sum()


@dataclass
class DraftStep:
    """Inference output: logits [B, S, D] (or [B, S, V] in target ids), hidden [B, S, H] for the next step."""

    logits: torch.Tensor
    hidden: torch.Tensor
    cache: KVCache


class Eagle3Draft(nn.Module):
    """EAGLE-3 draft model with SGLang's parameter names; `forward_ttt` trains, `forward` drafts."""

    # buffers (register_buffer below), typed here: nn.Module's __getattr__ is typed Tensor | Module
    d2t: torch.Tensor
    t2d: torch.Tensor

    def __init__(self, config: Eagle3Config):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen: see load_target_embedding
        target_hidden = resolved_size(config.target_hidden_size, "target_hidden_size")
        self.fc = nn.Linear(AUX_FEATURES * target_hidden, h, bias=False)
        self.fc_norm = (  # EAGLE-3.1 only: `fc_norm.{i}.weight` in the export, as both engines name it
            nn.ModuleList([RMSNorm(target_hidden, config.rms_norm_eps) for _ in range(AUX_FEATURES)])
            if config.fc_norm
            else None
        )
        # another trainer's option (Eagle3Config.norm_before_fc): `input_norm.weight` [3*Ht], as both engines name it
        self.input_norm = RMSNorm(AUX_FEATURES * target_hidden, config.rms_norm_eps) if config.norm_before_fc else None
        self.midlayer = Eagle3DecoderLayer(config)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = nn.Linear(h, config.draft_vocab_size, bias=False)
        self.rotary: nn.Module = (  # (position_ids, dtype) -> (cos, sin) for the attention's rope
            MLARotary(config)
            if config.draft_arch == "mla"
            else RotaryEmbedding(resolved_size(config.head_dim, "head_dim"), config.rope_theta, config.rope_scaling)
        )
        # Identity vocab until set_draft_vocab: draft index i is target id i.
        self.register_buffer("d2t", torch.zeros(config.draft_vocab_size, dtype=torch.int64))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[: config.draft_vocab_size] = True
        self.register_buffer("t2d", t2d)

    # -- setup

    def load_target_embedding(self, weight: torch.Tensor) -> None:
        """Copy the target's input embedding [V, H] (it stays frozen)."""
        if tuple(weight.shape) != tuple(self.embed_tokens.weight.shape):
            raise ValueError(f"embedding shape {tuple(weight.shape)} != {tuple(self.embed_tokens.weight.shape)}")
        with torch.no_grad():
            self.embed_tokens.weight.copy_(weight)

    def set_draft_vocab(self, d2t: torch.Tensor, t2d: torch.Tensor) -> None:
        """Install the draft vocab (models/draft/vocab.py); d2t and t2d must describe the same ids."""
        if tuple(d2t.shape) != tuple(self.d2t.shape) or tuple(t2d.shape) != tuple(self.t2d.shape):
            raise ValueError(
                f"d2t/t2d shapes {tuple(d2t.shape)}/{tuple(t2d.shape)} != "
                f"{tuple(self.d2t.shape)}/{tuple(self.t2d.shape)}"
            )
        ids = draft_to_target_ids(d2t).to(t2d.device)
        if ids.min() < 0 or ids.max() >= t2d.shape[0] or not torch.all(ids[1:] > ids[:-1]):
            raise ValueError("d2t does not map to strictly increasing target ids inside the vocab")
        expected = torch.zeros(t2d.shape[0], dtype=torch.bool, device=t2d.device)
        expected[ids] = True
        if not torch.equal(expected, t2d.bool()):
            raise ValueError("t2d does not mark exactly the target ids of d2t")
        self.d2t.copy_(d2t)
        self.t2d.copy_(t2d)

    def draft_to_target(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Target ids of draft indices (any shape)."""
        return draft_index + self.d2t[draft_index]

    def to_target_vocab(self, draft_logits: torch.Tensor) -> torch.Tensor:
        """[..., D] draft logits -> [..., V] target-id logits, -inf outside the draft vocab."""
        out = draft_logits.new_full((*draft_logits.shape[:-1], self.config.vocab_size), float("-inf"))
        out[..., draft_to_target_ids(self.d2t)] = draft_logits
        return out

    # -- the two places EAGLE-3.1 differs

    def fuse(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[..., 3*Ht] target aux features -> [..., H] through fc; EAGLE-3.1 normalizes each feature first."""
        aux_hidden = aux_hidden.to(self.fc.weight.dtype)
        if self.input_norm is not None:
            aux_hidden = self.input_norm(aux_hidden)
        if self.fc_norm is not None:
            chunks = aux_hidden.chunk(AUX_FEATURES, dim=-1)
            aux_hidden = torch.cat([norm(chunk) for norm, chunk in zip(self.fc_norm, chunks, strict=True)], -1)
        return self.fc(aux_hidden)

    def head(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A step's [..., H] output -> (draft logits [..., D], the hidden state the next step reads)."""
        normed = self.norm(hidden)
        return self.lm_head(normed), normed if self.config.norm_output else hidden

    # -- inference

    def forward(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        cache: KVCache | None = None,
        *,
        target_vocab_logits: bool = False,
    ) -> DraftStep:
        """One draft step for S new positions appended to `cache` (a new KVCache when None).

        input_ids [B, S]: the token that FOLLOWS each position (x[t+1] at position t).
        hidden [B, S, 3*Ht] (target aux features: extend/first step, goes through fc) or
        [B, S, H] (a previous step's `hidden`: pre-norm, or post-norm with `norm_output`).
        position_ids [B, S] default: len(cache) + arange(S).
        Over a whole prefix with aux features this is TTT step 0; one token at position t+1
        after it, fed step 0's hidden at t and the token x[t+2], is TTT step 1 at t; and so on.
        """
        cache = KVCache() if cache is None else cache
        b, s = input_ids.shape
        if position_ids is None:
            position_ids = (len(cache) + torch.arange(s, device=input_ids.device)).expand(b, s)
        embeds = self.embed_tokens(input_ids)  # [B, S, H]
        if (
            hidden.shape[-1] == AUX_FEATURES * resolved_size(self.config.target_hidden_size, "target_hidden_size")
            and hidden.shape[-1] != self.config.hidden_size
        ):
            hidden = self.fuse(hidden)  # [B, S, H]
        elif hidden.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden width {hidden.shape[-1]} is neither 3*target_hidden_size nor hidden_size")
        cos, sin = self.rotary(position_ids, embeds.dtype)  # [B, S, hd]
        hidden = self.midlayer(embeds, hidden, cos, sin, cache)  # [B, S, H] pre-norm
        logits, hidden = self.head(hidden)  # [B, S, D], [B, S, H]
        if target_vocab_logits:
            logits = self.to_target_vocab(logits)  # [B, S, V]
        return DraftStep(logits=logits, hidden=hidden, cache=cache)

    # -- training

    def forward_ttt(
        self,
        input_ids: torch.Tensor,
        aux_hidden: torch.Tensor,
        target: TargetLogits,
        loss_mask: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        ttt_steps: int = 7,
        *,
        step_decay: float = STEP_DECAY,
        attn_impl: str = "sdpa",
        return_steps: bool = False,
    ) -> Eagle3Output:
        """Training-time test over K = ttt_steps unrolled steps; the alignment is in the module docstring.

        input_ids [B, T], aux_hidden [B, T, 3*Ht] (unshifted, as captured), target =
        TargetHead(last_hidden [B, T, Ht]) (unshifted: target.logits[:, j] predicts x[j+1]),
        loss_mask [B, T] (1 on trained tokens), attention_mask [B, T] (1 on real tokens, default all).
        """
        b, t = input_ids.shape
        dev = input_ids.device
        if attention_mask is None:
            attention_mask = torch.ones(b, t, dtype=torch.bool, device=dev)
        if position_ids is None:
            position_ids = torch.arange(t, device=dev).expand(b, t)
        trained = loss_mask.bool() & attention_mask.bool()  # [B, T] token j is a loss token
        target_logp = torch.log_softmax(at_least_fp32(target.logits), -1)  # [B, T, D] restricted, renormalized
        cache = TTTCache(attention_mask, impl=attn_impl)

        hidden = self.fuse(aux_hidden)  # [B, T, H]
        losses, tokens, valid, correct, chain_steps, step_logits, step_hidden = [], [], [], [], [], [], []
        for k in range(ttt_steps):
            embeds = self.embed_tokens(_shift_left(input_ids, k + 1))  # [B, T, H]   x[t+k+1]
            cos, sin = self.rotary(position_ids + k, embeds.dtype)  # [B, T, hd]  RoPE at pos+k
            hidden = self.midlayer(embeds, hidden, cos, sin, cache)  # [B, T, H]
            logits, hidden = self.head(hidden)  # [B, T, D], [B, T, H] next step's input
            if return_steps:
                step_logits.append(logits)
                step_hidden.append(hidden)

            # Step k at t is scored against z[t+k+1] (the target's view of x[t+k+2]).
            n = max(t - (k + 1), 0)  # positions that have one
            draft_logp = torch.log_softmax(at_least_fp32(logits[:, :n]), -1)  # [B, n, D]
            tgt_logp = target_logp[:, k + 1 :]  # [B, n, D]
            counted = _shift_left(trained, k + 2)[:, :n]  # [B, n] x[t+k+2] is trained
            ok = counted & target.in_draft[:, k + 1 :]  # [B, n] usable for the loss
            kl = (tgt_logp.exp() * (tgt_logp - draft_logp)).sum(-1)  # [B, n]
            losses.append(torch.where(ok, kl, 0.0).sum() / ok.sum().clamp(min=1))
            hit = ok & (draft_logp.argmax(-1) == tgt_logp.argmax(-1))  # [B, n]
            tokens.append(counted.sum())
            valid.append(ok.sum())
            correct.append(hit.sum())
            chain_steps.append((F.pad(counted, (0, t - n)), F.pad(hit, (0, t - n))))  # back to [B, T]

        per_step_loss = torch.stack(losses)
        weights = step_decay ** torch.arange(ttt_steps, device=dev, dtype=per_step_loss.dtype)
        loss = (weights * per_step_loss).sum()

        # Greedy chain from root t: step k is reached if steps < k were right and x[t+2..t+k+2] are trained.
        reached, accepted = [], []
        chain_ok = torch.ones(b, t, dtype=torch.bool, device=dev)  # steps < k all right
        chain_counted = torch.ones(b, t, dtype=torch.bool, device=dev)  # x[t+2..t+k+2] all trained
        for counted_k, hit_k in chain_steps:
            chain_counted = chain_counted & counted_k
            reached.append((chain_counted & chain_ok).sum())
            chain_ok = chain_ok & hit_k
            accepted.append((chain_counted & chain_ok).sum())
        chain_reached, chain_accepted = torch.stack(reached), torch.stack(accepted)
        n_tokens, n_valid, n_correct = torch.stack(tokens), torch.stack(valid), torch.stack(correct)
        return Eagle3Output(
            loss=loss,
            per_step_loss=per_step_loss.detach(),
            per_step_acc=n_correct.double() / n_tokens.double().clamp(min=1),
            acceptance_length=acceptance_length(chain_accepted, chain_reached),
            per_step_cond_acc=chain_accepted.double() / chain_reached.double().clamp(min=1),
            tokens=n_tokens,
            valid=n_valid,
            correct=n_correct,
            chain_reached=chain_reached,
            chain_accepted=chain_accepted,
            step_logits=step_logits if return_steps else None,
            step_hidden=step_hidden if return_steps else None,
        )


def _shift_left(x: torch.Tensor, n: int) -> torch.Tensor:
    """x[:, j] -> x[:, j + n] along axis 1, zero (or False) filled past the end; same shape."""
    t = x.shape[1]
    if n >= t:
        return torch.zeros_like(x)
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)
