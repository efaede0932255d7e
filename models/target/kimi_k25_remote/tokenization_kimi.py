"""The tiny kimi_k25 checkpoint's tokenizer: eagle3-pipeline's own code, written to Kimi-K2.5's published interface.

Kimi-K2.5 ships its tokenizer as remote code, not as a tokenizer.json: `tiktoken.model` (tiktoken's mergeable ranks,
one `base64(token bytes) rank` line per token), this file defining `TikTokenTokenizer(PreTrainedTokenizer)`, and a
tokenizer_config.json naming it (`"tokenizer_class": "TikTokenTokenizer"`, `"auto_map": {"AutoTokenizer":
["tokenization_kimi.TikTokenTokenizer", null]}`) whose `added_tokens_decoder` gives the special tokens and their ids.
`AutoTokenizer.from_pretrained(path, trust_remote_code=True)` loads it. The file names, the class name, the constructor
arguments and the tokenizer_config keys follow that interface; the code is ours, not Moonshot's.

What differs from Kimi-K2.5's own tokenizer, by design:
- `pat_str` is GPT-2's pre-tokenization regex (tiktoken's r50k_base spelling), not Kimi's: the tiny target's ranks are
  converted from a byte-level BPE trained with the GPT-2 split (models/target/kimi_tokenizer.py), and tiktoken with
  that split gives the BPE's ids.
- the special tokens may sit anywhere in the id space (the tiny target's are 0..7 and the last id), not only after
  the ranks; an id that is neither a rank nor a configured special token becomes a reserved special token
  `<|reserved_token_{id}|>`, as Kimi fills up its ids.
- the ranks are read with the standard library, not `tiktoken.load.load_tiktoken_bpe`: that one caches a file by its
  *path* in the temp dir, so a rebuilt checkpoint in the same directory would load the previous build's ranks.

Imports: only the standard library, tiktoken and transformers (what transformers' remote-code loader can resolve);
it works under transformers 5.19 and 5.24.
"""

from __future__ import annotations

import base64
import os
import shutil
from collections.abc import Iterator
from typing import Any

import tiktoken
from transformers import AddedToken, PreTrainedTokenizer

VOCAB_FILES_NAMES = {"vocab_file": "tiktoken.model"}

# GPT-2's split (HF ByteLevel's `use_regex=True`), in tiktoken's spelling
PAT_STR = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""

# tiktoken's regex overflows its stack on very long runs of whitespace (or of non-whitespace) characters: longer runs
# are cut into pieces of this many characters and each piece encoded on its own. Only such runs tokenize differently
# from the byte-level BPE the ranks were converted from.
MAX_RUN_CHARS = 25_000


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table: how byte-level BPE vocabularies spell a token's bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return table


