"""A replay model of the ways to decode, over one prompt's teacher-forced draft agreement.

Input per prompt: for each position of the target's greedy continuation, whether the
draft's own greedy choice there, fed the target's tokens before it, is the same token.
With the target's pass time by tokens fed, the draft's time per token and the one-way
network delay, the model computes how long `none`, `sync` at k and `async` take to commit
the continuation after its first token. `async` runs the edge's own lookahead rule and the
server's own wait-and-size policy on a clock that moves from one event to the next (a whole
millisecond a step delayed every event to the next one: a 25.4 ms draft took 26).

Left out on purpose: the prompt's prefill (the same in every mode), host work, and the
noise of a shared machine. So the figures are what a mode can reach with these models at
this target speed, and a what-if (cheaper passes, a better draft) costs a few seconds to
ask instead of a benchmark run. No I/O here: `replay.py` feeds it and writes the report.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise

from specsplit.common.acceptance import acceptance_estimate
from specsplit.edge.lookahead import adaptive_window
from specsplit.server.policy import PassCostModel, plan
from specsplit.server.config import SchedulerConfig

EDGE_MAX_WINDOW = 32  # the edge's default adaptive lookahead cap


@dataclass(frozen=True)
class PassCosts:
    """Target pass time (ms) by tokens fed: linear between measured sizes, flat past the largest."""

    points: tuple[tuple[int, float], ...]

    def __post_init__(self) -> None:
        if not self.points or any(t < 1 or ms <= 0 for t, ms in self.points):
            raise ValueError("pass costs need at least one (tokens >= 1, ms > 0) point")
        object.__setattr__(self, "points", tuple(sorted(self.points)))

    def ms(self, tokens: int) -> float:
        pts = self.points
        if tokens <= pts[0][0]:
            return pts[0][1]
        for (t0, c0), (t1, c1) in pairwise(pts):
            if tokens <= t1:
                return c0 + (c1 - c0) * (tokens - t0) / (t1 - t0)
        return pts[-1][1]

    def flat(self) -> PassCosts:
        """Every pass at the cost of a one-token pass: the ideal small-batch kernel."""
        return PassCosts(((1, self.ms(1)),))


@dataclass(frozen=True)
class Link:
    draft_ms: float  # the edge's time to draft one token
    one_way_ms: float  # network delay each way


@dataclass(frozen=True)
class Decoded:
    ms: float  # time to commit the continuation after its first token
    tokens: int  # tokens committed in that time
    passes: int
    server_idle_ms: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / (self.ms / 1000.0)


def none(agree: Sequence[bool], costs: PassCosts) -> Decoded:
    """Server-only: one one-token pass per token."""
    n = len(agree) - 1
    return Decoded(n * costs.ms(1), n, n)


def sync(agree: Sequence[bool], costs: PassCosts, link: Link, k: int) -> Decoded:
    """Draft k, send, verify, hear back, and only then draft again."""
    total, committed, ms, idle, passes = len(agree), 1, 0.0, 0.0, 0
    while committed < total:
        n = min(k, total - committed - 1)
        waiting = n * link.draft_ms + 2 * link.one_way_ms  # the server idles while the edge drafts and the link carries
        ms += waiting + costs.ms(n + 1)
        idle += waiting
        committed += _leading_agreement(agree, committed, n) + 1
        passes += 1
    return Decoded(ms, total - 1, passes, idle)


def _leading_agreement(agree: Sequence[bool], start: int, n: int) -> int:
    run = 0
    while run < n and agree[start + run]:
        run += 1
    return run


@dataclass
class _Line:
    """The edge's current run of drafts: from `start`, drafted up to `tip` (exclusive);
    `wrong` is its first draft that differs from the target's token, if any yet."""

    start: int
    ident: int
    tip: int = field(init=False)
    wrong: int | None = None

    def __post_init__(self) -> None:
        self.tip = self.start

    def agrees_up_to(self, position: int) -> bool:
        """Whether every draft before `position` is the target's token."""
        return self.wrong is None or self.wrong >= position


