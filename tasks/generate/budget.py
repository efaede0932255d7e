"""Token budget gate: admission control on a dataset's completion-token budget."""

from __future__ import annotations

from dataclasses import dataclass

# Completed responses needed before their mean replaces the conservative max_new_tokens estimate.
MIN_SAMPLES = 16


@dataclass
class TokenBudget:
    """Keeps spent + expected in-flight completion tokens under `limit`.

    `spent` counts completion tokens of recorded responses, restored from the checkpoints on
    resume. A request is admitted while spent + (in_flight + 1) * expected <= limit, and one
    request is always allowed when nothing is in flight so a dataset never stalls short of its
    budget. Once spent reaches the limit the dataset is exhausted and the caller aborts what is
    still in flight; tokens of aborted requests are counted as `wasted`.
    """

    limit: int | None
    max_new_tokens: int
    spent: int = 0
    in_flight: int = 0
    wasted: int = 0
    _finished: int = 0
    _finished_tokens: int = 0
    _finished_sq: int = 0  # sum of squared lengths: for the size-biased mean

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.spent >= self.limit

    def expected_length(self) -> float:
        """Expected completion tokens of a request still running.

        Not the mean of finished lengths: a request is in flight for a time proportional to its
        length, so the ones running at any moment are the long ones (length-biased sampling). Their
        expected length is sum(L^2) / sum(L) over finished responses, which with long-tailed lengths
        is well above the plain mean; using the plain mean admits too much near the budget and the
        abort then wastes the long runners' tokens.
        """
        if self._finished < MIN_SAMPLES or self._finished_tokens == 0:
            return float(self.max_new_tokens)
        return min(float(self.max_new_tokens), self._finished_sq / self._finished_tokens)

    def can_admit(self) -> bool:
        if self.limit is None:
            return True
        if self.exhausted:
            return False
        if self.in_flight == 0:
            return True
        return self.spent + (self.in_flight + 1) * self.expected_length() <= self.limit

    def seed(self, lengths: list[int]) -> None:
        """Start the length estimate from responses recorded before a restart."""
        self._finished += len(lengths)
        self._finished_tokens += sum(lengths)
        self._finished_sq += sum(n * n for n in lengths)

    def admit(self) -> None:
        self.in_flight += 1

    def finish(self, completion_tokens: int) -> None:
        """A response was recorded: its tokens are spent."""
        self.in_flight -= 1
        self.spent += completion_tokens
        self._finished += 1
        self._finished_tokens += completion_tokens
        self._finished_sq += completion_tokens * completion_tokens

    def discard(self, wasted_tokens: int = 0) -> None:
        """A request ended without a recorded response (aborted, rejected, failed)."""
        self.in_flight -= 1
        self.wasted += wasted_tokens

    @property
    def fraction(self) -> float | None:
        return None if self.limit is None else self.spent / self.limit
