"""The verification worker: the one owner of the target model.

Sessions hand it work by holding candidates (or by waiting for an autoregressive
step). Each round it takes every session that is ready, in round-robin order, into one
target pass, up to a session count and a token budget (padded tokens: rows times the
widest); a session left out leads once it has waited a round, new sessions or not, so none
starves. The
pass runs in a worker thread so the event loop keeps moving messages; shortly before it
is expected to end the next pass is picked (over sessions not in it), it starts as soon
as the running one ends, and the finished pass's verdicts go into each session's bounded
outbox while the next one runs (`run`). A session whose
outbox is full (its edge is not reading) is skipped rather than waited for, so it cannot
slow the others, and is ended once it has stayed full for `stalled_edge_s`. Whether an
asynchronous session should first wait for drafts on their way, and how many drafts a
session alone verifies, is the policy's call (`policy.py`); when many sessions are ready,
each offers all it holds up to its fair share of the token budget, and since every row
is padded to the batch's widest, the feeds are cut together to the width that commits
the most tokens per second of measured pass time, or of the host's time on the pass's
sessions where that is longer (`policy.choose_width`); an engine that can split a feed
over rows takes a longer one (a prompt) as several rows of that width. A task with an
edge's branch feeds it in the same row, after the drafts (engines that can:
`Engine.verifies_branches`).
"""
from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from specsplit.common.acceptance import acceptance_estimate
from specsplit.common.aio import within
from specsplit.protocol import errors
from specsplit.protocol.messages import Done, DraftMode, Verdict, VerificationMode
from specsplit.protocol.server_session import ServerSession, VerifyTask
from specsplit.server.config import OUTBOX_ROOM, SchedulerConfig
from specsplit.server.engine import Engine, KVState, VerifyItem
from specsplit.server.metrics import ServerMetrics
from specsplit.server.pace import PaceLog
from specsplit.server.policy import Explorer, PassCostModel, choose_drafts, choose_width, plan

log = logging.getLogger(__name__)

DEFAULT_DRAFT_RATE = 10.0  # drafts per second an edge is assumed to send before it is measured
RATE_SAMPLE_S = 0.05  # the draft rate's samples are at least this far apart: 32 of them span 1.6 s or more
PACE_MARGIN = 0.1  # ahead of the pace by more than this share, a session may sit a pass out
# The next pass is picked this many times the pick's usual host time, plus PICK_MARGIN_S,
# before the running pass is expected to end (_pick_ahead).
PICK_LEAD = 1.5
PICK_MARGIN_S = 0.002
PICK_WEIGHT = 0.2  # of the latest pick in the pick's usual host time
HOST_WEIGHT = 0.2  # of the latest pass in the host's usual time per session (_observe_host)


@dataclass
class SessionHandle:
    session: ServerSession
    outbox: asyncio.Queue
    kv: KVState = field(default_factory=KVState)
    idle_since: float = field(default_factory=time.monotonic)
    busy_s: float = 0.0  # time the target spent on this session
    stream_task: asyncio.Task | None = None  # the servicer task, cancelled if the edge stalls
    stalled: bool = False  # ended because its edge stopped reading (the servicer's reason for the end)
    timed_out: bool = False  # a sync session ended for sending no drafts (_sync_ready_at)
    full_since: float | None = None  # when the outbox last filled up
    budget: int = 0  # drafts the next verification takes, as planned
    arrivals: deque = field(default_factory=lambda: deque(maxlen=32))  # (time, drafts received so far), RATE_SAMPLE_S apart
    waiting_since: float | None = None  # when it began waiting for drafts, until its next pass
    overdue_at: int | None = None  # left out of a pass: the pick from which it leads, until taken (_pick)
    explorer: Explorer = field(default_factory=Explorer)  # verifies drafts now and then when the policy declines them
    sending: bool = True  # False once the edge has half-closed: no drafts will come, so nothing waits for them
    # What its device committed lately, for the pace: the stream's, across its generations (pace.py).
    pace: PaceLog = field(default_factory=lambda: PaceLog(time.monotonic()))

    def draft_rate(self, now: float) -> float:
        """Drafts per second lately received from the edge, up to `now`. Sampled by time, not
        by call: the scheduler asks at every pick, and hundreds of picks a second (wakes from
        other sessions' drafts) would fill the samples within a fraction of a second, never
        measure and keep an edge that stopped sending looking like one that sends."""
        received = self.session.drafts_received
        if not self.arrivals or now - self.arrivals[-1][0] >= RATE_SAMPLE_S:
            self.arrivals.append((now, received))
        t0, n0 = self.arrivals[0]
        return (received - n0) / (now - t0) if now - t0 > 0.2 else DEFAULT_DRAFT_RATE


