"""How late the server's event loop runs: a timer that should fire every `every_s`,
measured against when it does. The gRPC streams, the worker's picking and delivering, and
the calls being accepted all share that loop; its lag is what each of them waits."""
from __future__ import annotations

import asyncio

from prometheus_client import Histogram

TICK_S = 0.05


async def watch_loop_lag(histogram: Histogram, every_s: float = TICK_S) -> None:
    """Observe the loop's lateness into `histogram` until cancelled."""
    loop = asyncio.get_running_loop()
    while True:
        due = loop.time() + every_s
        await asyncio.sleep(every_s)
        histogram.observe(max(0.0, loop.time() - due))
