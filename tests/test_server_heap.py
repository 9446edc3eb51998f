"""The server's garbage-collector settings once its model is loaded (`settle_heap`)."""
from __future__ import annotations

import gc

from specsplit.server.cli import settle_heap


def test_serving_s_short_lived_objects_run_no_collection_once_the_heap_is_settled() -> None:
    threshold = gc.get_threshold()
    started: list[int] = []

    def count(phase: str, info: dict) -> None:
        if phase == "start":
            started.append(info["generation"])

    try:
        settle_heap()
        assert gc.get_freeze_count() > 0  # what was loaded before is out of the collector's way
        gc.callbacks.append(count)
        churn = [[i] for i in range(5000)]  # a pass's worth of live objects: past Python's default threshold
        del churn
        assert started == []
    finally:
        if count in gc.callbacks:
            gc.callbacks.remove(count)
        gc.unfreeze()
        gc.set_threshold(*threshold)