@dataclass
class PassFill:
    """The rows and tokens (rows times the widest) of a pass being filled, for its limits.
    With a `split_width` (the engine splits feeds over rows and the width cut will), a feed
    longer than that does not widen the pass: it counts as rows of the pass's width, so a
    long prompt does not keep a busy batch to a few sessions."""

    split_width: int
    longest: int = 0  # the widest feed that takes one row
    one_row: int = 0  # feeds that take one row
    long_feeds: list[int] = field(default_factory=list)

    def with_feed(self, feed: int) -> tuple[int, int]:
        """(rows, tokens) of the pass with a feed of `feed` tokens added."""
        if self.split_width and feed > self.split_width:
            return self._shape(self.one_row, self.longest, [*self.long_feeds, feed])
        return self._shape(self.one_row + 1, max(self.longest, feed), self.long_feeds)

    def add(self, feed: int) -> None:
        if self.split_width and feed > self.split_width:
            self.long_feeds.append(feed)
        else:
            self.one_row, self.longest = self.one_row + 1, max(self.longest, feed)

    def _shape(self, one_row: int, longest: int, long_feeds: list[int]) -> tuple[int, int]:
        width = longest or self.split_width
        rows = one_row + sum(-(-f // width) for f in long_feeds)
        return rows, rows * width


@dataclass(frozen=True)
class Share:
    """A session's part of one pass: its task and the row that verifies it."""

    handle: SessionHandle
    task: VerifyTask
    item: VerifyItem


@dataclass
class HandedPass:
    """A pass handed to the target's thread, where it runs after any pass handed before it."""

    batch: list[Share]
    items: list[VerifyItem]  # the batch's, as handed to the target (which says when it began them)
    running: asyncio.Future  # type: ignore[type-arg]
    # Each forward pass's padded tokens, rows x tokens per row (Engine.forward_shapes).
    padded_tokens: list[int]


class VerificationWorker:
    def __init__(self, engine: Engine, config: SchedulerConfig, metrics: ServerMetrics | None = None) -> None:
        self.engine = engine
        self.config = config
        self.metrics = metrics or ServerMetrics()
        self.sessions: dict[str, SessionHandle] = {}
        self._order: deque[str] = deque()
        self._in_flight: set[str] = set()  # sessions picked for a pass whose verdicts are not delivered yet
        self._wake = asyncio.Event()
        # One thread: the model is used by one verification at a time.
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="target")
        self.costs = PassCostModel()  # pass time by the most drafts a session put in
        self.pass_costs = PassCostModel()  # pass time by padded tokens (rows x feed width, as the engine pads)
        self._pick_s = 0.0  # the pick's usual host time (exponentially weighted)
        # The event loop's CPU time per session a pass serves (delivering, picking, the
        # streams' messages), exponentially weighted: what a pass's sessions cost the host.
        self._host_per_visit = 0.0
        self._host_mark = time.thread_time()
        self._began: tuple[float, list[VerifyItem] | None] = (0.0, None)  # the latest pass's start, on the target's thread
        self._picks = 0  # picks so far: the clock of SessionHandle.overdue_at

    def add(self, handle: SessionHandle) -> None:
        """A new session goes to the front of the line: its first pass gives its generation's
        first token, which it would otherwise wait a whole round for (a round of 700 split
        sessions on a GPU is four passes, about 200 ms). Each generation is first once, so
        the round robin stays fair, and one left out of passes for a round leads even so (_pick)."""
        self.sessions[handle.session.session_id] = handle
        self._order.appendleft(handle.session.session_id)
        self.notify()

    def remove(self, session_id: str) -> None:
        """Forget a session and free its KV cache. If it is in a pass not yet delivered, the
        pass's result for it is dropped and its cache freed at delivery."""
        handle = self.sessions.pop(session_id, None)
        if handle is not None:
            self._order.remove(session_id)
            if session_id not in self._in_flight:
                handle.kv.crop(0)
            self.notify()  # an idle worker updates the gauges; a busy one does after each pass

    def notify(self) -> None:
        self._wake.set()

    def held(self) -> int:
        """Sessions holding a KV cache: the open ones, and ones gone while in a pass not yet
        delivered, whose caches are freed at delivery. What admission counts, so that a new
        session never finds every cache taken."""
        return len(self.sessions) + len(self._in_flight.difference(self.sessions))

    def _ready_at(self, h: SessionHandle, now: float) -> float | None:
        """When the session may next be verified (now or later), or None if not at all;
        sets h.budget, the drafts that verification takes (see _budget_alone)."""
        s = h.session
        if s.done is not None:
            return None
        if h.outbox.qsize() > h.outbox.maxsize - OUTBOX_ROOM:
            h.full_since = h.full_since or now
            if now - h.full_since > self.config.stalled_edge_s and h.stream_task is not None:
                h.stalled = True  # its servicer logs the end, with the edge's address
                h.stream_task.cancel()
                return None
            return h.full_since + self.config.stalled_edge_s + 0.01  # look again then
        h.full_since = None
        # Near its end a generation takes fewer drafts than the limit: none are waited for there.
        limit = min(self.config.max_verify_tokens, s.draft_room)
        available = s.candidate_count
        mode = s.request.draft_mode
        h.budget = min(available, limit)
        if mode is DraftMode.NONE or not h.sending:
            return now
        if mode is DraftMode.SYNC:
            # The classic scheme: wait for the k drafts the edge sends, verify them all.
            return now if available else self._sync_ready_at(h, now)
        if self.config.idle_policy == "adaptive":
            return self._adaptive_ready_at(h, now, available, limit)
        if available or self.config.idle_policy == "ar":
            return now
        return h.idle_since + self.config.idle_wait_s

    def _sync_ready_at(self, h: SessionHandle, now: float) -> float | None:
        """A sync session holding no drafts: looked at again when its edge's time to send them
        runs out, then ended with DEADLINE_EXCEEDED (its servicer aborts the call) and removed
        at once: left to its servicer, it held its place and cache for as long as the edge
        read nothing (the servicer stuck writing to it, the error queued behind)."""
        ends = h.idle_since + self.config.sync_draft_timeout_s
        if now < ends:
            return ends  # not ready then either: the pick that looks then ends it
        if not h.timed_out:
            h.timed_out = True
            limit = self.config.sync_draft_timeout_s
            if self._put(h, errors.DraftsTimedOut(f"sync session: no drafts for {limit:g} s")):
                self.remove(h.session.session_id)  # (no room: _put left it to its servicer, as a stalled one)
        return None

    def _adaptive_ready_at(self, h: SessionHandle, now: float, available: int, limit: int) -> float:
        """An asynchronous session under the "adaptive" idle policy: verified now, or once the
        drafts on their way have come, as the plan says yields more tokens per second, but
        never more than max_wait_s after it began waiting, however often it is looked at (each
        look plans afresh). With --fixed-verify the plan still says when; the pass then takes
        every draft held up to the limit."""
        s = h.session
        if self._must_feed(h) > 1:
            # A prefill (or a reconnect's catch-up): the pass costs what the prompt costs, so
            # drafts waited for would add nothing but delay to the first token.
            return now
        alpha = acceptance_estimate(s.drafts_accepted, s.rejections)
        rate = h.draft_rate(now)
        drafts, wait = plan(available, limit, alpha, self.costs, rate, self.config.max_wait_s)
        if wait > 0.0:
            if h.waiting_since is None:
                h.waiting_since = now
            deadline = h.waiting_since + self.config.max_wait_s
            if now < deadline:
                log.debug("session %s: waits up to %.0f ms for drafts (holds %d, plans %d; acceptance %.2f, "
                          "%.1f drafts/s)", s.session_id, wait * 1000, available, drafts, alpha, rate)
                return min(now + wait, deadline)
            drafts = choose_drafts(available, limit, alpha, self.costs)  # waited its longest: what it holds
        if self.config.adaptive:
            h.budget = self._explore(h, drafts, available, limit)
        return now

    def _budget_alone(self, h: SessionHandle) -> int:
        """The drafts a session verifies in a pass of its own: its policy's plan. The
        "adaptive" idle policy plans in _ready_at, where the plan also decides whether to
        wait; under the others the plan is made here, only for a session that is alone
        (one in a batch offers all it holds: _pick), since it costs more host time than
        anything else the pick does for a session."""
        s = h.session
        if not (self.config.adaptive and self.config.idle_policy != "adaptive"
                and s.request.draft_mode is DraftMode.ASYNC and h.sending):
            return h.budget
        available, limit = s.candidate_count, self.config.max_verify_tokens
        alpha = acceptance_estimate(s.drafts_accepted, s.rejections)
        return self._explore(h, choose_drafts(available, limit, alpha, self.costs), available, limit)

    @staticmethod
    def _must_feed(h: SessionHandle) -> int:
        """Tokens the session's next pass feeds besides its drafts: the last committed one,
        or the whole prompt while the cache is empty."""
        s = h.session
        return s.committed_len - h.kv.reusable(s.tokens[: s.committed_len])

    def _explore(self, h: SessionHandle, chosen: int, available: int, limit: int) -> int:
        """`chosen`, or now and then what a fresh session would verify (policy.Explorer)."""
        return h.explorer.adjust(chosen, lambda: choose_drafts(available, limit, acceptance_estimate(0, 0), self.costs))

    def _pick(self) -> tuple[list[Share], float | None]:
        """The next pass's sessions, or none and when to look again (None: when woken)."""
        now = time.monotonic()
        soonest: float | None = None
        ready: list[SessionHandle] = []
        for sid in list(self._order):  # (a look may end a session: _sync_ready_at)
            if sid in self._in_flight:
                continue  # its last pass's verdict is not applied yet
            h = self.sessions[sid]
            at = self._ready_at(h, now)
            if at is None:
                continue
            if at <= now:
                ready.append(h)
            else:
                soonest = at if soonest is None else min(soonest, at)
        cfg = self.config
        if cfg.pace_tokens_per_s and len(ready) > 1:
            ready = self._pace(ready, now)
        # The round robin serves a session left out of a pass within a round, but new sessions
        # go to the front of the line (add): one left out for the budget (a long prompt that
        # fits no pass beside a new session) or the cap would be passed over for as long as
        # sessions keep opening. So once it has waited a round's picks it leads, new or not.
        self._picks += 1
        overdue = sorted((h for h in ready if h.overdue_at is not None and h.overdue_at <= self._picks),
                         key=lambda h: h.overdue_at)
        if overdue:
            ready = [*overdue, *(h for h in ready if h.overdue_at is None or h.overdue_at > self._picks)]
        share = max(1, cfg.max_batch_tokens // min(len(ready), cfg.max_batch_sessions) - 1) if ready else 0
        batch: list[Share] = []
        cuts = cfg.adaptive and self.pass_costs.known() >= 2  # without a cost curve, nothing is cut
        fill = PassFill(self.engine.split_width if cuts else 0)  # feeds are split only by the width cut
        for h in ready:
            # Alone, a session verifies what its own policy planned. In a batch, the pass's width
            # is set by all its rows and paid for by each, so a row that stopped short of it would
            # waste padding it pays for anyway: every session offers all it holds and the width
            # cut below sizes them together. (Planned alone, a session whose acceptance estimate
            # was poor verified fewer drafts in every pass, committed less a pass and stayed behind.)
            budget = self._budget_alone(h) if len(ready) == 1 else min(h.session.candidate_count, cfg.max_verify_tokens)
            share_ = self._share(h, h.session.next_task(min(budget, share)), h.session.tokens)
            rows, tokens = fill.with_feed(share_.item.feed_length)
            if batch and (tokens > cfg.max_batch_tokens or rows > cfg.max_batch_sessions):
                continue  # it leads the next round
            batch.append(share_)
            fill.add(share_.item.feed_length)
            if len(batch) == cfg.max_batch_sessions:
                break
        if cuts and len(batch) > 1:
            batch = self._cut_to_width(batch)
        for share_ in batch:
            share_.handle.explorer.record(len(share_.task.drafts), share_.handle.session.candidate_count)
        taken = [share_.handle.session.session_id for share_ in batch]
        chosen = set(taken)
        round_picks = -(-len(ready) // max(1, len(batch)))  # picks the round robin takes to serve every ready session
        for h in ready:
            if h.session.session_id in chosen:
                h.overdue_at = h.waiting_since = None
            elif h.overdue_at is None:
                h.overdue_at = self._picks + round_picks
        # Round robin: the sessions just taken go to the back of the line.
        if taken:
            self._order = deque([*(sid for sid in self._order if sid not in chosen), *taken])
        return batch, soonest

    def _pace(self, ready: list[SessionHandle], now: float) -> list[SessionHandle]:
        """SLO-aware batching: when a ready session has committed slower than the pace, the
        ready sessions ahead of it (by more than PACE_MARGIN) sit this pass out. The pass is
        smaller, so it comes round sooner for those behind: a session whose luck with its
        drafts was poor (more rejections, fewer tokens a pass) catches up at the expense of ones
        comfortably ahead. Only ready sessions count as behind, ones the server can help now;
        nobody is held back while nobody is, so an idle server stays work-conserving."""
        pace = self.config.pace_tokens_per_s
        rates = [h.pace.rate(now) for h in ready]
        if not any(r is not None and r < pace for r in rates):
            return ready
        kept = [h for h, r in zip(ready, rates) if r is None or r <= pace * (1 + PACE_MARGIN)]
        self.metrics.sessions_paced.inc(len(ready) - len(kept))
        return kept

    def _for_engine(self, task: VerifyTask | None) -> VerifyTask:
        """The task, without its branches if the engine does not verify branches."""
        assert task is not None
        if task.branches and not self.engine.verifies_branches:
            task = dataclasses.replace(task, branches=())  # they may still become the candidates after the pass
        return task

    def _share(self, h: SessionHandle, task: VerifyTask | None, tokens: list[int]) -> Share:
        """The row a session's task puts into a pass, with the task's branches if the engine
        verifies branches."""
        task = self._for_engine(task)
        # A copy of the prefix: drafts may arrive while the model runs.
        item = VerifyItem(h.kv, tokens[: task.start], task.drafts, greedy=h.session.mode is VerificationMode.GREEDY,
                          branches=[(b.at - task.start, b.tokens) for b in task.branches])
        return Share(h, task, item)

    def _narrow(self, share: Share, task: VerifyTask | None) -> Share:
        """The share verifying `task`, a smaller one of the same session from the same point."""
        task = self._for_engine(task)
        return Share(share.handle, task, share.item.narrowed(task.drafts, [(b.at - task.start, b.tokens) for b in task.branches]))

    def _cut_to_width(self, batch: list[Share]) -> list[Share]:
        """Trim the sessions' drafts to the feed width that yields the most tokens per second
        for this batch (policy.choose_width): a few long feeds must not pad everyone. An
        engine that can split a feed over rows (split_width) takes a longer one, a prompt
        say, in pieces of that width, so it does not widen the rows of all the others.
        Where no width splits the feeds within the pass's limits (the pick counts a long
        feed's rows at the batch's own width, which need not be one the engine pads to), each
        feed goes whole, in a row of its own; where that is too many tokens too, the last
        sessions lead the next round instead."""
        while (cut := self._cut(batch)) is None:
            batch = batch[:-1]
        return cut

    def _cut(self, batch: list[Share]) -> list[Share] | None:
        """_cut_to_width's cut of `batch`, or None where the engine splits feeds and neither a
        split nor whole feeds fit the pass's limits."""
        if len(batch) == 1:
            return batch  # alone, it verifies what it was planned with
        rows = [(sh.item.feed_length - len(sh.task.drafts) - sh.item.branch_tokens, len(sh.task.drafts),
                 acceptance_estimate(sh.handle.session.drafts_accepted, sh.handle.session.rejections)) for sh in batch]
        floors = np.array([f for f, _, _ in rows])

        def whole(w: int) -> int:
            return math.prod(self.engine.padded_shape(len(batch), w))

        def split(w: int) -> int | None:
            row_width = self.engine.padded_shape(1, w)[1]  # where the engine cuts pieces
            pieces = int((-(-floors // row_width)).sum())
            # More rows, or tokens (rows times the width, as the pick and the shapes captured at
            # start count them), than a pass may take: a width past the pick's widens every
            # row, split or not.
            if pieces > self.config.max_batch_sessions or pieces * row_width > self.config.max_batch_tokens:
                return None
            return math.prod(self.engine.padded_shape(pieces, w))

        host_s = self._host_per_visit * len(batch)
        split_width = self.engine.split_width
        width = choose_width(rows, split if split_width else whole, self.pass_costs, split_width, host_s)
        if split_width and split(width) is None:  # no split fits the pass's limits: every feed goes whole
            width = choose_width(rows, whole, self.pass_costs, 0, host_s)
            if len(batch) * min(width, split_width) > self.config.max_batch_tokens:
                return None  # a row each is too many tokens too
            split_width = 0
        cut = []
        for sh, (floor, drafts, _) in zip(batch, rows):
            pieces = -(-floor // width) if split_width else 1
            room = pieces * width
            if sh.item.feed_length > room:  # never more drafts than it was planned with (a branch made it wide)
                sh = self._narrow(sh, sh.handle.session.next_task(min(room - floor, drafts)))
            while sh.task.branches and sh.item.feed_length > room:  # the drafts fit, the branches beside them do not
                sh = self._narrow(sh, dataclasses.replace(sh.task, branches=sh.task.branches[:-1]))
            sh.item.pieces = pieces
            cut.append(sh)
        return cut

    async def run(self) -> None:
        # A finished pass's verdicts are delivered while the next pass runs, so that the
        # host's work on one pass overlaps the target's on the next (on a GPU the target
        # otherwise waits for it: a fifth of the time at a few hundred sessions). The price:
        # a session of the finished pass cannot be in the next one, even if all its drafts
        # held; any other session waits on its edge's answer for about that long anyway.
        # The pass after next is picked while the next one runs, too, and handed to the
        # target at once (_pick_ahead).
        finished: tuple[list[Share], list, float] | None = None
        queued: HandedPass | None = None
        try:
            while True:
                if queued is None:
                    batch, soonest = self._take()
                    if not batch:
                        if finished is not None:
                            self._deliver_pass(*finished)
                            finished = None
                            continue  # its sessions may be ready now
                        self._update_gauges()
                        self._wake.clear()
                        timeout = None if soonest is None else max(0.0, soonest - time.monotonic())
                        try:
                            await within(self._wake.wait(), timeout)
                        except asyncio.TimeoutError:
                            pass
                        self._host_mark = time.thread_time()  # what the loop did while no pass ran is no pass's
                        continue
                    queued = self._hand(batch)
                current, queued = queued, None
                batch, items, running, padded_tokens = current.batch, current.items, current.running, current.padded_tokens
                began_at, began_items = self._began
                # A pass picked ahead began as the last one ended (on the target's thread); a
                # pass handed just now begins about now.
                started = began_at if began_items is items else time.monotonic()
                if finished is not None:
                    self._deliver_pass(*finished)
                queued = await self._pick_ahead(running, started, padded_tokens)
                results, elapsed, passes = await self._results(running, items)
                if log.isEnabledFor(logging.DEBUG):
                    log.debug("pass: %d sessions, feeds %s, drafts %s, %.0f ms", len(batch),
                              [i.feed_length for i in items], [len(sh.task.drafts) for sh in batch], elapsed * 1000)
                if passes is not None:  # one-by-one retries time no pass of this shape
                    # Only a batch that took one forward pass times its shape: one that fed a
                    # long prompt ahead, or was split for its cache's size, took several.
                    if passes == 1:
                        if all(sh.item.feed_length == len(sh.task.drafts) + 1 for sh in batch):
                            # Timed by drafts, so only passes that fed nothing else: one prefill (or a
                            # branch) would otherwise make verifying a draft or two look as dear as a prompt.
                            self.costs.observe(max(len(sh.task.drafts) for sh in batch), elapsed)
                        self.pass_costs.observe(padded_tokens[0], elapsed)
                    self.metrics.verify_seconds.observe(elapsed)
                self._observe_host(len(batch))
                self.metrics.batch_sessions.observe(len(batch))
                for tokens in padded_tokens:
                    self.metrics.batch_tokens.observe(tokens)
                finished = (batch, results, elapsed)
        finally:
            if queued is not None:  # not started yet, it is dropped; started, it ends unread
                queued.running.cancel()

    def _observe_host(self, sessions: int) -> None:
        """Charge the event loop's CPU time since the last pass ended to the `sessions` of the
        pass just ended: over a pass the loop delivers one pass's verdicts, picks the next
        and carries about as many sessions' messages."""
        mark = time.thread_time()
        self._host_per_visit += HOST_WEIGHT * ((mark - self._host_mark) / sessions - self._host_per_visit)
        self._host_mark = mark

    def _take(self) -> tuple[list[Share], float | None]:
        """_pick, with its sessions marked in flight and its host time measured."""
        t0 = time.monotonic()
        batch, soonest = self._pick()
        self._in_flight.update(sh.handle.session.session_id for sh in batch)
        if batch:  # a pick that found nobody ready is no measure of one that builds a pass
            self._pick_s += PICK_WEIGHT * (time.monotonic() - t0 - self._pick_s)
        return batch, soonest

    async def _pick_ahead(self, running: asyncio.Future,  # type: ignore[type-arg]
                          started: float, padded_tokens: list[int]) -> HandedPass | None:
        """The pass after the running one, picked shortly before the running one is expected to
        end (by the measured pass times) and handed to the target's thread at once, so that it
        starts as the running one ends, whatever the event loop is doing then; yet sessions
        whose drafts arrive during the pass are in it: most are the ones whose verdicts went
        out as the pass began. None if the pass ends first (the loop picks then, as it must
        before anything is known of pass times); a session ready only after the pick waits for
        the pass after. A session that ends before its queued pass does is verified all the
        same and dropped at delivery, its slot freed then."""
        if not self.pass_costs.known():
            return None
        lead = PICK_LEAD * self._pick_s + PICK_MARGIN_S
        # Each forward pass of a batch that takes several (a long prompt fed ahead, an outsize
        # cache split) at its own shape's cost: timed as one pass, the batch would be picked after
        # too early, and sessions whose drafts come meanwhile would miss it.
        expected = sum(self.pass_costs.cost(tokens) for tokens in padded_tokens)
        delay = started + expected - lead - time.monotonic()
        if delay > 0:
            await asyncio.wait({running}, timeout=delay)
        if running.done():
            return None
        batch = self._take()[0]
        return self._hand(batch) if batch else None

    def _hand(self, batch: list[Share]) -> HandedPass:
        """`batch`'s pass, handed to the target's thread."""
        items = [sh.item for sh in batch]
        # Read before the pass is handed over: nothing of the items is read while it runs.
        padded = [rows * width for rows, width in self.engine.forward_shapes(items)]
        running = asyncio.get_running_loop().run_in_executor(self._pool, self._timed_pass, items)
        return HandedPass(batch, items, running, padded)

    def _timed_pass(self, items: list[VerifyItem]) -> tuple[list, float, int]:  # type: ignore[type-arg]
        """The engine's results, its time for them, timed in the target's thread (the event
        loop may be delivering the last pass when this one ends), and the forward passes
        they took."""
        t0 = time.monotonic()
        self._began = (t0, items)
        before = self.engine.forward_passes
        results = self.engine.verify_batch(items)
        return results, time.monotonic() - t0, self.engine.forward_passes - before

    async def _results(self, running: asyncio.Future,  # type: ignore[type-arg]
                       items: list[VerifyItem]) -> tuple[list, float, int | None]:  # type: ignore[type-arg]
        """Each item's result, or the exception its verification raised; the seconds the
        target spent on them; and the forward passes the batch took, None where it was not
        verified as one. A failing batched pass is retried one session at a time, so one bad
        session cannot fail the others; then the seconds are the retries' own (a pass queued
        meanwhile runs between them)."""
        try:
            return await running
        except Exception as exc:
            if len(items) == 1:
                return [exc], 0.0, None
            log.warning("a pass over %d sessions failed (%s); verifying them one by one", len(items), exc)
        results: list = []  # type: ignore[type-arg]
        spent = 0.0
        loop = asyncio.get_running_loop()
        for item in items:
            try:
                (result,), took, _ = await loop.run_in_executor(self._pool, self._timed_pass, [item])
                results.append(result)
                spent += took
            except Exception as exc:
                results.append(exc)
        return results, spent, None

    def _deliver_pass(self, batch: list[Share], results: list, elapsed: float) -> None:  # type: ignore[type-arg]
        if len(results) != len(batch):  # an engine's bug: which result is whose is unknown
            results = [RuntimeError(f"the engine returned {len(results)} results for {len(batch)} sessions")] * len(batch)
        for sh, result in zip(batch, results):
            self.metrics.verify_drafts.observe(len(sh.task.drafts))
            sh.handle.busy_s += elapsed / len(batch)
            self._in_flight.discard(sh.handle.session.session_id)
            try:
                self._deliver(sh, result, elapsed)
            except Exception as exc:  # noqa: BLE001 - a result the session cannot take (an engine's bug) ends it alone
                self._fail(sh.handle, exc)
        self._update_gauges()  # once per pass: it walks every session

    def _deliver(self, share: Share, result, elapsed: float) -> None:  # type: ignore[no-untyped-def]
        handle, task = share.handle, share.task
        s = handle.session
        if s.session_id not in self.sessions:
            handle.kv.crop(0)  # the edge went away during the pass
            return
        if isinstance(result, Exception):
            self._fail(handle, result)
            return
        if task.branches:
            sizes = [len(task.drafts) + 1, *(len(b.tokens) for b in task.branches)]  # the line's rows, then each branch's
            line, *aside = np.split(result, np.cumsum(sizes[:-1]))
        else:  # most tasks: splitting one piece off would cost more than the rest of the delivery
            line, aside = result, []
        committed = s.committed_len
        events = s.apply(task, line, aside)
        if self.config.pace_tokens_per_s:
            handle.pace.commit(time.monotonic(), s.committed_len - committed)
        if s.branch_verified is not None:
            handle.kv.take_branch(s.branch_verified)  # the cache follows the committed line onto the branch
            self.metrics.branches_verified.inc()
        for event in events:
            if isinstance(event, Verdict):
                event = dataclasses.replace(event, verify_ms=elapsed * 1000)
            elif isinstance(event, Done):
                event = dataclasses.replace(event, target_busy_s=handle.busy_s)
            if not self._put(handle, event):
                return
        if not s.candidate_count:
            handle.idle_since = time.monotonic()
        if s.done is not None:
            self.remove(s.session_id)

    def _fail(self, handle: SessionHandle, exc: Exception) -> None:
        """End the session with `exc`, which its edge gets as INTERNAL: a failing model, or a
        result the session cannot take, must not take the other sessions down, nor the
        worker that serves them all."""
        sid = handle.session.session_id
        log.error("session %s: verification failed", sid, exc_info=exc, extra={"session": sid})
        self._put(handle, exc)
        self.remove(sid)

    def _put(self, handle: SessionHandle, item: object) -> bool:
        """Queue `item` for the session's edge; False where its outbox had no room (a pass
        picks only sessions with OUTBOX_ROOM free, but an edge that stops reading while its
        stream's reader adds more can fill it meanwhile): the session ends as a stalled one,
        and the worker, which serves every session, goes on."""
        try:
            handle.outbox.put_nowait(item)
        except asyncio.QueueFull:
            handle.stalled = True
            if handle.stream_task is not None:
                # Its servicer finds the handle stalled, counts and logs the end so, and
                # removes it; meanwhile a full outbox keeps it out of passes.
                handle.stream_task.cancel()
            else:
                self.remove(handle.session.session_id)
            return False
        return True

    def _update_gauges(self) -> None:
        self.metrics.outbox_depth.set(sum(h.outbox.qsize() for h in self.sessions.values()))
        self.metrics.kv_bytes.set(sum(h.kv.nbytes() for h in self.sessions.values()))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
