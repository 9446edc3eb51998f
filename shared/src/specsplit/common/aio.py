"""Waiting with a time limit that never swallows a cancellation."""
from __future__ import annotations

import asyncio
import sys
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def within(awaitable: Awaitable[T], timeout: float | None) -> T:
    """`await awaitable`, raising TimeoutError after `timeout` seconds (None: no limit).

    Not asyncio.wait_for: before Python 3.12 it returns the result and drops a cancellation
    that arrives in the loop turn the awaited thing completes in, so a task cancelled while
    messages flow (a stream's reads) runs on as if never cancelled."""
    if timeout is None:
        return await awaitable
    if sys.version_info >= (3, 11):
        async with asyncio.timeout(timeout):
            return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=timeout)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if not done:
        task.cancel()
        await asyncio.wait({task})  # raises only for a cancellation of the caller's own
        raise asyncio.TimeoutError
    return task.result()


def being_cancelled() -> bool:
    """Whether the running task has been asked to cancel: a CancelledError it sees is then its
    own, not one that something it awaited ended with (before Python 3.11 this cannot be
    told, and the answer is False)."""
    cancelling = getattr(asyncio.current_task(), "cancelling", None)
    return bool(cancelling()) if cancelling is not None else False
