"""Blocking work in a worker thread that a cancellation waits for instead of abandoning.

`asyncio.to_thread` returns to a cancelled caller at once while its thread goes on: a part being
written still lands on disk after the caller has put its rows back to be written again (a
duplicate), or while the next writer numbers its part from a directory the first has not yet
renamed into (a part overwritten: rows lost). Every write of a checkpoint goes through
`run_to_the_end` instead: the caller sees the thread's true outcome, and the cancellation after it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


async def run_to_the_end(fn: Callable[..., T], *args, **kwargs) -> tuple[T, bool]:
    """`fn(*args, **kwargs)` in a worker thread, awaited until it ends even through cancellations.

    Returns (its result, whether the caller was cancelled meanwhile): a caller that was cancelled
    records what the thread did, then raises `asyncio.CancelledError` itself. An exception of `fn`
    is raised as it is.
    """
    future = asyncio.ensure_future(asyncio.to_thread(fn, *args, **kwargs))
    cancelled = False
    while True:
        try:
            return await asyncio.shield(future), cancelled
        except asyncio.CancelledError:
            if future.done():
                if future.cancelled():  # the thread's own future was cancelled (the loop is closing): nothing runs
                    raise
                # the thread ended in the same step as the cancellation arrived: what it did stands (a part it
                # wrote is on disk, and a caller that put its rows back would write them twice)
                return future.result(), True
            cancelled = True
