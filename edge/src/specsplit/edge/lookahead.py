"""How far ahead an asynchronous edge should draft, from the acceptance it sees.

The server verifies whatever drafts it holds when the target is free, so the edge's
lookahead bounds what one verification can commit. Too short, and a prompt the draft
predicts well is verified a few tokens at a time (the full benchmark: a prompt at 94%
acceptance got 1.45x from a window of 8 where sync at k=8 got 1.80x). Too long, and a
prompt it predicts poorly wastes drafting on tokens past the first rejection, which on a
shared box also slows the target. The expected run of accepted drafts is a / (1 - a); the
window covers two of them (the verification running and the one after it) plus the
token each verification adds.
"""
from __future__ import annotations

import math

from specsplit.common.acceptance import acceptance_estimate

MIN_WINDOW = 4


def adaptive_window(accepted: int, rejections: int, max_window: int) -> int:
    """The lookahead for an edge whose verdicts so far accepted `accepted` drafts and
    rejected at `rejections` positions, between MIN_WINDOW (or max_window, if smaller)
    and max_window."""
    alpha = acceptance_estimate(accepted, rejections)
    run = alpha / (1.0 - alpha) if alpha < 1.0 else float(max_window)
    return max(min(MIN_WINDOW, max_window), min(max_window, math.ceil(2 * (run + 1) - 1e-9)))
