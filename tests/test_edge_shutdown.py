"""A generation that ends while its drafter is mid-step returns only once the step is done,
so a retry (or the next generation) never runs the same drafter from two threads."""
from __future__ import annotations

import asyncio
import threading
import time

import grpc
import numpy as np

from specsplit.edge.attempt import Attempt
from specsplit.edge.client import EdgeConfig
from specsplit.edge.stream import GenerateStream
from specsplit.protocol import codec
from specsplit.protocol.messages import Opened

VOCAB = 64


class SlowDrafter:
    def __init__(self) -> None:
        self.entered = threading.Event()
        self.steps_done = 0

    def next_logits(self, trajectory):  # type: ignore[no-untyped-def]
        self.entered.set()
        time.sleep(0.3)
        self.steps_done += 1
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[len(trajectory) % VOCAB] = 1.0
        return logits


class StreamThatEnds:
    """Opened, then the end of the stream once the drafter is inside a step."""

    def __init__(self, drafter: SlowDrafter) -> None:
        self.drafter = drafter
        self.sent_opened = False

    def Generate(self, requests, metadata=None):  # type: ignore[no-untyped-def]  # noqa: N802 (gRPC's name)
        return self

    def done(self) -> bool:
        return False

    def cancel(self) -> None:
        pass

    async def read(self):  # type: ignore[no-untyped-def]
        if not self.sent_opened:
            self.sent_opened = True
            return codec.server_to_pb(Opened("s", "t", 4096, 32, VOCAB))
        await asyncio.get_running_loop().run_in_executor(None, self.drafter.entered.wait)
        return grpc.aio.EOF


def test_a_generation_ending_mid_step_waits_for_the_drafter() -> None:
    drafter = SlowDrafter()
    gen = Attempt(drafter, [1, 2, 3], EdgeConfig(mode="async", max_new_tokens=8), "", "", [], None)

    async def main() -> None:
        try:
            await gen.run(GenerateStream(StreamThatEnds(drafter)))
        except ConnectionError:
            pass
        else:
            raise AssertionError("the stream ended before Done: the generation must fail")

    asyncio.run(main())
    assert drafter.entered.is_set() and drafter.steps_done == 1  # the step finished before run() returned
