"""The longest common prefix of two token sequences, as both sides of the protocol need it."""
from __future__ import annotations

from collections.abc import Sequence


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix. The server's scheduler asks for every session in
    every pass and the edge's drafter for each of its caches in every step, over whole
    contexts: slices compare in C, where a Python loop over a few hundred tokens cost more
    per session than the rest of its share of the pass."""
    n = min(len(a), len(b))
    a, b = a[:n], b[:n]
    if type(a) is not type(b):  # a tuple never equals a list
        a, b = list(a), list(b)
    if a == b:
        return n
    if a[: n - 1] == b[: n - 1]:  # the usual miss: a verdict's correction where a draft was cached
        return n - 1
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo
