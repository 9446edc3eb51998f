"""Streams kept open between a device's generations, and how many of them the server holds.

An idle stream holds no KV cache, but it does hold two tasks and an HTTP/2 stream, and
nothing but its timeout would otherwise bound how many devices keep one. Past the limit the
stream idle longest is ended, as the timeout would end it: its device starts a new call for
its next generation (edge/stream.py), so the limit costs it a call, never a generation.
"""
from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import NamedTuple


class Evicted(NamedTuple):
    """Put in an idle stream's outbox: end the stream, if it has opened no session since it
    went idle (its connection's count of Opens is still `opens`)."""

    opens: int


class IdleStreams:
    """The streams between sessions, longest idle first."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"the idle stream limit must be 0 or more, got {limit}")
        self.limit = limit
        self._outboxes: OrderedDict[str, tuple[asyncio.Queue, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._outboxes)

    def add(self, stream_id: str, outbox: asyncio.Queue, opens: int) -> None:
        """`stream_id` has just gone idle, after its `opens`-th session: tell the longest idle
        streams past the limit to end (this one too, when the limit is 0)."""
        self._outboxes[stream_id] = (outbox, opens)
        self._outboxes.move_to_end(stream_id)  # idle again without having left: idle since now
        while len(self._outboxes) > self.limit:
            _, (oldest, at) = self._outboxes.popitem(last=False)
            try:
                oldest.put_nowait(Evicted(at))
            except asyncio.QueueFull:  # messages waiting for it: a session has opened on it after all
                pass

    def discard(self, stream_id: str) -> None:
        self._outboxes.pop(stream_id, None)
