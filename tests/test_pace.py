"""A device's pace for SLO-aware batching: kept across the generations of its stream."""
from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest
from hypothesis import given
from hypothesis import strategies as st

from conftest import free_port
from specsplit.edge.client import EdgeConfig, generate
from specsplit.edge.stream import GenerateStream
from specsplit.edge.tokenizer import EdgeTokenizer
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


def test_a_streams_generations_share_one_pace_and_another_call_starts_its_own(tiny, monkeypatch) -> None:
    """Through a real server: the second generation on a kept stream, opened at once, runs on
    the first one's pace log; a generation on a call of its own gets a new one."""
    from specsplit.server.engine import TargetEngine
    from specsplit.server.loading import load_model
    from specsplit.server.config import SchedulerConfig, ServeConfig
    from specsplit.server.scheduler import VerificationWorker
    from specsplit.server.service import serve

    handles = []
    add = VerificationWorker.add

    def recording(self, handle) -> None:  # type: ignore[no-untyped-def]
        handles.append(handle)
        add(self, handle)

    monkeypatch.setattr(VerificationWorker, "add", recording)
    engine = TargetEngine(load_model(str(tiny.target_dir)))
    tok = EdgeTokenizer(tiny.draft_dir)
    ids, cfg, port = tok.encode("def add(a, b):"), EdgeConfig(mode="none", max_new_tokens=4), free_port()

    async def main() -> None:
        ready = asyncio.Event()
        server = asyncio.create_task(serve(engine, SchedulerConfig(pace_tokens_per_s=20.0),
                                           ServeConfig(port=port, grace_s=0.1), ready))
        await ready.wait()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            kept = GenerateStream.on(channel)
            for via in (kept, kept, channel):
                await generate(via, ids, cfg, fingerprint=tok.fingerprint)
            kept.close()
        server.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await server

    asyncio.run(main())
    first, second, own_call = handles
    assert second.pace is first.pace and own_call.pace is not first.pace
