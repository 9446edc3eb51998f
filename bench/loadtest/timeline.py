"""Per-message latencies and acceptance counts of one generation, from the client's
commit times and its timeline (EdgeConfig(timeline=True)).

Timeline events (edge client): ("send", t, chunk_start, n_tokens) and
("verdict", t, start, n_tokens, accepted, verify_ms, proposed, rejected); t in seconds since the
generation started, the same clock as the commit times.
"""
from __future__ import annotations

import bisect
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsplit.common.acceptance import observed_acceptance


ALWAYS = (-math.inf, math.inf)


def in_window(t: float, window: tuple[float, float]) -> bool:
    """Whether `t` lies in `window` (its ends included)."""
    return window[0] <= t <= window[1]


def itl_ms(commit_times: Sequence[float], window: tuple[float, float] = ALWAYS) -> list[float]:
    """Gaps between consecutive committed tokens, as the client's stats count them:
    tokens of one verdict share its time, so a verdict of k tokens adds k - 1 zero gaps.
    Only gaps that end within `window` (times as commit_times count them), as each sample
    below is taken when it ends."""
    return [(b - a) * 1000 for a, b in zip(commit_times, commit_times[1:]) if in_window(b, window)]


def _verdicts(timeline: Sequence[tuple]) -> list[tuple]:
    return [e for e in timeline if e[0] == "verdict"]


def verdict_latency_ms(timeline: Sequence[tuple], window: tuple[float, float] = ALWAYS) -> list[float]:
    """For each draft chunk sent: the time until the verdict that commits the chunk's
    first position (accepting or correcting it). Chunks whose first position the
    generation never reached (it ended first) have none, and so do chunks a rejection cut
    off before they were verified: a verdict between the send and that one rejected a draft
    before the chunk's first position, the server dropped the chunk, and the position was
    committed by a later chunk's verdict (counted for that chunk)."""
    verdicts = [v for v in _verdicts(timeline) if v[3] > 0]
    ends = [v[2] + v[3] for v in verdicts]  # increasing: each verdict commits the positions after the last
    times = [v[1] for v in verdicts]
    cuts = [0, *itertools.accumulate(v[7] > 0 for v in verdicts)]  # verdicts that rejected, before each
    out = []
    for event in timeline:
        if event[0] != "send":
            continue
        _, sent, position, _ = event
        i = bisect.bisect_right(ends, position)
        if i < len(verdicts) and verdicts[i][2] <= position and verdicts[i][1] >= sent and in_window(verdicts[i][1], window):
            if cuts[i] == cuts[min(i, bisect.bisect_right(times, sent))]:  # no rejection reached the edge since
                out.append((verdicts[i][1] - sent) * 1000)
    return out


def verdict_interval_ms(timeline: Sequence[tuple], window: tuple[float, float] = ALWAYS) -> list[float]:
    """Time between consecutive verdicts of the generation."""
    times = [v[1] for v in _verdicts(timeline)]
    return [(b - a) * 1000 for a, b in zip(times, times[1:]) if in_window(b, window)]


@dataclass(frozen=True)
class Acceptance:
    accepted: int = 0  # drafts the target accepted
    proposed: int = 0  # drafts it verified (after a rejection, the rest of the task counts too)
    rejections: int = 0  # drafts rejected (Verdict.rejected)

    def __add__(self, other: Acceptance) -> Acceptance:
        return Acceptance(self.accepted + other.accepted, self.proposed + other.proposed,
                          self.rejections + other.rejections)

    @property
    def per_token(self) -> float | None:
        """Chance that a draft is accepted given that the drafts before it were: the
        per-position alpha a drafter is built with (accepted / proposed is lower, since it
        also counts the drafts after a rejection, which are never really in question)."""
        return observed_acceptance(self.accepted, self.rejections)


def acceptance(timeline: Sequence[tuple], window: tuple[float, float] = ALWAYS) -> Acceptance:
    total = Acceptance()
    for v in _verdicts(timeline):
        if not in_window(v[1], window):
            continue
        total += Acceptance(v[4], v[6], v[7])
    return total


def percentiles(values: Sequence[float], qs: Sequence[float] = (50, 90, 99, 99.9)) -> dict[str, float] | None:
    if not len(values):
        return None
    got = np.percentile(np.asarray(values, dtype=np.float64), qs)
    return {f"p{q:g}": float(v) for q, v in zip(qs, got)} | {"count": len(values)}
