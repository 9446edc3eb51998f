"""Streams whose edge has stopped reading: a write that waits longer than a limit
(--stalled-edge-timeout) ends its stream. The worker ends a session whose outbox fills, but
one whose last messages fill no outbox (its Done queued behind a write the edge never takes
in, the session gone from the worker) was held open, its stream's tasks and buffers with it,
for as long as the edge kept its connection: keepalive does not tell, since the edge's
transport still answers pings."""
from __future__ import annotations

import asyncio
import time

CHECK_EVERY_S = 1.0  # how often writes are looked at (at most: a shorter limit is looked at within it)


class WriteWatch:
    def __init__(self, limit_s: float) -> None:
        self.limit_s = limit_s
        self._since: dict[asyncio.Task, float] = {}  # type: ignore[type-arg]  # a stream's task -> its write's start
        self._ended: set[asyncio.Task] = set()  # type: ignore[type-arg]

    def begin(self, task: asyncio.Task) -> None:  # type: ignore[type-arg]
        self._since[task] = time.monotonic()

    def done(self, task: asyncio.Task) -> None:  # type: ignore[type-arg]
        self._since.pop(task, None)

    def forget(self, task: asyncio.Task) -> bool:  # type: ignore[type-arg]
        """Stop watching the stream's task (its stream ends); whether the watch ended it."""
        self._since.pop(task, None)
        if task in self._ended:
            self._ended.discard(task)
            return True
        return False

    def end_stalled(self, now: float) -> None:
        """Cancel every stream whose write has waited longer than the limit."""
        stalled = [task for task, since in self._since.items() if now - since > self.limit_s]
        for task in stalled:
            del self._since[task]
            self._ended.add(task)
            task.cancel()

    async def run(self) -> None:
        while True:
            await asyncio.sleep(min(CHECK_EVERY_S, self.limit_s))
            self.end_stalled(time.monotonic())
