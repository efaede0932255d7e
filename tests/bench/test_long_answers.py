"""bench/long_answers.py's two counts, on hand-counted token lists."""

from __future__ import annotations

from bench.long_answers import distinct_share, same_prefix


def test_a_loop_has_few_distinct_8grams_and_new_text_has_all():
    loop = [1, 2, 3] * 10  # 30 tokens: 23 8-grams, 3 distinct (one per phase of the loop)
    assert distinct_share(loop) == 3 / 23
    assert distinct_share(list(range(30))) == 1.0
    assert distinct_share([1, 2, 3]) == 1.0  # shorter than one 8-gram


def test_same_prefix_counts_the_shared_first_tokens():
    assert same_prefix([5, 6, 7, 8], [5, 6, 9]) == 2
    assert same_prefix([5, 6], [5, 6, 7]) == 2
    assert same_prefix([1], [2]) == 0
