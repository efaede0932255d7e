"""tasks/runtime/threads.py: a cancellation never hides what the worker thread did."""

from __future__ import annotations

import asyncio
import threading

import pytest

from tasks.runtime import threads
from tasks.runtime.threads import run_to_the_end


def test_a_result_that_arrives_with_the_cancellation_is_returned_not_lost(monkeypatch):
    """The thread ends in the same loop step as the caller's cancellation (seen in CI: a budget stop cancelled a
    flush whose part was already written; the rows were put back and written again as a second part). shield
    stands in for that step: it lets the thread finish, then delivers the cancellation."""
    wrote = []

    def write():
        wrote.append("part-000002")
        return "part-000002"

    async def finished_then_cancelled(future):
        await future
        raise asyncio.CancelledError

    monkeypatch.setattr(threads.asyncio, "shield", finished_then_cancelled)
    assert asyncio.run(run_to_the_end(write)) == ("part-000002", True)  # the caller learns it was written
    assert wrote == ["part-000002"]


def test_a_cancellation_while_the_thread_runs_waits_for_it_and_says_so():
    started, go = threading.Event(), threading.Event()

    def slow():
        started.set()
        go.wait(30)
        return 7

    async def main():
        task = asyncio.create_task(run_to_the_end(slow))
        while not started.is_set():
            await asyncio.sleep(0.001)  # a poll, not a wait for anything: the event decides
        task.cancel()
        await asyncio.sleep(0)
        assert not task.done()  # still waiting for the thread
        go.set()
        return await task

    assert asyncio.run(main()) == (7, True)


def test_an_exception_of_the_work_is_raised_as_it_is():
    def broken():
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError, match="No space left"):
        asyncio.run(run_to_the_end(broken))
