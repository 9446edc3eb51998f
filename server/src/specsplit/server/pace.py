"""A device's recent speed, for SLO-aware batching (scheduler `_pace`).

The SLO is a device's: the tokens it gets a second, generation after generation. A pace kept
per generation knew nothing of a generation's first PACE_WINDOW_S, and a session it knew
nothing of was never held back. On a GPU, server-only devices whose generations came round
quicker spent more of their time so exempt, ran ahead, came round quicker still, and ended a
quarter faster than the rest (a spread that went away with pacing off: docs/capacity.md). So a
device's stream keeps one log across its generations, unless it paused between them.
"""
from __future__ import annotations

from collections import deque

PACE_WINDOW_S = 2.0  # a device's pace is what it committed over this long
# A generation that opens this soon after its stream's last commit continues the stream's log
# (the wait for it counts); after a longer pause (a person reading, say) the log starts anew:
# the pause is no slowness of the server's, and must not make the device look behind.
RESUME_WITHIN_S = 1.0


class PaceLog:
    """Tokens committed to one device over time."""

    def __init__(self, now: float) -> None:
        # (time, tokens committed so far); the last point holds the total, never trimmed
        self._points: deque[tuple[float, int]] = deque([(now, 0)])

    def commit(self, now: float, tokens: int) -> None:
        self._points.append((now, self._points[-1][1] + tokens))
        self._trim(now)  # a device served alone is never asked its rate, and may stream for hours

    def _trim(self, now: float) -> None:
        """Forget what lies wholly before the window: the last point at or before its start stays."""
        while len(self._points) > 1 and self._points[1][0] <= now - PACE_WINDOW_S:
            self._points.popleft()

    def rate(self, now: float) -> float | None:
        """Tokens/s committed over the last PACE_WINDOW_S; None while the log is younger than that."""
        self._trim(now)
        since, committed = self._points[0]
        if since > now - PACE_WINDOW_S:
            return None
        return (self._points[-1][1] - committed) / (now - since)

    @classmethod
    def for_next(cls, last: PaceLog | None, now: float) -> PaceLog:
        """The log of a stream's generation opening now, `last` being its previous one's: that
        one again if its last commit was at most RESUME_WITHIN_S ago."""
        return last if last is not None and now - last._points[-1][0] <= RESUME_WITHIN_S else cls(now)
