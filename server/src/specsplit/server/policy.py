"""How many of a session's candidates one verification should take.

Verifying n drafts yields the accepted prefix plus one token: under a per-draft
acceptance probability a, (1 - a^(n+1)) / (1 - a) tokens on average. It costs one
target pass whose time grows with n, and on CPU not in proportion: a pass over 2
tokens costs about twice one over 1, a pass over 17 about three times. So the best n
depends on the session's acceptance and on the hardware; both are learned online and
the n with the most expected tokens per second is taken.
"""
from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np


def expected_tokens(n: int, alpha: float) -> float:
    """Mean tokens committed by verifying n drafts: the accepted prefix plus one."""
    if alpha >= 1.0:
        return n + 1.0
    return (1.0 - alpha ** (n + 1)) / (1.0 - alpha)


MIN_PASS_S = 1e-6  # the least a pass is taken to cost (PassCostModel.observe)


class PassCostModel:
    """Exponentially weighted pass time per number of drafts, interpolated between sizes seen."""

    def __init__(self, weight: float = 0.3) -> None:
        self.weight = weight
        self._sizes: list[int] = []
        self._cost: dict[int, float] = {}
        # cost() is asked for every size, for every session, every round; passes change it.
        self._memo: dict[int, float] = {}

    def observe(self, n: int, seconds: float) -> None:
        # A clock that ticks coarsely (15.6 ms on some systems) times a pass at 0, and every
        # plan divides by a cost: the worker would fail on the next pick, and the server with it.
        seconds = max(seconds, MIN_PASS_S)
        self._memo.clear()
        if n in self._cost:
            self._cost[n] += self.weight * (seconds - self._cost[n])
        else:
            bisect.insort(self._sizes, n)
            self._cost[n] = seconds

    def known(self) -> int:
        return len(self._sizes)

    def cost(self, n: int) -> float:
        if n not in self._memo:
            self._memo[n] = self._interpolate(n)
        return self._memo[n]

    def _interpolate(self, n: int) -> float:
        sizes = self._sizes
        i = bisect.bisect_left(sizes, n)
        if i < len(sizes) and sizes[i] == n:
            return self._cost[n]
        if i == len(sizes) or len(sizes) == 1:
            # Past the largest size timed (or with one size timed), assume no extra cost: optimism
            # makes the policy try larger passes, and one try replaces the guess with a measurement.
            return self._cost[sizes[min(i, len(sizes) - 1)]]
        # Interpolate between neighbours (below the smallest, extend the first segment).
        lo, hi = (i - 1, i) if i > 0 else (0, 1)
        a, b = sizes[lo], sizes[hi]
        ca, cb = self._cost[a], self._cost[b]
        return max(1e-6, ca + (cb - ca) * (n - a) / (b - a))


def choose_drafts(available: int, limit: int, alpha: float, costs: PassCostModel) -> int:
    """The number of drafts (0..min(available, limit)) with the most expected tokens per second.

    Until two pass sizes have been timed there is no cost curve: take all that is offered."""
    top = min(available, limit)
    if costs.known() < 2 or top == 0:
        return top
    return max(range(top + 1), key=lambda n: expected_tokens(n, alpha) / costs.cost(n))


WAIT_STEP_S = 0.05  # the waits plan() weighs: 0, this, twice this, ... up to max_wait_s


def plan(
    available: int,
    limit: int,
    alpha: float,
    costs: PassCostModel,
    draft_rate: float,
    max_wait_s: float,
) -> tuple[int, float]:
    """(drafts to verify, seconds to wait first) with the most expected tokens per second.

    Waiting is an option because an asynchronous edge keeps drafting: after a rejection
    the server holds few candidates, and a pass over them (or an autoregressive step)
    can yield less per second than waiting a moment for the drafts on their way."""
    top = min(available, limit)
    if costs.known() < 2:
        return top, 0.0
    best_rate, best = -1.0, (top, 0.0)
    for wait in _first_waits(available, limit, draft_rate, max_wait_s):
        n = choose_drafts(min(limit, available + int(draft_rate * wait)), limit, alpha, costs)
        rate = expected_tokens(n, alpha) / (wait + costs.cost(n))
        if rate > best_rate * 1.0001:
            best_rate, best = rate, (n, wait)
    return best


