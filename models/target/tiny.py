"""A deterministic tiny target with a Kimi-style chat template, for tests and the demo: a Llama, or Kimi's shape.

The real target (Kimi-K2.5) is a 1T-parameter MoE; everything before and after SGLang only needs
something with the same *shape of interface*: a fast tokenizer whose chat template wraps turns in
`<|im_*|>` control tokens and rewrites reasoning in history, an eos that is also the end-of-turn
token, and a causal LM that exposes per-layer hidden states. `build_tiny_target` makes one in
under a minute on a CPU, byte-for-byte reproducible from a seed.
Its tokenizer and chat template: models/target/tiny_tokenizer.py.

The weights are trained briefly on the sample data (data/samples/*.jsonl) so that the target's text
has structure: a random-weight model's greedy output falls into 1-3-token loops and almost never
ends a turn, which makes a draft's acceptance length noise. After `train_steps` steps the target
answers with sentences it has learned from the corpus, ends them with <|im_end|> at varied lengths,
and its samples vary around them, like a (very small) real model.

`build_kimi_target` makes the same target in Kimi-K2.5's own shape instead (a tiny DeepSeek-V3 with MLA, MoE and
YaRN, saved as a kimi_k25 checkpoint: models/target/tiny_kimi.py), for what depends on the model's shape and checkpoint
layout (loaders, layer ids, the engines' MLA paths); `build_target` picks one by name. `build_int4_target` publishes a
Kimi build as Kimi-K2.5 is published, its routed experts INT4 (models/target/int4.py). Its `long_answers` build
(shape `kimi-long`) is then trained on a book (models/target/book.py), so that it writes answers of hundreds to
thousands of tokens, as Kimi-K2.5 does.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
)
from transformers.utils import logging as hf_logging

from models import numerics  # noqa: F401  (CPU denormals flushed before any math)
from models.common.atomic import replace_dir
from models.draft.config import default_aux_layers
from models.target import book, int4
from models.target.kimi_tokenizer import KIMI_CHAT_TEMPLATE, save_kimi_tokenizer
from models.target.tiny_kimi import (
    KIMI_CHECKPOINT_VERSION,
    KIMI_FIXED,
    MEDIA_PAD,
    kimi_text_config,
    remote_code_digest,
    save_kimi_k25,
)
from models.target.tiny_tokenizer import CHAT_TEMPLATE, IM_END, PAD, build_tokenizer, save_tokenizer

SAMPLES_DIR = Path(__file__).resolve().parents[2] / "data" / "samples"

_BUILD_INFO = "tiny_target.json"  # written last: its presence marks a complete build
_FORMAT_VERSION = 2
# The training of a build (the number of steps is build_tiny_target's `train_steps`): AdamW on
# packed chat-rendered corpus rows, TRAIN_BATCH sequences of TRAIN_SEQ_LEN tokens a step, a linear
# warmup then a constant rate. All of it goes into the build info, so a change rebuilds. Measured
# (100 steps, ~10 passes over the corpus): greedy answers to the sample prompts end with <|im_end|>
# after 14-52 tokens (21 of 26 within 96), none loops (distinct-token share >= 0.66); ~50 s on one core.
TRAIN_STEPS = 100
TRAIN_LR = 5e-3
TRAIN_BATCH = 8
TRAIN_SEQ_LEN = 256
TRAIN_WARMUP = 20
# Intra-op threads while training: one. Builds with 1 and 2 threads were measured byte-identical
# here, but a CPU matmul may split its reduction by thread count elsewhere; and on a busy 2-core
# machine (tests, other jobs) two threads spin-waiting for each other made a build 3-10x slower.
TRAIN_THREADS = 1
# The default init (std 0.02) starts from near-uniform next-token distributions; a wider lm_head
# starts peaked, and 100 steps reach text that does not loop (measured: std 0.02 with a decaying
# rate still looped after 180 steps).
LM_HEAD_INIT_STD = 0.3

TargetShape = Literal["llama", "kimi", "kimi-long"]
SHAPES: tuple[TargetShape, ...] = ("llama", "kimi", "kimi-long")
# How a Kimi-shaped build may be published besides float32: "int4", Kimi-K2.5's own format (build_int4_target).
Quantize = Literal["int4"]
QUANTIZE: tuple[Quantize, ...] = ("int4",)
# The Kimi-shaped build (build_kimi_target): its sizes beside hidden/layers/heads (models/target/tiny_kimi.py keeps what
# stays Kimi's own). MoE: 8 routed experts of width 128, top-2, plus the shared one; the first layer dense (704).
KIMI_SIZES = {
    "intermediate_size": 704,
    "moe_intermediate_size": 128,
    "n_routed_experts": 8,
    "num_experts_per_tok": 2,
    "q_lora_rank": 96,
    "qk_nope_head_dim": 32,
    "v_head_dim": 32,
}
# Its training: half the Llama's batch at 3e-3 for twice the steps (~170 s on one core). Measured on 3 sample
# prompts: the Llama's recipe (5e-3, 8 x 256) left it answering "<think>ist<|im_end|>" to every prompt, and 2e-3 at
# 8 x 256 looped; this one answers in 9-12 tokens ending with <|im_end|>, no loop.
KIMI_TRAIN_STEPS = 200
KIMI_TRAIN_LR = 3e-3
KIMI_TRAIN_BATCH = 4
# The long-answer build (`long_answers`, shape kimi-long): the Kimi build's training, then BOOK_RECIPE's book_steps
# more on the book's chapter conversations (models/target/book.py, its order from the build's seed), packed as the
# corpus is, book_batch x TRAIN_SEQ_LEN tokens a step, on two threads (most of the build's time), the rate decaying
# linearly from book_lr to 0 after the warmup. Measured (bench/long_answers.py, docs/variants.md "Long answers"):
# ~17 min for the whole build on 2 cores; greedy answers of 100 to 2,103 tokens, each chapter begun on its first
# sentence, none looping (all 8-grams distinct), every one ending its turn. A constant rate (tried by hand, not kept)
# began some chapters on another chapter's sentence.
BOOK_RECIPE: dict[str, Any] = {
    "book_steps": 900,
    "book_lr": 2e-3,
    "book_decay": "linear",
    "book_batch": 8,
    "book_threads": 2,
}
# The tokenizer's model_max_length: the Llama build's context (the config's 262,144 is YaRN's stretched one).
KIMI_TOKENIZER_MAX_LENGTH = 4096
# A build says what it does at least this often (stderr, `tiny target: ...`): a build takes a minute (the Llama) to
# ~17 min (kimi-long), and the demo and `eagle3 build-target` print nothing else meanwhile.
PROGRESS_EVERY_S = 10.0


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
    train_steps: int = TRAIN_STEPS,
    device: str = "cpu",
) -> Path:
    """Build (or reuse) a tiny Llama target with a Kimi-style tokenizer in `out_dir`; return its path.

    The tokenizer is a byte-level BPE trained on `corpus_files` (default: data/samples/*.jsonl);
    `vocab_size` is an upper bound (the real size is `len(tokenizer)`). The weights start random and
    are trained for `train_steps` steps on the same corpus (0: left random), all of it determined by
    `seed`. An existing complete build with the same parameters and corpus is
    reused as is; the new build is assembled in a sibling temp dir and renamed into place, so a
    half-written directory is never taken for a finished one.

    `device`: where the training runs (minutes on a CPU for a 1024-wide, 16-layer target, seconds
    on a GPU). A build trained elsewhere than on the CPU is its own build (other rounding, so other
    weights): its build info says where.
    """
    files = _corpus_files(corpus_files)
    params = _build_params(
        files,
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        intermediate_size=intermediate_size,
        max_position_embeddings=max_position_embeddings,
        train_steps=train_steps,
        train_lr=TRAIN_LR,
        train_batch=TRAIN_BATCH,
    )
    if device != "cpu":
        params["trained_on"] = device
    return _build(Path(out_dir), params, files, device)


def build_kimi_target(
    out_dir: str | Path,
    *,
    seed: int = 0,
    corpus_files: Sequence[Path] | None = None,
    vocab_size: int = 2048,
    hidden_size: int = 256,
    num_layers: int = 8,
    num_heads: int = 4,
    train_steps: int = KIMI_TRAIN_STEPS,
    long_answers: bool = False,
) -> Path:
    """Build (or reuse) the Kimi-K2.5-shaped tiny target in `out_dir` (models/target/tiny_kimi.py); return its path.

    A tiny DeepSeek-V3 (MLA, 8 routed experts top-2 + 1 shared, the first layer dense, YaRN x64) saved as a
    kimi_k25 checkpoint; the tokenizer is the Llama build's plus Kimi's `<|media_pad|>`. Built, trained and
    reused like `build_tiny_target`'s target, byte-for-byte from `seed`.
    `long_answers`: then trained on the book (BOOK_RECIPE, models/target/book.py): asked for a chapter, it writes
    it, an answer of up to ~2,100 tokens (bench/long_answers.py).
    """
    files = _corpus_files(corpus_files)
    params = _kimi_params(
        files,
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        train_steps=train_steps,
        long_answers=long_answers,
    )
    return _build(Path(out_dir), params, files, "cpu")


def build_int4_target(
    out_dir: str | Path,
    *,
    base_dir: str | Path | None = None,
    corpus_files: Sequence[Path] | None = None,
    long_answers: bool = False,
    **kwargs: Any,
) -> Path:
    """Build (or reuse) the Kimi target published as Kimi-K2.5 is, INT4, in `out_dir`; return its path.

    The `build_kimi_target` build of the same arguments (made or reused in `base_dir`, else in a temp dir removed
    after), its routed experts then quantized with compressed-tensors to Kimi-K2.5's recipe (models/target/int4.py);
    the other weights keep the base's float32. Reused like the other builds: its build info is the base's plus the
    recipe and the compressed-tensors version that packed it.
    """
    import compressed_tensors

    files = _corpus_files(corpus_files)
    base_params = _kimi_params(files, long_answers=long_answers, **kwargs)
    params = {**base_params, "quantize": "int4", "quantization": int4.QUANTIZATION_CONFIG}
    params["compressed_tensors"] = compressed_tensors.__version__
    out_dir = Path(out_dir)
    if _read_build_info(out_dir) == params:
        return out_dir
    _refuse_foreign(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out_dir.name}.base-", dir=out_dir.parent) as scratch:
        base_at = Path(base_dir) if base_dir is not None else Path(scratch) / "kimi"
        base = build_kimi_target(base_at, corpus_files=files, long_answers=long_answers, **kwargs)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
        try:
            _say(f"quantizing the routed experts of {base} to INT4 (compressed-tensors pack-quantized) in {out_dir}")
            int4.write_int4_checkpoint(base, tmp, torch.float32)
            (tmp / _BUILD_INFO).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
            _fix_permissions(tmp)
            _replace_dir(tmp, out_dir, params)
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def build_target(
    out_dir: str | Path, shape: TargetShape = "llama", *, quantize: Quantize | None = None, **kwargs: Any
) -> Path:
    """`build_tiny_target` or `build_kimi_target` (with `long_answers` for `kimi-long`), by `shape`; with `quantize`
    ("int4", Kimi shapes only) `build_int4_target`."""
    if shape not in SHAPES:
        raise ValueError(f"tiny target shape must be one of {', '.join(SHAPES)}, got {shape!r}")
    if quantize is not None:
        if quantize not in QUANTIZE:
            raise ValueError(f"tiny target quantization must be one of {', '.join(QUANTIZE)}, got {quantize!r}")
        if shape == "llama":
            raise ValueError("--quantize int4 is Kimi-K2.5's published format (its routed experts): use a kimi shape")
        return build_int4_target(out_dir, long_answers=shape == "kimi-long", **kwargs)
    if shape == "llama":
        return build_tiny_target(out_dir, **kwargs)
    return build_kimi_target(out_dir, long_answers=shape == "kimi-long", **kwargs)


def _kimi_params(
    files: list[Path],
    *,
    seed: int = 0,
    vocab_size: int = 2048,
    hidden_size: int = 256,
    num_layers: int = 8,
    num_heads: int = 4,
    train_steps: int = KIMI_TRAIN_STEPS,
    long_answers: bool = False,
) -> dict[str, Any]:
    """The build info of `build_kimi_target`'s build of these arguments."""
    params = _build_params(
        files,
        shape="kimi",
        seed=seed,
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_layers=num_layers,
        num_heads=num_heads,
        **KIMI_SIZES,
        max_position_embeddings=KIMI_FIXED["max_position_embeddings"],
        tokenizer_max_length=KIMI_TOKENIZER_MAX_LENGTH,
        train_steps=train_steps,
        train_lr=KIMI_TRAIN_LR,
        train_batch=KIMI_TRAIN_BATCH,
        kimi_checkpoint_version=KIMI_CHECKPOINT_VERSION,
        kimi_remote_code_sha256=remote_code_digest(),
    )
    if long_answers:
        params.update(BOOK_RECIPE)
    return params


def _build_params(files: list[Path], **shape: Any) -> dict[str, Any]:
    """A build's info: its `shape` arguments (validated), the training recipe's constants and the corpus digest.

    Equal params mean an equal build: a change to any of them rebuilds.
    """
    default_aux_layers(shape["num_layers"])  # validates num_layers
    if shape["train_steps"] < 0:
        raise ValueError(f"train_steps must be >= 0, got {shape['train_steps']}")
    return {
        "format_version": _FORMAT_VERSION,
        **shape,
        "train_seq_len": TRAIN_SEQ_LEN,
        "train_warmup": TRAIN_WARMUP,
        "lm_head_init_std": LM_HEAD_INIT_STD,
        "train_threads": TRAIN_THREADS,
        "corpus_sha256": _corpus_digest(files),
    }


def _corpus_files(corpus_files: Sequence[Path] | None) -> list[Path]:
    files = [Path(p) for p in corpus_files] if corpus_files is not None else sorted(SAMPLES_DIR.glob("*.jsonl"))
    if not files:
        raise FileNotFoundError(f"no corpus files for the tiny target tokenizer (looked in {SAMPLES_DIR})")
    return files


def _build(out_dir: Path, params: dict[str, Any], files: list[Path], device: str) -> Path:
    """Reuse the build in `out_dir` if its build info is `params`, else build it in a temp dir and publish it."""
    shape = params.get("shape", "llama")
    if _read_build_info(out_dir) == params:
        return out_dir
    _refuse_foreign(out_dir)

    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    started = time.monotonic()
    book_steps = params.get("book_steps", 0)
    _say(
        f"building the {'kimi-long' if book_steps else shape} target in {out_dir} (once; reused while its "
        f"settings stay): a tokenizer, then {params['train_steps']:,}"
        + (f" + {book_steps:,} (the book)" if book_steps else "")
        + " training steps on the sample data"
    )
    try:
        tokenizer = build_tokenizer(
            files,
            params["vocab_size"],
            params.get("tokenizer_max_length", params["max_position_embeddings"]),
            extra=[MEDIA_PAD] if shape == "kimi" else [],
        )
        save_tokenizer(tokenizer, tmp)
        model = _build_model(tokenizer, params)
        _say(f"tokenizer of {len(tokenizer):,} tokens, model of {model.num_parameters():,} parameters")
        _train(
            model,
            _training_sequences(tokenizer, files),
            params["train_steps"],
            params["seed"],
            torch.device(device),
            batch_size=params["train_batch"],
            lr=params["train_lr"],
        )
        if params.get("book_steps"):
            _train(
                model,
                _book_sequences(tokenizer, files, params["seed"]),
                params["book_steps"],
                params["seed"],
                torch.device(device),
                batch_size=params["book_batch"],
                lr=params["book_lr"],
                threads=params["book_threads"],
                decay=params["book_decay"] == "linear",
                what="training on the book",
            )
        if shape == "kimi":
            save_kimi_k25(model, tokenizer, tmp)
            save_kimi_tokenizer(tokenizer, tmp, KIMI_CHAT_TEMPLATE)  # as Kimi-K2.5 publishes it: tiktoken, remote code
        else:
            _save_model(model, tmp)
        (tmp / _BUILD_INFO).write_text(json.dumps(params, indent=2, sort_keys=True) + "\n")
        _fix_permissions(tmp)
        _replace_dir(tmp, out_dir, params)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    _say(f"built in {out_dir} ({time.monotonic() - started:.0f} s)")
    return out_dir


def _refuse_foreign(out_dir: Path) -> None:
    if out_dir.exists() and _read_build_info(out_dir) is None and any(out_dir.iterdir()):
        raise FileExistsError(f"{out_dir} exists, is not empty and is not a tiny target build; refusing to replace it")


def _say(line: str) -> None:
    """A build's progress line, on stderr: stdout stays the command's own output."""
    print(f"tiny target: {line}", file=sys.stderr, flush=True)


def _corpus_digest(files: Sequence[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        h.update(Path(path).read_bytes())
        h.update(b"\0")
    return h.hexdigest()


def _build_model(tokenizer: PreTrainedTokenizerFast, params: dict) -> PreTrainedModel:
    """The random-weight model of a build's `params` (what its build info records), seeded by params["seed"]."""
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    pad_id = tokenizer.convert_tokens_to_ids(PAD)
    if not isinstance(pad_id, int) or not isinstance(eos_id, int):  # one token in: one id out
        raise TypeError(f"the tokenizer maps {PAD!r}, {IM_END!r} to {pad_id!r}, {eos_id!r}, not to one id each")
    sizes = _config_sizes(tokenizer, params, eos_id, pad_id)
    config = (
        kimi_text_config(params, sizes)
        if params.get("shape") == "kimi"
        else LlamaConfig(
            **sizes,
            num_key_value_heads=params["num_kv_heads"],
            max_position_embeddings=params["max_position_embeddings"],
            tie_word_embeddings=False,
        )
    )
    # Seed a private copy of the global RNG so building does not disturb the caller's randomness.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(params["seed"])
        model_class = DeepseekV3ForCausalLM if isinstance(config, DeepseekV3Config) else LlamaForCausalLM
        model = model_class(config).to(torch.float32)  # type: ignore[arg-type]  # PreTrainedModel.to is @wraps(Module.to): typeshed's _Wrapped leaves self unbound
        torch.nn.init.normal_(model.lm_head.weight, mean=0.0, std=LM_HEAD_INIT_STD)
    model.generation_config = GenerationConfig(bos_token_id=None, eos_token_id=eos_id, pad_token_id=pad_id)
    return model.eval()


def _config_sizes(tokenizer: PreTrainedTokenizerFast, params: dict, eos_id: int, pad_id: int) -> dict[str, Any]:
    """The config keywords every shape takes from a build's params: sizes, special ids, float32."""
    return {
        "vocab_size": len(tokenizer),
        "hidden_size": params["hidden_size"],
        "intermediate_size": params["intermediate_size"],
        "num_hidden_layers": params["num_layers"],
        "num_attention_heads": params["num_heads"],
        "bos_token_id": None,
        "eos_token_id": eos_id,
        "pad_token_id": pad_id,
        "dtype": "float32",
    }


def _corpus_conversations(files: Sequence[Path]) -> Iterator[list[dict[str, str]]]:
    """Each corpus row as a conversation ending in an assistant turn, in file and row order.

    Rows with assistant turns (passthrough chats) are kept as they are. A prompt-only row gets an
    answer that restates the request (its first two sentences): text the model can learn in
    seconds, tied to the prompt, of a length that varies with it.
    """
    for path in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                row = json.loads(line)  # build_tokenizer has already read every row: valid JSON
                messages = [
                    m for m in row.get("messages") or [] if isinstance(m, dict) and isinstance(m.get("content"), str)
                ]
                if not messages and isinstance(row.get("prompt"), str):
                    messages = [{"role": "user", "content": row["prompt"]}]
                if not messages:
                    continue
                if messages[-1]["role"] != "assistant":
                    sentences = re.split(r"(?<=[.?!])\s+", messages[-1]["content"].strip())
                    messages = [*messages, {"role": "assistant", "content": " ".join(sentences[:2])}]
                yield messages


def _training_sequences(tokenizer: PreTrainedTokenizerFast, files: Sequence[Path]) -> list[list[int]]:
    """The corpus conversations rendered with the chat template, as token ids (one list per row)."""
    return _rendered(tokenizer, _corpus_conversations(files))


def _rendered(tokenizer: PreTrainedTokenizerFast, conversations: Iterable[list[dict[str, str]]]) -> list[list[int]]:
    """Each conversation rendered with the chat template, as token ids."""
    out = []
    for messages in conversations:
        encoded = tokenizer.apply_chat_template(messages, chat_template=CHAT_TEMPLATE, return_dict=True)
        if not isinstance(encoded, Mapping):  # return_dict=True: a BatchEncoding
            raise TypeError(f"apply_chat_template(return_dict=True) returned a {type(encoded).__name__}")
        out.append(list(encoded["input_ids"]))
    return out


def _book_sequences(tokenizer: PreTrainedTokenizerFast, files: Sequence[Path], seed: int) -> list[list[int]]:
    """The book's chapter conversations (models/target/book.py) rendered with the chat template, as token ids."""
    texts = book.chapters(files, seed)
    return _rendered(tokenizer, (book.conversation(n, text) for n, text in enumerate(texts, 1)))


def _train(
    model: PreTrainedModel,
    sequences: list[list[int]],
    steps: int,
    seed: int,
    device: torch.device,
    *,
    batch_size: int = TRAIN_BATCH,
    lr: float = TRAIN_LR,
    threads: int = TRAIN_THREADS,
    decay: bool = False,
    what: str = "training",
) -> None:
    """Train `model` in place for `steps` AdamW steps on `sequences`, packed; deterministic from `seed`.
    The rate warms up linearly over TRAIN_WARMUP steps to `lr`, then stays there, or (`decay`) falls linearly to 0.
    Says `what` it does, the step and the loss, every PROGRESS_EVERY_S and at the end.

    Each step reads batch_size x TRAIN_SEQ_LEN tokens from a stream of the sequences in shuffled
    order (a new order each pass, drawn from a private generator), every position a target.
    """
    if steps == 0 or not sequences:
        return
    order = torch.Generator().manual_seed(seed)  # private: the caller's RNG state is not touched
    stream: list[int] = []
    tokens_per_step = batch_size * TRAIN_SEQ_LEN

    def batch() -> torch.Tensor:
        nonlocal stream
        while len(stream) < tokens_per_step:
            for i in torch.randperm(len(sequences), generator=order).tolist():
                stream.extend(sequences[i])
        chunk, stream = stream[:tokens_per_step], stream[tokens_per_step:]
        return torch.tensor(chunk, dtype=torch.long).view(batch_size, TRAIN_SEQ_LEN)

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    model.to(device).train()  # type: ignore[arg-type]  # PreTrainedModel.to is @wraps(Module.to): typeshed's _Wrapped leaves self unbound
    try:
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        started = said = time.monotonic()
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = lr * min(1.0, (step + 1) / TRAIN_WARMUP) * ((1 - step / steps) if decay else 1.0)
            x = batch().to(device)
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            now = time.monotonic()
            if now - said >= PROGRESS_EVERY_S or step + 1 == steps:
                said, done, spent = now, step + 1, now - started
                left = f", about {spent / done * (steps - done):.0f} s to go" if done < steps else ""
                _say(f"{what}: step {done:,}/{steps:,}, loss {loss.item():.2f}, {spent:.0f} s{left}")
    finally:
        torch.set_num_threads(before)
        model.to("cpu").eval()  # type: ignore[arg-type]  # PreTrainedModel.to is @wraps(Module.to): typeshed's _Wrapped leaves self unbound


def _save_model(model: PreTrainedModel, out_dir: Path) -> None:
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
    """Publish the finished build `tmp` as `out_dir` (models/common/atomic.py), replacing an older tiny-target build
    there."""
    if out_dir.exists() and _read_build_info(out_dir) == params:  # a concurrent builder finished first
        return
    try:
        replace_dir(tmp, out_dir)
    except OSError:
        if _read_build_info(out_dir) != params:  # lost a race to an identical build: fine
            raise
