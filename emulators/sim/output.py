"""The simulated model: SGLang's answer as a pure function of the prompt, the sampling params and the config.

Outputs are a pure function of the prompt and the sampling parameters (``simulate_output``):
the same prompt always gets the same answer, so "outputs equal a clean run" is checkable after
crashes, retries and restarts. The output length is drawn from a long-tailed distribution
(lognormal by default), the ids are random in ``[10, vocab_size)``, a natural end appends the stop
token (``stop_token_ids[0]``, else ``eos_token_id``) with finish ``stop``; otherwise the output is
cut at ``max_new_tokens`` with finish ``length``. A natural end AT ``max_new_tokens`` is ``stop``,
as SGLang 0.5.23 checks the stop token before the length cap (schedule_batch.py
``Req.update_finish_state``; with ``sglang_version="0.4"``: ``length``, 0.4.x ``check_finished``).
A smaller ``max_new_tokens`` gives a prefix of the same output, as greedy decoding would.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
import struct
from array import array
from typing import Any

import numpy as np

from emulators.sglang_protocol.errors import MalformedRequest
from emulators.sglang_protocol.results import finish_reason, text_token_ids
from emulators.sglang_protocol.sampling import parse_sampling_params
from emulators.sim.config import FIRST_ID, LengthRule, SimConfig


@dataclasses.dataclass(frozen=True)
class SimOutput:
    """What the simulated model answers to one prompt."""

    output_ids: list[int]  # the matched stop token included, as SGLang returns them
    finish_reason: dict[str, Any]  # {"type": "stop", "matched": id} | {"type": "length", "length": n}
    natural_length: int  # the drawn length before the max_new_tokens cut (ignores ignore_eos)
    no_stop_trim: bool = False

    @property
    def text(self) -> str:
        return output_text(self.output_ids, self.finish_reason, self.no_stop_trim)


def output_text(ids: list[int], finish: dict, no_stop_trim: bool) -> str:
    """Deterministic detokenisation: ``t<id>`` per token; the matched stop token is trimmed."""
    return " ".join([f"t{t}" for t in text_token_ids(ids, finish, no_stop_trim)])


def _id_array(prompt_ids: Any) -> array:
    """The prompt as a C array of int64 (type-checks every element at C speed)."""
    if isinstance(prompt_ids, array) and prompt_ids.typecode == "q":
        return prompt_ids
    if isinstance(prompt_ids, (str, bytes)) or not hasattr(prompt_ids, "__iter__"):
        raise MalformedRequest("input_ids must be a list of ints or a list of lists of ints")
    try:
        return array("q", prompt_ids)
    except (TypeError, OverflowError):
        raise MalformedRequest("input_ids must be a list of ints or a list of lists of ints") from None


def _natural_length(rng: random.Random, rule: LengthRule) -> int:
    if rule.length_dist == "fixed":
        x = rule.mean_len
    elif rule.length_dist == "exponential":
        x = rng.expovariate(1.0 / rule.mean_len)
    else:  # lognormal with the requested mean: E[X] = exp(mu + sigma^2 / 2)
        mu = math.log(rule.mean_len) - rule.sigma**2 / 2
        x = rng.lognormvariate(mu, rule.sigma)
    return max(1, int(round(min(x, 1e9))))


def simulate_output(
    prompt_ids: Any, params: Any = None, config: SimConfig | None = None, rid: str | None = None
) -> SimOutput:
    """The simulated model's answer: a pure function of (prompt ids, sampling params, config).

    `params` is a request's raw ``sampling_params`` dict (or None, or a `SamplingParams`). The
    random stream is seeded from a sha256 of config.seed, the prompt ids and the parameters that
    change a real model's sampling (temperature, top_p, top_k, sampling_seed; none of them when
    greedy). max_new_tokens, ignore_eos and the stop ids only decide where the stream is cut. The request id `rid`
    only picks the length distribution (`SimConfig.length_for`: a dataset's rule, else the default).
    """
    cfg = config or SimConfig()
    p = parse_sampling_params(params)
    ids = _id_array(prompt_ids)
    n = len(ids)

    limit = cfg.limits.max_new_tokens(n, p)

    h = hashlib.sha256(b"eagle3-sim-v1")
    h.update(struct.pack("<q", cfg.seed))
    if p.greedy:
        h.update(b"greedy")
    else:
        h.update(
            struct.pack("<ddqq", p.temperature, p.top_p, p.top_k, -1 if p.sampling_seed is None else p.sampling_seed)
        )
    h.update(ids.tobytes())
    rng = random.Random(int.from_bytes(h.digest(), "big"))

    natural = _natural_length(rng, cfg.length_for(rid))  # drawn first: the ids below never depend on the cut
    if p.ignore_eos:
        length, stop = limit, False  # ignore_eos also disables stop_token_ids, as in SGLang
    elif natural <= limit:
        length, stop = natural, True
    else:
        length, stop = limit, False
    n_content = length - 1 if stop else length

    # 4 random bytes per token (little-endian uint32); randbytes(k) is a prefix of randbytes(k + m) for one seed.
    # In bulk (numpy), so that a server answering millions of tokens is not the bottleneck of a benchmark.
    span = cfg.vocab_size - FIRST_ID
    content = np.frombuffer(rng.randbytes(4 * n_content), dtype="<u4").astype(np.int64) % span + FIRST_ID
    stop_id = p.stop_token_ids[0] if p.stop_token_ids else cfg.eos_token_id
    stops = sorted({cfg.eos_token_id, *p.stop_token_ids})
    inside = [s for s in stops if FIRST_ID <= s < cfg.vocab_size]
    while inside and (hit := np.isin(content, inside)).any():  # keep stop ids out of the content: the next id up
        content[hit] = FIRST_ID + (content[hit] - FIRST_ID + 1) % span
    out: list[int] = content.tolist()
    if stop:
        out.append(stop_id)
    # The finish of those ids as SGLang labels it (sglang_protocol.results.finish_reason): a natural end AT the cap is
    # "stop" in 0.5.23 (`update_finish_state` checks the stop token first), "length" in 0.4.x (`check_finished`).
    finish = finish_reason(out, limit, () if p.ignore_eos else (stop_id,), cfg.version)
    assert finish is not None  # the ids end at the stop token or at the cap
    return SimOutput(out, finish, natural, p.no_stop_trim)
