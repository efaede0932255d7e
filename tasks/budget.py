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

    @property
    def exhausted(self) -> bool:
        return self.limit is not None and self.spent >= self.limit

    def expected_length(self) -> float:
        """Expected completion tokens of a request not yet finished."""
        if self._finished < MIN_SAMPLES:
            return float(self.max_new_tokens)
        return self._finished_tokens / self._finished

    def can_admit(self) -> bool:
        if self.limit is None:
            return True
        if self.exhausted:
            return False
        if self.in_flight == 0:
            return True
        return self.spent + (self.in_flight + 1) * self.expected_length() <= self.limit

    def seed(self, count: int, tokens: int) -> None:
        """Start the length estimate from responses recorded before a restart."""
        self._finished += count
        self._finished_tokens += tokens

    def admit(self) -> None:
        self.in_flight += 1

    def finish(self, completion_tokens: int) -> None:
        """A response was recorded: its tokens are spent."""
        self.in_flight -= 1
        self.spent += completion_tokens
        self._finished += 1
        self._finished_tokens += completion_tokens

    def discard(self, wasted_tokens: int = 0) -> None:
        """A request ended without a recorded response (aborted, rejected, failed)."""
        self.in_flight -= 1
        self.wasted += wasted_tokens

    @property
    def fraction(self) -> float | None:
        return None if self.limit is None else self.spent / self.limit
