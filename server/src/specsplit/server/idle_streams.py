"""Streams kept open between a device's generations, and how many of them the server holds.

An idle stream holds no KV cache, but it does hold two tasks and an HTTP/2 stream, and
nothing but its timeout would otherwise bound how many devices keep one. Past the limit the
stream idle longest is ended, as the timeout would end it: its device starts a new call for
its next generation (edge/stream.py), so the limit costs it a call, never a generation.

Only a stream idle for at least `grace_s` is ended: just after its Done the edge may still be
writing drafts, and a call that ends under its writes fails at the edge with INTERNAL before
the Done is read (ended at once, 76 of 240 generations of eight busy edges did). So the limit
may be passed for as long as that (the server trims again once the grace has run out): it
bounds the streams that idle on, not a burst.
"""
from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import NamedTuple


GRACE_S = 5.0  # how long a stream idles before the limit may end it (above)


class Evicted(NamedTuple):
    """Put in an idle stream's outbox: end the stream, if it has opened no session since it
    went idle (its connection's count of Opens is still `opens`)."""

    opens: int


class IdleStreams:
    """The streams between sessions, longest idle first."""

    def __init__(self, limit: int, grace_s: float) -> None:
        if limit < 0:
            raise ValueError(f"the idle stream limit must be 0 or more, got {limit}")
        self.limit = limit
        self.grace_s = grace_s
        # stream id -> (its outbox, its Opens so far, when it went idle)
        self._streams: OrderedDict[str, tuple[asyncio.Queue, int, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._streams)

    def add(self, stream_id: str, outbox: asyncio.Queue, opens: int, now: float) -> float | None:
        """`stream_id` has just gone idle, after its `opens`-th session. Trims (below)."""
        self._streams[stream_id] = (outbox, opens, now)
        self._streams.move_to_end(stream_id)  # idle again without having left: idle since now
        return self.trim(now)

    def trim(self, now: float) -> float | None:
        """Tell the longest idle streams past the limit to end, those idle for grace_s at
        least. Returns in how many seconds to trim again, where the limit is still passed by
        streams within the grace: else they would stay until some other stream goes idle."""
        while len(self._streams) > self.limit:
            oldest_id, (oldest, at, since) = next(iter(self._streams.items()))
            if now - since < self.grace_s:
                return since + self.grace_s - now  # the rest went idle later
            del self._streams[oldest_id]
            try:
                oldest.put_nowait(Evicted(at))
            except asyncio.QueueFull:  # messages waiting for it: a session has opened on it after all
                pass
        return None

    def discard(self, stream_id: str) -> None:
        self._streams.pop(stream_id, None)


class TrimTimer:
    """Trims `idle` again when a trim says to (IdleStreams.trim), on the running event loop.
    One timer at a time: a stream going idle later can only need a later trim than the one
    pending, and a trim that comes early sets the next."""

    def __init__(self, idle: IdleStreams) -> None:
        self.idle = idle
        self._timer: asyncio.TimerHandle | None = None

    def after(self, delay: float | None) -> None:
        """Trim in `delay` s (None: no need), unless a trim is already due."""
        if delay is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(delay, self._trim)

    def _trim(self) -> None:
        self._timer = None
        self.after(self.idle.trim(time.monotonic()))

    def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
