"""Context-position buckets (models/eval/context.py): where an engine's rounds start, from its per-round counts."""

from __future__ import annotations

import pytest

from models.eval.context import by_context, count_rounds, request_bucket, rounds_from_steps


def test_rounds_start_after_the_prompt_the_prefill_s_token_and_the_rounds_before():
    # prompt 10; the prefill's token is answer token 1; rounds of 4, 1, 3 tokens start at 11, 15, 16
    assert rounds_from_steps(10, 9, [3, 0, 2]) == [(11, 4), (15, 1), (16, 3)]
    # the end cuts the last round: it keeps what is left (vLLM counts its accepted drafts before the stop trims them)
    assert rounds_from_steps(10, 7, [3, 0, 2]) == [(11, 4), (15, 1), (16, 1)]
    assert rounds_from_steps(10, 1, []) == []  # ended on the prefill's token


@pytest.mark.parametrize(
    ("tokens", "accepted", "said"),
    [
        (12, [3, 0, 2], "3 rounds make 9 of the answer's 12 tokens"),  # a step without drafts made the rest
        (5, [3, 1], "round 2 of 2 starts after the answer's 5 tokens were made"),
        (5, [3, -1], "non-negative ints"),
        (3, [], "0 rounds make 1 of the answer's 3 tokens"),
    ],
)
def test_counts_that_cannot_be_placed_are_refused(tokens, accepted, said):
    with pytest.raises(ValueError, match=said):
        rounds_from_steps(4, tokens, accepted)


def test_rounds_are_counted_in_the_bucket_of_their_start():
    rounds, tokens = count_rounds([(3, 2), (8, 4), (9, 1), (40, 3)], [8, 16])
    assert (rounds, tokens) == ([1, 2, 1], [2, 5, 3])  # 8 opens the second bucket
    assert [b["label"] for b in by_context(rounds, tokens, [8, 16])] == ["0-8", "8-16", "16+"]


def test_a_request_is_in_one_bucket_only_when_its_first_and_last_round_start_there():
    # rounds start at prompt + 1 .. prompt + tokens - 1 (the last answer token is made by the last round)
    assert request_bucket(600, 9, [512, 1024]) == 1  # 601..608
    assert request_bucket(503, 9, [512, 1024]) == 0  # 504..511: the last round starts at 511 at the latest
    assert request_bucket(503, 10, [512, 1024]) is None  # 504..512: a round may start at 512
    assert request_bucket(511, 2, [512]) == 1  # the only round starts at 512
    assert request_bucket(40, 1, [512]) == 0  # no round: wherever it is, it adds nothing
