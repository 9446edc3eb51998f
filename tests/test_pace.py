"""A device's pace for SLO-aware batching: kept across the generations of its stream."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsplit.server.pace import PACE_WINDOW_S, RESUME_WITHIN_S, PaceLog


def test_a_pace_is_known_once_its_window_has_passed() -> None:
    log = PaceLog(10.0)
    log.commit(10.5, 10)
    assert log.rate(11.0) is None  # younger than the window: nothing to judge by
    log.commit(12.0, 30)
    assert log.rate(12.0) == pytest.approx(40 / 2.0)
    # Later the window slides: what was committed before it no longer counts.
    log.commit(13.0, 20)
    assert log.rate(14.0) == pytest.approx(20 / (14.0 - 12.0))


def test_a_generation_opened_just_after_the_last_continues_its_devices_pace() -> None:
    """A device whose generations follow one another has a pace from its next generation's
    first pass on: one ahead of the others can be held back then too (per generation, it could
    not for the first PACE_WINDOW_S of each, and such devices ran further ahead)."""
    first = PaceLog(0.0)
    for t in range(1, 31):  # 30 tokens/s for a second and a half, then Done
        first.commit(t / 20, 1)
    second = PaceLog.for_next(first, 1.5 + RESUME_WITHIN_S / 2)
    assert second is first
    # At 2.1 s the window reaches back to the commit at 0.1 s: 28 tokens since.
    assert second.rate(2.1) == pytest.approx(28 / 2.0)


def test_after_a_pause_a_devices_pace_starts_anew() -> None:
    first = PaceLog(0.0)
    first.commit(1.0, 20)
    second = PaceLog.for_next(first, 1.0 + RESUME_WITHIN_S + 0.5)
    assert second is not first
    assert second.rate(1.0 + RESUME_WITHIN_S + 1.0) is None  # a person reading is not a slow server
    assert PaceLog.for_next(None, 5.0).rate(5.0) is None


@given(st.lists(st.tuples(st.floats(0.001, 1.0), st.integers(0, 16)), min_size=1, max_size=60))
def test_the_rate_is_what_was_committed_over_the_window(steps) -> None:
    log, now, commits = PaceLog(0.0), 0.0, []
    for gap, tokens in steps:
        now += gap
        log.commit(now, tokens)
        commits.append((now, tokens))
    rate = log.rate(now)
    if now < PACE_WINDOW_S:
        assert rate is None
        return
    # The log reaches back to the last commit at or before the window's start (or its opening).
    start = max([t for t, _ in commits if t <= now - PACE_WINDOW_S], default=0.0)
    expected = sum(n for t, n in commits if t > start) / (now - start)
    assert rate == pytest.approx(expected)


def test_a_long_lived_log_keeps_only_its_window() -> None:
    log = PaceLog(0.0)
    for i in range(1, 100_001):  # 20 commits a second for well over an hour, never asked its rate
        log.commit(i / 20, 1)
    assert len(log._points) <= PACE_WINDOW_S * 20 + 2
    assert log.rate(100_000 / 20) == pytest.approx(20.0)
