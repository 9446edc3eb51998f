"""The server's event-loop lag metric."""
from __future__ import annotations

import asyncio
import time

from prometheus_client import CollectorRegistry

from specsplit.server.loop_lag import watch_loop_lag
from specsplit.server.metrics import ServerMetrics


def _sample(metrics: ServerMetrics, name: str) -> float:
    return metrics.registry.get_sample_value(f"specsplit_event_loop_lag_seconds_{name}") or 0.0


def test_a_blocked_loop_shows_as_lag() -> None:
    metrics = ServerMetrics(CollectorRegistry())

    async def main() -> None:
        watcher = asyncio.create_task(watch_loop_lag(metrics.loop_lag, every_s=0.01))
        await asyncio.sleep(0.05)  # free ticks
        time.sleep(0.2)  # a long stretch of work holding the loop, as a big pass's delivery would
        await asyncio.sleep(0.05)
        watcher.cancel()

    asyncio.run(main())
    assert _sample(metrics, "count") >= 3
    # The tick due during the stretch ran at its end: at least the rest of the 0.2 s late.
    assert _sample(metrics, "sum") >= 0.19 - 0.01
