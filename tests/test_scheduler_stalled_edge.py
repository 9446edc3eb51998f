"""An edge that stops reading its verdicts is cut off after a bounded time."""
from __future__ import annotations

import asyncio

from specsplit.protocol.messages import OpenRequest, ServerLimits
from specsplit.protocol.server_session import ServerSession
from specsplit.server.scheduler import SchedulerConfig, SessionHandle, VerificationWorker


def test_a_session_whose_outbox_stays_full_is_ended() -> None:
    async def main() -> None:
        worker = VerificationWorker(engine=None, config=SchedulerConfig(stalled_edge_s=0.2))  # type: ignore[arg-type]
        session = ServerSession(OpenRequest(prompt_ids=(1, 2), max_new_tokens=5), ServerLimits(10, 64), "s")
        outbox: asyncio.Queue = asyncio.Queue(maxsize=4)
        for i in range(4):
            outbox.put_nowait(i)  # nobody reads: the outbox is full
        stream = asyncio.create_task(asyncio.sleep(60))
        handle = SessionHandle(session, outbox, stream_task=stream)
        worker.add(handle)
        batch, _ = worker._pick()
        assert batch == [] and not stream.cancelled()  # paused, not yet cut off
        await asyncio.sleep(0.3)
        worker._pick()
        await asyncio.sleep(0)
        assert stream.cancelled() and handle.stalled  # its servicer counts the end as stalled

    asyncio.run(main())
