"""The server's register of streams idle between sessions: who is told to end, and when."""
from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsplit.server.idle_streams import Evicted, IdleStreams, TrimTimer


def _told(outbox: asyncio.Queue, opens: int = 1) -> bool:
    return not outbox.empty() and outbox.get_nowait() == Evicted(opens)


def test_the_longest_idle_is_told_first_and_a_stream_that_left_is_not() -> None:
    idle = IdleStreams(2, grace_s=0.0)
    a, b, c, d = (asyncio.Queue(maxsize=4) for _ in range(4))
    idle.add("a", a, 1, 0.0)
    idle.add("b", b, 1, 1.0)
    idle.discard("a")  # a session opened on it
    idle.add("c", c, 1, 2.0)
    assert not any(_told(q) for q in (a, b, c)) and len(idle) == 2
    idle.add("d", d, 1, 3.0)
    assert _told(b) and not any(_told(q) for q in (a, c, d)) and len(idle) == 2


def test_a_stream_is_told_only_once_it_has_idled_for_the_grace() -> None:
    """Just after its Done an edge may still be writing drafts: ended then, its call would fail."""
    idle = IdleStreams(1, grace_s=5.0)
    a, b, c = (asyncio.Queue(maxsize=4) for _ in range(3))
    assert idle.add("a", a, 1, 0.0) is None
    # a has idled 4 s: over the limit for now, and a trim is due once its grace runs out
    assert idle.add("b", b, 1, 4.0) == pytest.approx(1.0)
    assert not _told(a) and len(idle) == 2
    assert idle.add("c", c, 1, 5.5) == pytest.approx(3.5)  # a has idled 5.5 s, b 1.5 s
    assert _told(a) and not _told(b) and len(idle) == 2


def test_a_trim_once_the_grace_has_run_out_ends_what_no_later_stream_going_idle_would() -> None:
    """Two devices going idle together past the limit: without a trim at the grace's end
    the one too many would stay until its timeout."""
    idle = IdleStreams(1, grace_s=5.0)
    a, b = (asyncio.Queue(maxsize=4) for _ in range(2))
    idle.add("a", a, 1, 0.0)
    assert idle.add("b", b, 1, 0.5) == pytest.approx(4.5)
    assert idle.trim(4.9) == pytest.approx(0.1) and not _told(a)  # early: it says when again
    assert idle.trim(5.0) is None and _told(a) and not _told(b) and len(idle) == 1


def test_the_timer_trims_again_until_the_limit_holds() -> None:
    """With room for one, a stream goes idle and two more 0.1 s later: the timer's first
    trim (the first stream's grace run out) ends only the first, and sets itself again for
    the second, whose grace runs out later."""

    async def main() -> list[bool]:
        idle = IdleStreams(1, grace_s=0.2)
        timer = TrimTimer(idle)
        outboxes = [asyncio.Queue(maxsize=4) for _ in range(3)]
        timer.after(idle.add("0", outboxes[0], 1, time.monotonic()))
        await asyncio.sleep(0.1)
        for n in (1, 2):
            timer.after(idle.add(str(n), outboxes[n], 1, time.monotonic()))
        await asyncio.sleep(0.8)  # well past the last one's grace
        told = [_told(q) for q in outboxes]
        timer.cancel()
        return [*told, len(idle) == 1]

    assert asyncio.run(main()) == [True, True, False, True]


def test_the_end_names_the_sessions_the_stream_had_opened_when_it_went_idle() -> None:
    """So that a stream that has opened another session since ignores it (service.py)."""
    idle = IdleStreams(0, grace_s=0.0)
    outbox = asyncio.Queue(maxsize=4)
    idle.add("a", outbox, 3, 0.0)
    assert outbox.get_nowait() == Evicted(3)


def test_a_stream_with_messages_waiting_is_left_alone() -> None:
    """Its outbox full means a session opened on it after all: nothing to end."""
    idle = IdleStreams(0, grace_s=0.0)
    busy = asyncio.Queue(maxsize=1)
    busy.put_nowait("Opened")
    idle.add("busy", busy, 1, 0.0)
    assert busy.get_nowait() == "Opened" and busy.empty() and len(idle) == 0


def test_a_negative_limit_is_refused() -> None:
    with pytest.raises(ValueError, match="0 or more"):
        IdleStreams(-1, grace_s=0.0)


@given(st.integers(0, 4), st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=40))
def test_never_more_than_the_limit_and_only_the_longest_idle_told(limit: int, steps: list) -> None:
    idle = IdleStreams(limit, grace_s=0.0)
    outboxes = {n: asyncio.Queue(maxsize=8) for n in range(8)}
    order: list[int] = []  # the model: idle streams, longest idle first
    for t, (going_idle, n) in enumerate(steps):
        if n in order:
            order.remove(n)
        if going_idle:
            order.append(n)
            idle.add(str(n), outboxes[n], 1, float(t))
            told = order[: max(0, len(order) - limit)]
            del order[: len(told)]
        else:
            idle.discard(str(n))
            told = []
        assert [m for m in range(8) if _told(outboxes[m])] == sorted(told)
        assert len(idle) == len(order) <= limit
