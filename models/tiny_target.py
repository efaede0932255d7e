"""A deterministic tiny Llama target with a Kimi-style chat template, for tests and the demo.

The real target (Kimi-K2.5) is a 1T-parameter MoE; everything before and after SGLang only needs
something with the same *shape of interface*: a fast tokenizer whose chat template wraps turns in
`<|im_*|>` control tokens and rewrites reasoning in history, an eos that is also the end-of-turn
token, and a causal LM that exposes per-layer hidden states. `build_tiny_target` makes one in a
few seconds on a CPU, byte-for-byte reproducible from a seed.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from itertools import islice
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from transformers.utils import logging as hf_logging

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.atomic import replace_dir
from models.eagle3 import default_aux_layers

SAMPLES_DIR = Path(__file__).resolve().parents[1] / "data" / "samples"

# Added as special tokens in this order, so their ids are 0..7 in every build.
PAD, IM_END, IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK, END_THINK = SPECIAL_TOKENS = (
    "<|pad|>",
    "<|im_end|>",  # eos and end-of-turn, like Kimi
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_system|>",
    "<|im_middle|>",
    "<think>",
    "</think>",
)

# Modelled on Kimi-K2's template: `<|im_{role}|>{role}<|im_middle|>{content}<|im_end|>` per message.
# Like Kimi/Qwen3, an assistant message *before the last user message* loses its leading
# `<think>...</think>` block (and the whitespace after it): re-rendering a finished conversation
# does NOT reproduce the ids the model generated. Later stages must keep generated ids instead.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}"
    "{%- if m['role'] == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}"
    "{%- set role = m['role'] -%}"
    "{%- if role == 'system' -%}<|im_system|>"
    "{%- elif role == 'user' -%}<|im_user|>"
    "{%- elif role == 'assistant' -%}<|im_assistant|>"
    "{%- elif role == 'tool' -%}<|im_system|>"
    "{%- else -%}{{ raise_exception('unsupported role: ' ~ role) }}"
    "{%- endif -%}"
    "{%- set content = m['content'] if m['content'] is string else '' -%}"
    "{%- if role == 'assistant' and loop.index0 < ns.last_user"
    " and content.lstrip().startswith('<think>') and '</think>' in content -%}"
    "{%- set content = content.split('</think>', 1)[1].lstrip() -%}"
    "{%- endif -%}"
    "{{ role }}<|im_middle|>{{ content }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)

_BUILD_INFO = "tiny_target.json"  # written last: its presence marks a complete build
_FORMAT_VERSION = 1
# With the default init (std 0.02) every next-token distribution is nearly uniform (entropy ~
# log V), so sampled "responses" are noise and a draft has nothing to learn. A wider lm_head
# gives peaked, context-dependent distributions (~1.7 nats at temperature 0.6), like a real LM.
LM_HEAD_INIT_STD = 0.3
# Random weights almost never pick the end-of-turn token, so every response would end by length
# and the later stages (which train on responses that ended properly) would get nothing. The eos
# row of lm_head is shifted along the mean final hidden state of the sample text so that
# <|im_end|> is the greedy choice at about this fraction of positions: responses then end by
# "stop" at varied lengths, like a real model's.
EOS_TARGET_RATE = 0.03


def build_tiny_target(
    out_dir: str | Path,
    *,
    seed: int = 0,
    corpus_files: Sequence[Path] | None = None,
    vocab_size: int = 2048,
    hidden_size: int = 128,
    num_layers: int = 8,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 352,
    max_position_embeddings: int = 4096,
    device: str = "cpu",
) -> Path:
    """Build (or reuse) a tiny Llama target with a Kimi-style tokenizer in `out_dir`; return its path.

    The tokenizer is a byte-level BPE trained on `corpus_files` (default: data/samples/*.jsonl);
    `vocab_size` is an upper bound (the real size is `len(tokenizer)`). Weights are random but
    fully determined by `seed`. An existing complete build with the same parameters and corpus is
    reused as is; the new build is assembled in a sibling temp dir and renamed into place, so a
    half-written directory is never taken for a finished one.

    `device`: where the eos calibration runs (hundreds of forwards: minutes on a CPU for a
    1024-wide, 16-layer target, seconds on a GPU). A build calibrated elsewhere than on the CPU is
    its own build (other rounding, so other weights): its build info says where.
    """
    default_aux_layers(num_layers)  # validates num_layers
    out_dir = Path(out_dir)
    files = [Path(p) for p in corpus_files] if corpus_files is not None else sorted(SAMPLES_DIR.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no corpus files for the tiny target tokenizer (looked in {SAMPLES_DIR})")
    params = {
        "format_version": _FORMAT_VERSION,
        "seed": seed,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": num_kv_heads,
        "intermediate_size": intermediate_size,
        "max_position_embeddings": max_position_embeddings,
        "lm_head_init_std": LM_HEAD_INIT_STD,
        "eos_target_rate": EOS_TARGET_RATE,
        "corpus_sha256": _corpus_digest(files),
    }
    if device != "cpu":
        params["calibrated_on"] = device
    if _read_build_info(out_dir) == params:
        return out_dir
    if out_dir.exists() and _read_build_info(out_dir) is None and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a tiny target build; refusing to replace it")

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        tokenizer = _build_tokenizer(files, vocab_size, max_position_embeddings)
        _save_tokenizer(tokenizer, tmp)
        calibration = [_chat_prompt(tokenizer, t[:400]) for t in islice(_corpus_texts(files), 8)]
        model = _build_model(tokenizer, seed, hidden_size, num_layers, num_heads, num_kv_heads,
                             intermediate_size, max_position_embeddings, calibration, torch.device(device))
        _save_model(model, tmp)
        (tmp / _BUILD_INFO).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        _fix_permissions(tmp)
        _replace_dir(tmp, out_dir, params)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _corpus_texts(files: Sequence[Path]) -> Iterator[str]:
    """Text fields of each row, in file order, then row order, then message order."""
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{path}:{lineno}: not valid JSON: {e}") from e
                for m in row.get("messages") or []:
                    if isinstance(m, dict) and isinstance(m.get("content"), str):
                        yield m["content"]
                if isinstance(row.get("prompt"), str):
                    yield row["prompt"]


def _corpus_digest(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(Path(path).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _build_tokenizer(files: Sequence[Path], vocab_size: int, model_max_length: int) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Registered before training so `<think>` in the corpus is split out, not learned as merges;
    # the trainer puts the same tokens first in the model vocab, so ids are 0..7 in both.
    tok.add_special_tokens(list(SPECIAL_TOKENS))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus_texts(files), trainer=trainer)
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=IM_END,
        pad_token=PAD,
        bos_token=None,
        unk_token=None,
        additional_special_tokens=[IM_USER, IM_ASSISTANT, IM_SYSTEM, IM_MIDDLE, THINK, END_THINK],
        chat_template=CHAT_TEMPLATE,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )


def _build_model(
    tokenizer: PreTrainedTokenizerFast,
    seed: int,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    max_position_embeddings: int,
    calibration: list[list[int]],
    device: torch.device,
) -> LlamaForCausalLM:
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # Seed a private copy of the global RNG so building does not disturb the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config).to(torch.float32)
        torch.nn.init.normal_(model.lm_head.weight, mean=0.0, std=LM_HEAD_INIT_STD)
    model.eval()
    _calibrate_eos(model.to(device), eos_id, calibration)
    model.to("cpu")
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    return model


def _chat_prompt(tokenizer: PreTrainedTokenizerFast, text: str) -> list[int]:
    encoded = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], chat_template=CHAT_TEMPLATE, add_generation_prompt=True, return_dict=True
    )
    return list(encoded["input_ids"])


@torch.no_grad()
def _calibrate_eos(model: LlamaForCausalLM, eos_id: int, calibration: list[list[int]], steps: int = 48) -> None:
    """Shift the eos row of lm_head so eos is the argmax at about EOS_TARGET_RATE of generated positions.

    Calibrated on the model's own sampled continuations of chat prompts (that is where stopping
    matters), with eos held out while they are sampled.
    """
    generator = torch.Generator().manual_seed(0)  # on the CPU wherever the model runs: the same draws
    device = model.lm_head.weight.device
    hidden = []
    for ids in calibration:
        seq = torch.tensor([ids], device=device)
        for _ in range(steps):
            logits = model(seq).logits[0, -1]
            logits[eos_id] = float("-inf")
            token = torch.multinomial(torch.softmax(logits / 0.8, -1).cpu(), 1, generator=generator)
            seq = torch.cat([seq, token[None].to(device)], dim=1)
        hidden.append(model.model(seq).last_hidden_state[0, len(ids):])
    hidden = torch.cat(hidden)  # [N, H] states at generated positions
    direction = hidden.mean(0)
    direction = direction / direction.dot(direction)  # h . direction ~= 1 for typical h
    logits = hidden @ model.lm_head.weight.T  # [N, V]
    eos = logits[:, eos_id].clone()
    logits[:, eos_id] = float("-inf")
    gap = logits.max(-1).values - eos  # eos wins where shift * (h . direction) > gap
    along = hidden @ direction
    lo, hi = 0.0, float(gap.abs().max() * 4 + 1)
    for _ in range(50):  # bisection on the shift: the win rate grows with it
        mid = (lo + hi) / 2
        rate = (mid * along > gap).float().mean().item()
        lo, hi = (mid, hi) if rate < EOS_TARGET_RATE else (lo, mid)
    model.lm_head.weight[eos_id] += hi * direction


def _save_tokenizer(tokenizer: PreTrainedTokenizerFast, out_dir: Path) -> None:
    tokenizer.save_pretrained(out_dir)
    # transformers 5 writes `tokenizer_class: TokenizersBackend` and `extra_special_tokens`;
    # the 4.x names below load the same tokenizer in both 4.x (e.g. next to SGLang) and 5.x.
    path = out_dir / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg.pop("backend", None)
    extra = cfg.pop("extra_special_tokens", None)
    if extra is not None:
        cfg["additional_special_tokens"] = extra
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_model(model: LlamaForCausalLM, out_dir: Path) -> None:
    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # no "Writing model shards" bar in test and demo output
    try:
        model.save_pretrained(out_dir, safe_serialization=True)
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _fix_permissions(root: Path) -> None:
    """mkdtemp makes a 0700 dir and safetensors a 0600 file: make the build readable like any other."""
    # Fixed modes rather than the umask: reading the umask means setting it, which is process-wide.
    root.chmod(0o755)
    for p in root.iterdir():
        p.chmod(0o644)


def _read_build_info(out_dir: Path) -> dict | None:
    try:
        return json.loads((out_dir / _BUILD_INFO).read_text())
    except (OSError, ValueError):
        return None


def _replace_dir(tmp: Path, out_dir: Path, params: dict) -> None:
    """Publish the finished build `tmp` as `out_dir` (models/atomic.py), replacing an older tiny-target build there."""
    if out_dir.exists() and _read_build_info(out_dir) == params:  # a concurrent builder finished first
        return
    try:
        replace_dir(tmp, out_dir)
    except OSError:
        if _read_build_info(out_dir) != params:  # lost a race to an identical build: fine
            raise
