"""The target's tokenizer, as every stage loads it: `load_tokenizer`.

Kimi-K2.5 publishes its tokenizer as code (tokenizer_config.json `auto_map.AutoTokenizer` ->
`tokenization_kimi.TikTokenTokenizer`, beside `tiktoken.model`), which transformers runs only with
`trust_remote_code=True`. Without it transformers 5 does not refuse: it reads tiktoken.model with its own converter
and returns a tokenizer whose special tokens have other ids (on the tiny kimi build: `<|im_end|>` 2056 instead of 1,
124 of the 259 sample texts encoded differently). Every id the pipeline writes would be wrong, silently. So a target
whose tokenizer_config.json maps AutoTokenizer to its own code is refused here unless `target.trust_remote_code` is
set, with the setting to change.

Loads are taken one at a time in a process (`_LOADING`). Loading a tokenizer that is code makes transformers parse
that code (dynamic_module_utils.py `get_imports`, `ast.parse`), and CPython 3.11's AST constructor keeps its recursion
depth in the interpreter, not the thread (python/cpython#106905): two threads parsing at once can fail with
`SystemError: AST constructor recursion depth mismatch`. Generate loads the tokenizer in every dataset task, in threads
beside one another; it failed so once in CI (the Kimi test demo's B4_chat).
"""

from __future__ import annotations

import json
import threading
from typing import Any

from models.target.weights import checkpoint_dir

_LOADING = threading.Lock()


class RemoteTokenizerNotTrusted(ValueError):
    """The target's tokenizer is its own code and target.trust_remote_code is false."""


def remote_tokenizer_class(target_path: str) -> str | None:
    """The class tokenizer_config.json's auto_map names for AutoTokenizer (the target's own code), or None."""
    try:
        config = json.loads((checkpoint_dir(target_path) / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    auto = (config.get("auto_map") or {}).get("AutoTokenizer") if isinstance(config, dict) else None
    if isinstance(auto, list):
        auto = next((name for name in auto if name), None)
    return auto if isinstance(auto, str) else None


def check_tokenizer_trust(target_path: str, trust_remote_code: bool) -> None:
    """RemoteTokenizerNotTrusted if the target's tokenizer is its own code and trust_remote_code is false."""
    remote = None if trust_remote_code else remote_tokenizer_class(target_path)
    if remote is not None:
        raise RemoteTokenizerNotTrusted(
            f"target {target_path}: its tokenizer is the checkpoint's own code (tokenizer_config.json auto_map "
            f"AutoTokenizer: {remote}), and target.trust_remote_code is false. Without it transformers reads the "
            "vocabulary on its own and gives other ids to the special tokens (end of turn included), so every id "
            "written would be wrong: set target.trust_remote_code: true (Kimi-K2.5 needs it)"
        )


def load_tokenizer(target_path: str, trust_remote_code: bool) -> Any:
    """The target's tokenizer (transformers' AutoTokenizer), refused as `check_tokenizer_trust` says; one load at a
    time in a process (the module's docstring says why)."""
    from transformers import AutoTokenizer

    check_tokenizer_trust(target_path, trust_remote_code)
    with _LOADING:
        return AutoTokenizer.from_pretrained(target_path, trust_remote_code=trust_remote_code)
