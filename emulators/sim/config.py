"""What the simulated SGLang model and server look like: `SimConfig`.

Its limits are SGLang's (sglang_protocol.limits.ModelLimits: SGLang 0.5.23, or 0.4.x with ``sglang_version="0.4"``), and
``disconnect_poll_s`` defaults to SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT (srt/environ.py, 4 s).
"""

from __future__ import annotations

import dataclasses
import math

from emulators.sglang_protocol.disconnect import DISCONNECT_POLL_S
from emulators.sglang_protocol.limits import ModelLimits
from emulators.sglang_protocol.versions import SGLangVersion

FIRST_ID = 10  # output ids are drawn from [10, vocab_size): clear of the usual special ids
LENGTH_DISTS = ("lognormal", "exponential", "fixed")


@dataclasses.dataclass(frozen=True)
class LengthRule:
    """The answer lengths of one dataset: requests whose rid holds ``"<dataset>:"`` (the generate stage's rids are
    ``<nonce>-<dataset>:<row id>``: tasks/serving/client.py `request_id`) draw from this distribution instead of the
    server's default one. A simulated mixture of datasets, as a real target answers code longer than chat."""

    dataset: str
    length_dist: str = "lognormal"
    mean_len: float = 200.0
    sigma: float = 1.0

    def __post_init__(self):
        if not self.dataset or ":" in self.dataset:
            raise ValueError(f"a length rule needs a dataset name without ':', got {self.dataset!r}")
        _check_length(self.length_dist, self.mean_len, self.sigma, f"length rule {self.dataset!r}: ")


def _check_length(dist: str, mean_len: float, sigma: float, where: str = "") -> None:
    if dist not in LENGTH_DISTS:
        raise ValueError(f"{where}length_dist must be lognormal, exponential or fixed, got {dist!r}")
    if mean_len < 1 or sigma < 0:
        raise ValueError(f"{where}need mean_len >= 1 and sigma >= 0, got {mean_len}, {sigma}")


@dataclasses.dataclass(frozen=True)
class SimConfig:
    """What the simulated model and server look like."""

    vocab_size: int = 32000
    eos_token_id: int = 1  # the stop token when a request gives no stop_token_ids
    length_dist: str = "lognormal"  # "lognormal" (long tail) | "exponential" | "fixed"
    mean_len: float = 200.0  # mean natural output length, before the max_new_tokens cut
    sigma: float = 1.0  # lognormal shape: larger = longer tail
    context_length: int = 32768
    max_running: int = 16  # sequences decoding at once; the rest wait FIFO
    decode_s_per_token: float = 0.01  # wall time per output token of one running sequence
    prefill_s_per_token: float = 0.0  # wall time per prompt token, once, at the start
    seed: int = 0  # mixed into every output: another seed, another "model"
    model_path: str = "sim-model"
    # SGLang's SGLANG_REQUEST_STATE_WAIT_TIMEOUT: a gone client is noticed on a poll this often (<= 0: at once)
    disconnect_poll_s: float = DISCONNECT_POLL_S
    sglang_version: str = "0.5"  # "0.5" (SGLang 0.5.23) | "0.4" (0.4.x where they differ)
    reserved_tokens: int = 0  # per-request tokens an EAGLE server reserves in its length checks (0: no draft)
    length_rules: tuple[LengthRule, ...] = ()  # per-dataset lengths, by rid; the fields above for any other rid

    def __post_init__(self):
        _check_length(self.length_dist, self.mean_len, self.sigma)
        if self.vocab_size <= FIRST_ID + 1:
            raise ValueError(f"vocab_size must exceed {FIRST_ID + 1}, got {self.vocab_size}")
        names = [rule.dataset for rule in self.length_rules]
        if len(set(names)) != len(names):
            raise ValueError(f"length_rules name a dataset twice: {sorted(names)}")
        if self.context_length < 8:
            raise ValueError(f"context_length must be at least 8, got {self.context_length}")
        if self.max_running < 1:
            raise ValueError(f"max_running must be at least 1, got {self.max_running}")
        if self.decode_s_per_token < 0 or self.prefill_s_per_token < 0:
            raise ValueError("decode_s_per_token and prefill_s_per_token must be >= 0")
        SGLangVersion.of(self.sglang_version)  # validates
        if self.reserved_tokens < 0:
            raise ValueError(f"reserved_tokens must be >= 0, got {self.reserved_tokens}")

    def length_for(self, rid: str | None) -> LengthRule:
        """The length distribution of the request `rid`: the rule whose ``"<dataset>:"`` the rid holds, else the
        server's default."""
        if rid is not None:
            for rule in self.length_rules:
                if f"{rule.dataset}:" in rid:
                    return rule
        return LengthRule("default", self.length_dist, self.mean_len, self.sigma)

    @property
    def version(self) -> SGLangVersion:
        return SGLangVersion.of(self.sglang_version)

    @property
    def limits(self) -> ModelLimits:
        """The vocabulary and context, and SGLang's limits from them (reserved tokens included)."""
        return ModelLimits(
            vocab_size=self.vocab_size,
            context_length=self.context_length,
            reserved_tokens=self.reserved_tokens,
            sglang_version=self.version,
        )

    @property
    def max_req_len(self) -> int:
        return self.limits.max_req_len

    @property
    def max_req_input_len(self) -> int:
        return self.limits.max_req_input_len

    @property
    def capacity_tokens_per_s(self) -> float:
        """Output tokens/s with every slot busy (inf when decoding takes no time)."""
        return math.inf if self.decode_s_per_token == 0 else self.max_running / self.decode_s_per_token