def _first_waits(available: int, limit: int, draft_rate: float, max_wait_s: float) -> list[float]:
    """Of the waits 0, WAIT_STEP_S, ... up to max_wait_s, the first after which each further
    draft has come: a longer wait for as many drafts only delays the pass, so these are the
    only ones worth weighing. At most a wait per draft up to the limit, however long
    max_wait_s: stepping through every wait would cost each pick time in proportion to it."""
    steps = int(max_wait_s / WAIT_STEP_S)
    waits, k = [0.0], 0
    if draft_rate <= 0.0:
        return waits
    for more in range(1, limit - available + 1):
        k = max(k, math.ceil(more / (draft_rate * WAIT_STEP_S)) - 1)
        while int(draft_rate * (k * WAIT_STEP_S)) < more:  # as plan() counts them (products round either way)
            k += 1
        if k > steps:
            break
        if k * WAIT_STEP_S != waits[-1]:
            waits.append(k * WAIT_STEP_S)
    return waits


def choose_width(rows: Sequence[tuple[int, int, float]], padded: Callable[[int], int | None], costs: PassCostModel,
                 split_width: int = 0, host_s: float = 0.0) -> int:
    """The feed width (tokens per session) a batched pass should be cut to.

    `rows` holds each session's (tokens it must feed whatever happens, drafts it offers, its
    acceptance); `padded(w)` is the padded token count the engine computes for the batch at
    width w (None: split that narrow, the pass would outgrow the engine's limits; if no
    width fits, the widest comes back and the caller feeds whole); `costs` times passes by
    padded tokens. Every
    session is padded to the longest feed, so one session's eight drafts make all the others
    pay for eight: when the batch is large, cutting every feed to a narrower width yields
    more tokens per second, and this picks the width that yields the most. With a
    `split_width` (the engine can split a feed over rows of up to that width), a feed longer
    than the width takes several rows, its drafts filling its last one; without, no width
    is narrower than what a session must feed. `host_s` is the host's time on the batch's
    sessions, which the pass overlaps: no width brings the next pass round sooner than that,
    so where the host is the bottleneck a narrower pass only commits less. Without a cost
    curve, nothing is cut."""
    padded = functools.cache(padded)  # asked for each width more than once below
    floors = np.array([f for f, _, _ in rows])
    drafts = np.array([n for _, n, _ in rows])
    alphas = np.minimum(np.array([a for _, _, a in rows]), 1.0 - 1e-9)
    longest = int((floors + drafts).max())
    if costs.known() < 2:
        return longest
    if split_width:
        # A row's width is paid in full, so each width is tried only where its padded size
        # ends (the engine pads narrower widths to it; its pieces are cut there), and only
        # where the pass fits the engine's limits.
        top = min(longest, split_width)
        widths = [w for w in range(1, top + 1) if padded(w) is not None and (w == top or padded(w + 1) != padded(w))]
        if not widths:
            return top
    else:
        # Only the widest width of each padded size is worth trying: the rest cost as much and carry less.
        widths = [w for w in range(int(floors.max()), longest + 1) if w == longest or padded(w + 1) > padded(w)]

    def rate(w: int) -> float:
        tokens = padded(w)
        assert tokens is not None
        room = -(-floors // w) * w - floors if split_width else w - floors
        taken = np.minimum(drafts, room)
        return float(((1.0 - alphas ** (taken + 1)) / (1.0 - alphas)).sum()) / max(costs.cost(tokens), host_s)

    return max(widths, key=rate)


@dataclass
class Explorer:
    """Keeps one session's acceptance estimate alive.

    The estimate moves only when drafts are verified. A session whose early drafts were
    poor can fall to where an autoregressive step beats any verification; from then on it
    verifies no draft, so it never sees that the draft has started predicting well (code
    after a prose preamble, say): the benchmark's code-sql prompt stepped 64 times in a
    row. So after `patience` passes in a row that declined the drafts on offer, one pass
    verifies what a fresh session would (`probe`). An exploration that does not win the
    policy back doubles the patience (up to `max_patience`), so a truly poor draft costs
    ever less; any verification the policy chooses itself resets it."""

    base_patience: int = 4
    max_patience: int = 64
    patience: int = field(init=False)  # declined passes the next exploration waits for
    declined: int = 0  # passes in a row that verified none of the drafts on offer
    exploring: bool = False  # the planned verification is an exploration

    def __post_init__(self) -> None:
        self.patience = self.base_patience

    def adjust(self, chosen: int, probe: Callable[[], int]) -> int:
        """The drafts to verify: the policy's `chosen`, or when it is time to explore,
        `probe()` (what a session at the prior acceptance would take of those on offer)."""
        if chosen or self.declined < self.patience:
            self.exploring = False
            return chosen
        n = probe()
        self.exploring = n > 0
        return n

    def record(self, taken: int, offered: int) -> None:
        """Account for a verification that took `taken` of the `offered` drafts."""
        if taken:
            self.declined = 0
            self.patience = min(self.max_patience, 2 * self.patience) if self.exploring else self.base_patience
        elif offered:
            self.declined += 1
        self.exploring = False
