"""`within`: a time limit on a wait that never swallows a cancellation (asyncio.wait_for
before Python 3.12 returns the result of a wait that completed in the turn it was
cancelled in, and the cancelled task runs on: a generation that would not stop)."""
from __future__ import annotations

import asyncio
import sys
import types

import pytest

from specsplit.common import aio


@pytest.fixture(params=["3.11+", "3.10"])
def branch(request, monkeypatch):  # type: ignore[no-untyped-def]
    if request.param == "3.11+" and sys.version_info < (3, 11):
        pytest.skip("asyncio.timeout is Python 3.11's")
    if request.param == "3.10":  # the fallback for interpreters without asyncio.timeout
        monkeypatch.setattr(aio, "sys", types.SimpleNamespace(version_info=(3, 10)))
    return request.param


def test_a_cancellation_as_the_wait_completes_is_kept(branch) -> None:
    async def main() -> None:
        done = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(aio.within(done, 5.0))
        await asyncio.sleep(0)  # the task waits
        done.set_result("a message")
        task.cancel()  # in the same turn: the wait has completed, and the task is cancelled
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())


def test_the_time_limit_and_the_result(branch) -> None:
    async def main() -> None:
        with pytest.raises(asyncio.TimeoutError):
            await aio.within(asyncio.sleep(10), 0.05)
        assert await aio.within(asyncio.sleep(0, "result"), 5.0) == "result"
        assert await aio.within(asyncio.sleep(0, "result"), None) == "result"

    asyncio.run(main())


def test_a_cancellation_during_the_cleanup_after_a_timeout_is_kept(branch) -> None:
    """Cancelled while the timed-out wait is being stopped (a cleanup that takes a while):
    the cancellation, not a TimeoutError."""
    async def main() -> None:
        stopping, release = asyncio.Event(), asyncio.Event()

        async def slow_to_stop() -> None:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:
                stopping.set()
                await release.wait()
                raise

        task = asyncio.create_task(aio.within(slow_to_stop(), 0.05))
        await stopping.wait()  # timed out: the inner wait is stopping
        task.cancel()
        release.set()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
