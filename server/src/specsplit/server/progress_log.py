"""Progress of long start-up work (capturing a thousand CUDA graphs can take minutes) as a
log line every few seconds: a server's output is a log, where a redrawn bar would not do."""
from __future__ import annotations

import logging
import time
from collections.abc import Callable


class ProgressLog:
    """Called with (done, total) after each step; logs "`what` done of total (s)" at most every
    `every_s` seconds, and always at the last step, so a stalled start is told from a slow one."""

    def __init__(self, log: logging.Logger, what: str, every_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.log, self.what, self.every_s, self.clock = log, what, every_s, clock
        self.started = self.last = clock()

    def __call__(self, done: int, total: int) -> None:
        now = self.clock()
        if done < total and now - self.last < self.every_s:
            return
        self.last = now
        self.log.info("%s: %d of %d (%.0f%%) in %.1f s", self.what, done, total, 100 * done / max(total, 1),
                      now - self.started)