def asynchronous(agree: Sequence[bool], costs: PassCosts, link: Link, config: SchedulerConfig | None = None,
                 max_window: int = EDGE_MAX_WINDOW) -> Decoded:
    """The edge drafts without stopping (within its lookahead) and sends each draft as it
    is made; the server verifies what it holds whenever the target is free, or waits for
    drafts on their way when its policy says that pays; verdicts travel back and a
    rejection makes the edge start again from the corrected position."""
    config = config or SchedulerConfig()
    total, owd = len(agree), link.one_way_ms
    model = PassCostModel()
    for n in range(config.max_verify_tokens + 1):
        model.observe(n, costs.ms(n + 1) / 1000.0)
    rate = 1000.0 / link.draft_ms

    line = _Line(start=1, ident=0)
    arrivals: dict[int, tuple[float, int]] = {}  # position -> (arrives at the server, line)
    drafting: tuple[float, int, int] | None = None  # (done at, line, position)
    verdicts: list[tuple[float, int, int, int]] = []  # (arrives at the edge, committed, accepted, offered)
    edge_committed, edge_accepted, edge_rejections = 1, 0, 0

    committed, accepted_total, rejections = 1, 0, 0
    running: tuple[float, int, int, int | None] | None = None  # (ends at, offered, from, line's wrong)
    planned: tuple[tuple[int, int], int, float] | None = None  # ((available, committed), drafts, ready at)
    passes, idle, t = 0, 0, 0
    while committed < total:
        # The edge hears verdicts; a rejection inside its line starts a new one.
        for v in [v for v in verdicts if v[0] <= t]:
            verdicts.remove(v)
            _, after, accepted, offered = v
            edge_committed = max(edge_committed, after)
            edge_accepted += accepted
            edge_rejections += accepted < offered
            if not line.agrees_up_to(after) or line.tip < after:
                line = _Line(start=after, ident=line.ident + 1)
                drafting = None
        if drafting is not None and drafting[0] <= t:
            _, ident, position = drafting
            drafting = None
            if ident == line.ident and position == line.tip:
                if line.wrong is None and not agree[position]:
                    line.wrong = position
                line.tip += 1
                arrivals[position] = (t + owd, ident)
        window = adaptive_window(edge_accepted, edge_rejections, max_window)
        if drafting is None and line.tip - edge_committed < window and line.tip < total - 1:
            drafting = (t + link.draft_ms, line.ident, line.tip)

        # The server: finish a pass, or plan the next one.
        if running is not None and running[0] <= t:
            _, offered, start, wrong = running
            running = None
            accepted = offered if wrong is None else max(0, min(offered, wrong - start))
            committed = start + accepted + 1
            accepted_total += accepted
            rejections += accepted < offered
            verdicts.append((t + owd, committed, accepted, offered))
        if running is None and committed < total:
            available = 0
            if line.start <= committed and line.agrees_up_to(committed):
                while (arrival := arrivals.get(committed + available)) and arrival[0] <= t and arrival[1] == line.ident:
                    available += 1
            available = min(available, total - committed - 1)
            key = (available, committed)
            if planned is None or planned[0] != key:
                alpha = acceptance_estimate(accepted_total, rejections)
                # As the server: near the end a generation takes fewer drafts, and none are waited
                # for where the last token, always the target's own, is all that is left.
                limit = min(config.max_verify_tokens, total - committed - 1)
                drafts, wait_s = plan(available, limit, alpha, model, rate, config.max_wait_s)
                planned = (key, drafts, t + wait_s * 1000.0)
            if t >= planned[2]:
                offered = min(planned[1], available)
                running = (t + costs.ms(offered + 1), offered, committed, line.wrong)
                planned = None
                passes += 1
        if committed >= total:
            break
        # On to the next event: a verdict reaching the edge, a draft made, a draft reaching the
        # server, the pass's end, or the end of the server's wait.
        upcoming = [v[0] for v in verdicts] + [a for a, _ in arrivals.values() if a > t]
        upcoming += [event[0] for event in (drafting, running) if event is not None]
        if running is None and planned is not None:
            upcoming.append(planned[2])
        if not upcoming:
            raise RuntimeError("the model stalled: nothing left to happen")  # a bug of the model's
        after = max(t, min(upcoming))
        if running is None:
            idle += after - t
        t = after
    return Decoded(float(t), total - 1, passes, float(idle))
