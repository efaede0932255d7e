"""The generate bench's prompts: random token ids of varied lengths, a stand-in tokenizer that reads them back, and
the completion length the simulated server will give each."""

from __future__ import annotations

import math

import numpy as np

from bench.generate_params import Params
from emulators.sim import simulate_output
from tasks.datasets import PromptRow

FIRST_ID = 10  # prompt ids are drawn from [FIRST_ID, vocab): clear of the special ids


class IdsTokenizer:
    """Stands in for the target tokenizer: a prompt's content is its token ids, space-separated."""

    def apply_chat_template(self, messages, add_generation_prompt=True, tokenize=True, return_dict=True):
        ids = [int(t) for t in messages[-1]["content"].split()]
        return {"input_ids": ids} if return_dict else ids


def make_prompts(p: Params, n: int, vocab: int) -> list[PromptRow]:
    rng = np.random.default_rng(p.seed + 1)
    mu = math.log(p.prompt_mean_len) - 0.8**2 / 2
    lengths = np.clip(np.rint(rng.lognormal(mu, 0.8, n)), 8, 4000).astype(int)
    rows = []
    for i, length in enumerate(lengths):
        ids = rng.integers(FIRST_ID, vocab, int(length))
        rows.append(PromptRow(id=f"p{i:06d}", messages=[{"role": "user", "content": " ".join(map(str, ids.tolist()))}]))
    return rows


def prompt_ids(row: PromptRow) -> list[int]:
    return IdsTokenizer().apply_chat_template(row.messages)["input_ids"]


def expected_lengths(p: Params, prompts: list[PromptRow]) -> list[int]:
    """The completion length the simulated server will give each prompt (it is a pure function)."""
    cfg, params = p.sim_config(), p.sampling_params()
    return [len(simulate_output(prompt_ids(r), params, cfg).output_ids) for r in prompts]
