"""Client disconnect: a client that went away is noticed only as SGLang 0.5.23 notices it (`results_or_abort`).

SGLang notices a client that went away only when its wait for the request's output times out, every
``SGLANG_REQUEST_STATE_WAIT_TIMEOUT`` = 4 s (srt/environ.py) counted from the request's start
(tokenizer_manager.py ``_stream_one_response``); it then aborts the request (``abort_request(rid)``,
the prefix rule of rids.py). Until then the request runs and its rid is held. `results_or_abort`
emulates that poll (``disconnect_poll_s``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request

T = TypeVar("T")


# srt/environ.py SGLANG_REQUEST_STATE_WAIT_TIMEOUT = EnvInt(4) (0.4.10: a literal timeout=4 in
# tokenizer_manager.py `_wait_one_response`): how often SGLang looks for a client that went away.
DISCONNECT_POLL_S = 4.0


async def results_or_abort(
    request: Request, results: Awaitable[T], abort: Callable[[], Any], *, poll_s: float = DISCONNECT_POLL_S
) -> T:
    """Await `results`, noticing a client that went away only as SGLang does: on a poll every `poll_s`.

    tokenizer_manager.py `_stream_one_response` (0.5.23): the wait for the output times out every
    SGLANG_REQUEST_STATE_WAIT_TIMEOUT seconds from the request's start; only then is
    `request.is_disconnected()` asked, and a gone client's request aborted (abort()). Until that
    tick the request keeps running and its rid stays held. After abort() the (aborted) results are
    still awaited, so the rids are freed when the requests really end. poll_s <= 0 notices at once.
    The request body must have been read: the next ASGI message is then the disconnect.
    """
    results = asyncio.ensure_future(results)
    watcher = asyncio.ensure_future(request.receive())
    try:
        if poll_s <= 0:
            done, _ = await asyncio.wait((results, watcher), return_when=asyncio.FIRST_COMPLETED)
            if results not in done:
                abort()
            return await results
        while True:
            done, _ = await asyncio.wait((results,), timeout=poll_s)
            if done:
                return results.result()
            if watcher.done():  # is_disconnected() at this tick
                abort()
                return await results
    except asyncio.CancelledError:  # the server is going away: don't leave the work running
        abort()
        raise
    finally:
        watcher.cancel()