def read_ranks(path: str | os.PathLike[str]) -> dict[bytes, int]:
    """The mergeable ranks of a `tiktoken.model` file: `base64(token bytes) rank` per line."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                token, rank = line.split()
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: not a `base64(token) rank` line: {line[:80]!r}") from e
    if len(set(ranks.values())) != len(ranks):
        raise ValueError(f"{path}: two tokens share a rank")
    return ranks


def _content(token: Any) -> str:
    """The text of an `added_tokens_decoder` entry: an AddedToken, its dict form (tokenizer_config.json) or a str."""
    if isinstance(token, AddedToken):
        return token.content
    if isinstance(token, dict):
        return str(token["content"])
    return str(token)


def _runs(text: str, max_len: int) -> Iterator[str]:
    """`text` in consecutive pieces, each with no run of whitespace or non-whitespace longer than `max_len`."""
    if len(text) <= max_len:
        yield text
        return
    start = 0
    run = 0
    space = text[:1].isspace()
    for i, ch in enumerate(text):
        if ch.isspace() != space:
            space = not space
            run = 1
        else:
            run += 1
            if run > max_len:
                yield text[start:i]
                start = i
                run = 1
    yield text[start:]


class TikTokenTokenizer(PreTrainedTokenizer):
    """A tiktoken BPE (`tiktoken.model`) with special tokens from tokenizer_config.json's `added_tokens_decoder`.

    Token strings (`get_vocab`, `convert_ids_to_tokens`) spell a token's bytes with GPT-2's byte -> character table,
    as a byte-level BPE does; special tokens are spelled as themselves. `encode` and `decode` without options go
    straight to tiktoken (special tokens in the text are encoded as special tokens); with options, and for
    `__call__` and `apply_chat_template`, transformers' slow-tokenizer path runs over `_tokenize`, with the same ids.
    """

    vocab_files_names = VOCAB_FILES_NAMES
    model_input_names = ["input_ids", "attention_mask"]
    pat_str = PAT_STR

    def __init__(
        self,
        vocab_file: str,
        bos_token: str | AddedToken | None = None,
        eos_token: str | AddedToken | None = "<|im_end|>",
        unk_token: str | AddedToken | None = None,
        pad_token: str | AddedToken | None = "<|pad|>",
        additional_special_tokens: list[str] | None = None,
        added_tokens_decoder: dict[int, Any] | None = None,
        **kwargs: Any,
    ) -> None:
        self.vocab_file = vocab_file
        ranks = read_ranks(vocab_file)
        given = {int(i): t for i, t in (added_tokens_decoder or {}).items()}  # keys are str in the json
        specials = {i: _content(t) for i, t in given.items()}
        clash = sorted(set(specials) & set(ranks.values()))
        if clash:
            raise ValueError(f"{vocab_file}: ids {clash[:8]} are both ranks and special tokens")
        n_vocab = max([*ranks.values(), *specials]) + 1
        reserved = set(range(n_vocab)) - set(ranks.values()) - set(specials)
        specials.update({i: f"<|reserved_token_{i}|>" for i in reserved})
        self.special_tokens: dict[str, int] = {content: i for i, content in sorted(specials.items())}
        if len(self.special_tokens) != len(specials):
            raise ValueError("two special tokens in added_tokens_decoder have the same content")

        self.model = tiktoken.Encoding(
            name=os.path.basename(vocab_file),
            pat_str=self.pat_str,
            mergeable_ranks=ranks,
            special_tokens=self.special_tokens,
        )
        self.n_words: int = n_vocab
        self.byte_encoder = bytes_to_unicode()
        self.byte_decoder = {c: b for b, c in self.byte_encoder.items()}
        self.decoder: dict[int, str] = {i: "".join(self.byte_encoder[b] for b in tok) for tok, i in ranks.items()}
        self.decoder.update(specials)
        self.encoder: dict[str, int] = {tok: i for i, tok in self.decoder.items()}
        self._special_ids = frozenset(specials)

        # Every special token of the tiktoken model is an added special token of transformers' (so that the slow
        # path's split on added tokens is tiktoken's split on special tokens); the configured ones keep their flags.
        decoder: dict[int, AddedToken] = {}
        for i, content in sorted(specials.items()):
            token = given.get(i)
            if isinstance(token, AddedToken):
                decoder[i] = token
            elif isinstance(token, dict):
                flags = {k: v for k, v in token.items() if k in ("single_word", "lstrip", "rstrip", "normalized")}
                decoder[i] = AddedToken(content, special=bool(token.get("special", True)), **flags)
            else:
                decoder[i] = AddedToken(content, special=True, normalized=False)
        kwargs.setdefault("clean_up_tokenization_spaces", False)
        if additional_special_tokens is not None:
            kwargs["additional_special_tokens"] = additional_special_tokens
        super().__init__(
            bos_token=bos_token,
            eos_token=eos_token,
            unk_token=unk_token,
            pad_token=pad_token,
            added_tokens_decoder=decoder,
            **kwargs,
        )

    # ----- the tiktoken fast paths -----

    def _tiktoken_encode(self, text: str, allow_special_tokens: bool) -> list[int]:
        ids: list[int] = []
        for piece in _runs(text, MAX_RUN_CHARS):
            if allow_special_tokens:
                ids.extend(self.model.encode(piece, allowed_special="all"))
            else:
                ids.extend(self.model.encode_ordinary(piece))
        return ids

    def encode(
        self,
        text: Any,
        text_pair: Any = None,
        add_special_tokens: bool = True,
        allow_special_tokens: bool = True,
        **kwargs: Any,
    ) -> list[int]:
        """`text`'s ids. Without other options, by tiktoken: special tokens written in the text become their ids
        (`allow_special_tokens=False`: they are encoded as text); this tokenizer adds no bos/eos, so
        `add_special_tokens` changes nothing. With other options, transformers' `encode`."""
        if isinstance(text, str) and text_pair is None and not kwargs:
            return self._tiktoken_encode(text, allow_special_tokens)
        if not allow_special_tokens:
            kwargs["split_special_tokens"] = True
        return super().encode(text, text_pair=text_pair, add_special_tokens=add_special_tokens, **kwargs)

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> str | list[str]:
        """The text of `token_ids` by tiktoken (invalid UTF-8 replaced); with other options, transformers' `decode`."""
        if not kwargs:
            if hasattr(token_ids, "tolist"):  # a tensor or an array
                token_ids = token_ids.tolist()
            if isinstance(token_ids, int):
                token_ids = [token_ids]
            if isinstance(token_ids, list) and all(isinstance(t, int) for t in token_ids):
                if skip_special_tokens:
                    token_ids = [t for t in token_ids if t not in self._special_ids]
                return self.model.decode(token_ids, errors="replace")
        return super().decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)

    # ----- what transformers' PreTrainedTokenizer needs -----

    @property
    def vocab_size(self) -> int:
        return self.n_words

    def get_vocab(self) -> dict[str, int]:
        return dict(self.encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        # transformers has already split the added (special) tokens out; what is left is ordinary text
        return [self.decoder[i] for i in self._tiktoken_encode(text, allow_special_tokens=False)]

    def _convert_token_to_id(self, token: str) -> int | None:
        i = self.encoder.get(token)
        if i is None and self.unk_token is not None:
            return self.encoder.get(str(self.unk_token))
        return i

    def _convert_id_to_token(self, index: int) -> str | None:  # type: ignore[override]
        return self.decoder.get(index)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        out = bytearray()
        for token in tokens:
            if token in self.special_tokens:
                out += token.encode("utf-8")
            else:
                out += bytes(self.byte_decoder[c] for c in token)
        return out.decode("utf-8", errors="replace")

    @staticmethod
    def clean_up_tokenization(out_string: str) -> str:
        return out_string

    def save_vocabulary(self, save_directory: str, filename_prefix: str | None = None) -> tuple[str, ...]:
        if not os.path.isdir(save_directory):
            raise ValueError(f"vocabulary path ({save_directory}) should be a directory")
        name = (filename_prefix + "-" if filename_prefix else "") + VOCAB_FILES_NAMES["vocab_file"]
        out = os.path.join(save_directory, name)
        if os.path.abspath(self.vocab_file) != os.path.abspath(out):
            shutil.copyfile(self.vocab_file, out)
        return (out,)

    def apply_chat_template(  # type: ignore[override]
        self,
        conversation: Any,
        tools: Any = None,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        """transformers' `apply_chat_template`; the remaining keyword arguments (Kimi-K2.5's `thinking`) reach the
        chat template."""
        return super().apply_chat_template(
            conversation, tools=tools, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
        )
