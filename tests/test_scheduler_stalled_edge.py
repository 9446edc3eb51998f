"""An edge that stops reading its verdicts is cut off after a bounded time."""
from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence

import numpy as np

from specsplit.protocol.messages import DraftMode, OpenRequest, ServerLimits
from specsplit.protocol.server_session import ServerSession
from specsplit.server.engine import KVState
from specsplit.server.config import SchedulerConfig
from specsplit.server.scheduler import SessionHandle, VerificationWorker


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


class HeldEngine:
    """A target pass that predicts token 7 everywhere, once the test lets it end."""

    verifies_branches = False
    split_width = 0
    vocab_size = 100
    forward_passes = 0  # (never timed: the test ends the session at its one pass)

    def __init__(self) -> None:
        self.started, self.go = threading.Event(), threading.Event()

    def new_state(self, prompt: Sequence[int] = ()) -> KVState:
        return KVState()

    def padded_shape(self, sessions: int, longest: int) -> tuple[int, int]:
        return sessions, longest

    def forward_shapes(self, items) -> list[tuple[int, int]]:  # type: ignore[no-untyped-def]
        return [(len(items), max(it.feed_length for it in items))]

    def verify_batch(self, items):  # type: ignore[no-untyped-def]
        self.started.set()
        self.go.wait(10)
        return [np.full(len(it.drafts) + 1, 7) for it in items]


def test_an_outbox_that_fills_during_a_pass_ends_its_session_not_the_server() -> None:
    """Picked with room for the pass's Verdict and Done, the outbox of an edge that stopped
    reading filled while the pass ran: the Done's put raised QueueFull out of the worker, and
    the server shut down for every session."""
    async def main() -> None:
        engine = HeldEngine()
        worker = VerificationWorker(engine, SchedulerConfig(outbox_size=4))  # type: ignore[arg-type]
        session = ServerSession(OpenRequest((1, 2), max_new_tokens=1, draft_mode=DraftMode.NONE),
                                ServerLimits(vocab_size=100, max_context=100), "s")
        outbox: asyncio.Queue = asyncio.Queue(maxsize=4)
        outbox.put_nowait("unread")
        stream = asyncio.create_task(asyncio.sleep(60))
        handle = SessionHandle(session, outbox, kv=KVState(), stream_task=stream)
        worker.add(handle)
        running = asyncio.create_task(worker.run())
        await asyncio.get_running_loop().run_in_executor(None, engine.started.wait, 10)  # the pass runs
        outbox.put_nowait("more")  # the stream's reader queues while the edge reads nothing
        outbox.put_nowait("and more")
        engine.go.set()
        for _ in range(200):  # until the pass's verdicts are delivered (at most 10 s: a hang guard)
            if (handle.stalled and stream.done()) or running.done():
                break
            await asyncio.sleep(0.05)
        assert not running.done(), running.exception()  # the worker serves on
        # The servicer, whose task is cancelled, finds the handle stalled: it counts and logs
        # the end so, and removes it.
        assert handle.stalled and stream.cancelled() and worker.sessions["s"] is handle
        running.cancel()
        await asyncio.gather(running, return_exceptions=True)
        worker.close()

    asyncio.run(main())
