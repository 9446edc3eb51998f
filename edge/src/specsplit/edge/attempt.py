"""One attempt at a generation, on one call: drafts continuously and streams candidates to
the server while it reads and applies the verdicts.

Three modes share one loop: `async` drafts ahead up to the lookahead window and never
waits for verdicts; `sync` drafts k tokens, sends them, and waits for the verdict
(the classic scheme, as a baseline); `none` sends no drafts (remote decoding, the
autoregressive baseline). A greedy `async` edge also drafts branches beside its line,
from its runner-up where rejections are likeliest (branching.py): the server verifies them
in the same pass, so a rejection the edge foresaw costs no round trip. The drafter runs in
a worker thread so verdicts are read and applied while it computes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from specsplit.common.aio import being_cancelled, within
from specsplit.edge.branching import DraftChoice, choose_branch, draft_choice
from specsplit.edge.config import MODES, ConnectOptions, EdgeConfig
from specsplit.edge.drafter import BatchDrafter, BranchOffering, Drafter, EndAware, TokenPicker, VocabSized
from specsplit.edge.failures import CallCancelled, OnCommitFailed, StreamEnded, StreamStalled
from specsplit.edge.lookahead import adaptive_window
from specsplit.edge.proposer import Proposer
from specsplit.edge.retry import SERVER_REFUSALS
from specsplit.edge.stats import GenerationStats
from specsplit.edge.stream import GenerateStream
from specsplit.protocol import codec, errors
from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.messages import MAX_CHUNK, Done, Opened, OpenRequest, Verdict, VerificationMode
from specsplit.protocol.trajectory import draft_end_for

log = logging.getLogger(__name__)

GRPC_FRAME_BYTES = 5  # length prefix of every gRPC message
# The wait for a generation's first verdict is its prompt's prefill, which grows with the prompt
# (a CPU server prefills some tens of tokens a second): it may take this much more than
# --stall-timeout per token fed. Without it a long prompt stalled, was re-opened, and was
# prefilled again, until the retries ran out on a server working all along.
PREFILL_ALLOWANCE_S = 0.05


@dataclass
class GenerationResult:
    """`tokens`: everything generated after the prompt, a resumed generation's committed_ids
    first. `commit_times` (seconds from the call's start) and `stats` (its `tokens` and
    `tokens_per_s` too) cover what this call generated: the tokens after those."""

    tokens: list[int]
    stats: GenerationStats
    opened: Opened | None = None
    commit_times: list[float] = field(default_factory=list)
    timeline: list[tuple] = field(default_factory=list)


@dataclass
class Record:
    """What a generation measures, kept over its attempts: after a retry, its times still count
    from the first attempt's start and its counts go on from the attempts before."""

    stats: GenerationStats
    resumed: int = 0  # the caller's committed_ids: generated before this call, not by it
    warned_k: bool = False  # that sync's k is past what the server takes
    t0: float = field(default_factory=time.perf_counter)
    commit_times: list[float] = field(default_factory=list)
    timeline: list[tuple] = field(default_factory=list)


class Attempt:
    """One attempt at a generation: `run` opens the session on a call, drafts and reads until
    its Done, and measures into the generation's Record, which the next attempt, after a
    retry, goes on with."""

    def __init__(
        self,
        drafter: Drafter | None,
        prompt_ids: Sequence[int],
        cfg: EdgeConfig,
        fingerprint: str,
        draft_model: str,
        committed_ids: Sequence[int],
        on_commit: Callable[[list[int]], None] | None,
        record: Record | None = None,  # the generation's so far, where this is a retry's attempt
        connect: ConnectOptions = ConnectOptions(),
    ) -> None:
        if cfg.mode != "none" and drafter is None:
            raise ValueError(f"mode {cfg.mode} needs a draft model")
        self.drafter = drafter
        self.prompt_ids = list(prompt_ids)
        self.cfg = cfg
        self.committed_ids = list(committed_ids)
        self.on_commit = on_commit
        self.request = OpenRequest(
            prompt_ids=tuple(self.prompt_ids),
            max_new_tokens=cfg.max_new_tokens,
            sampling=cfg.sampling,
            stop_ids=cfg.stop_ids,
            verification=cfg.verification,
            draft_mode=MODES[cfg.mode],
            draft_model=draft_model,
            tokenizer_fingerprint=fingerprint,
            committed_ids=tuple(self.committed_ids),
        )
        self.proposer = Proposer(self.request.resolved_mode(), cfg.sampling, cfg.sparse_top_k)
        record = record or Record(GenerationStats(mode=cfg.mode), resumed=len(committed_ids))
        self.stats = record.stats
        self.commit_times = record.commit_times
        self.timeline = record.timeline
        self._t0 = record.t0
        self._record = record
        self.edge: EdgeSession | None = None
        self._changed = asyncio.Event()
        self._verdicts = 0
        self._max_window = cfg.window
        self._k = cfg.k  # sync: drafts per round, within what the server takes
        self._server_lookahead = cfg.window  # how far past its committed point the server takes drafts
        # (position, token) -> the drafter's view of that draft (a branch's drafts sit beside the main line's)
        self._choices: dict[tuple[int, int], DraftChoice] = {}
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="drafter")
        self._connect = connect
        self._stream: GenerateStream | None = None
        self._target_vocab: int | None = None  # ids a draft may hold (Opened; None: the server did not say)
        self._drafting_stopped = False  # the target committed a token the draft cannot read (_check_readable)

    def _send(self, msg) -> None:  # type: ignore[no-untyped-def]
        assert self._stream is not None
        self.stats.bytes_up += msg.ByteSize() + GRPC_FRAME_BYTES
        self._stream.send(msg)

    async def _read_one(self, call, prefill: bool = False):  # type: ignore[no-untyped-def]
        """The server's next message; `prefill`: one that may wait on the prompt's prefill."""
        limit = self._connect.stall_timeout_s
        if limit is not None and prefill:
            limit += PREFILL_ALLOWANCE_S * (len(self.prompt_ids) + len(self.committed_ids))
        try:
            msg = await within(call.read(), limit)
        except asyncio.TimeoutError:
            call.cancel()
            raise StreamStalled(f"no message from the server for {limit:g} s") from None
        except asyncio.CancelledError:
            # gRPC ends a read of a call cancelled on this side (the stream aborted, the
            # channel closed) with CancelledError: as a task's cancellation, the generation
            # waited for good for a Done that could no longer come.
            if call.cancelled() and not being_cancelled():
                raise CallCancelled("the call was cancelled on this side (the stream aborted, or its channel "
                                    "closed) before the generation's Done") from None
            raise
        if msg is grpc.aio.EOF:
            raise StreamEnded("the server ended the stream before Done")
        self.stats.bytes_down += msg.ByteSize() + GRPC_FRAME_BYTES
        return codec.server_from_pb(msg)

    def _lookahead(self) -> int:
        if not self.cfg.adaptive_window:
            return self._max_window
        return adaptive_window(self.stats.drafts_accepted, self.stats.rejections, self._max_window)

    def _now(self) -> float:
        return time.perf_counter() - self._t0

    def _mark(self, *event) -> None:  # type: ignore[no-untyped-def]
        if self.cfg.timeline:
            self.timeline.append(event)

    async def run(self, stream: GenerateStream) -> GenerationResult:
        """Generate on `stream`'s call (begun here if it has none), leaving it open for the
        next generation; after a failure the call is cancelled."""
        t0 = self._t0
        self._stream = stream
        drafting = reading = None
        try:
            opened = await self._open(stream)
            if self.stats.opened_s is None:  # an earlier attempt's Opened was the first
                self.stats.opened_s = time.perf_counter() - t0
            self._max_window = min(self.cfg.window, opened.max_lookahead)
            self._target_vocab = opened.vocab_size or None
            self._server_lookahead = opened.max_lookahead
            if self.cfg.mode == "sync":
                self._k = min(self.cfg.k, opened.max_lookahead, MAX_CHUNK)
                if self._k < self.cfg.k and not self._record.warned_k:  # once a generation, not each attempt
                    self._record.warned_k = True
                    log.warning("sync: k %d is past what the server takes at once; drafting %d per round",
                                self.cfg.k, self._k)
            window = self._k if self.cfg.mode == "sync" else self._lookahead()
            # Sync drafts its k each round even at the end: the server verifies once drafts come.
            last = draft_end_for(len(self.prompt_ids), self.cfg.max_new_tokens, opened.max_context)
            end = None if self.cfg.mode == "sync" else last
            ends = (*self.cfg.stop_ids, *(self.drafter.eos_ids if isinstance(self.drafter, EndAware) else ()))
            self.edge = EdgeSession(self.prompt_ids, window, self.committed_ids, end, ends, commit_end=last + 1)
            drafting = None if self.cfg.mode == "none" else asyncio.create_task(self._draft_loop())
            reading = asyncio.create_task(self._read_loop(stream.call, t0))
            # A prompt's (an earlier answer in a conversation) and a resumed generation's
            # committed ids, before the first draft.
            self._check_readable(self.prompt_ids, "the prompt holds")
            self._check_readable(self.committed_ids)
            if drafting is not None:
                # A drafter that fails ends the generation at once, with its own error: the
                # server would wait for drafts that never come (sync) or finish alone (async).
                await asyncio.wait((reading, drafting), return_when=asyncio.FIRST_EXCEPTION)
                if drafting.done() and (failure := drafting.exception()) is not None:
                    raise failure
            await reading
            if drafting is not None:
                await drafting  # Done arrived: the drafting loop sees it and stops
        except BaseException:
            running = [task for task in (reading, drafting) if task is not None]
            for task in running:
                task.cancel()
            await asyncio.gather(*running, return_exceptions=True)
            stream.abort()
            raise
        finally:
            # A cancelled drafting loop can leave a step running in the pool's thread. Wait for
            # it: a retry, or the next generation of a long-lived client, reuses the drafter,
            # whose caches must never be stepped from two threads at once.
            await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown)
            if self.edge is not None:
                self.stats.add_drafting(self.edge)
        assert self.edge is not None
        self.stats.finish(len(self.edge.generated) - self._record.resumed, time.perf_counter() - t0, self.commit_times)
        return GenerationResult(self.edge.generated, self.stats, opened, self.commit_times, self.timeline)

    async def _open(self, stream: GenerateStream) -> Opened:
        """Send the Open and read the Opened. A kept call that ended while it idled with OK
        (the server's idle timeout or limit) or another status is replaced by a new one on
        the same server at once. Not one that failed with UNAVAILABLE or RESOURCE_EXHAUSTED
        (the server draining, full, shut down or gone): that may be the answer to the Open,
        which a new call there would only get again, so the generation's retry (generate)
        decides, after its backoff or the pushback, on the stream's next server. A failure
        that was the answer to the Open comes again on the new call and is raised."""
        fresh = stream.begin(self._connect.metadata)
        while True:
            self._send(codec.open_to_pb(self.request))
            try:
                event = await self._read_one(stream.call)
            except (StreamEnded, grpc.aio.AioRpcError) as exc:
                if fresh or (isinstance(exc, grpc.aio.AioRpcError) and exc.code() in SERVER_REFUSALS):
                    raise
                stream.abort()
                fresh = stream.begin(self._connect.metadata)
                continue
            if not isinstance(event, Opened):
                raise errors.NotOpenedFirst(f"the server's first message was {type(event).__name__}, not Opened")
            return event

    async def _read_loop(self, call, t0: float) -> None:  # type: ignore[no-untyped-def]
        edge = self.edge
        assert edge is not None
        while True:
            event = await self._read_one(call, prefill=not self._verdicts)
            now = time.perf_counter() - t0
            if isinstance(event, Verdict):
                edge.apply_verdict(event)
                self._verdicts += 1
                self._check_readable(event.tokens)
                if self._choices:  # the drafter's views of committed positions serve no branch
                    self._choices = {k: c for k, c in self._choices.items() if k[0] >= edge.committed_len}
                self.stats.add_verdict(event, now)
                if self.cfg.mode == "async":
                    edge.window = self._lookahead()
                self.commit_times.extend([now] * len(event.tokens))
                self._mark("verdict", now, event.start, len(event.tokens), event.accepted, event.verify_ms, event.proposed,
                           event.rejected)
                if self.on_commit is not None:
                    try:
                        self.on_commit(edge.generated)
                    except Exception as exc:
                        raise OnCommitFailed(f"on_commit raised {exc!r}") from exc
            elif isinstance(event, Done):
                edge.apply_done(event)
                self.stats.done_reason = event.reason.name.lower()
                self.stats.target_busy_s += event.target_busy_s
                self._changed.set()
                return
            else:  # it was ignored, and the session went on as if the server kept to the protocol
                raise errors.ServerBrokeProtocol(f"the server sent a second {type(event).__name__} in one session")
            self._changed.set()

    async def _wait_change(self) -> None:
        self._changed.clear()
        await self._changed.wait()

    async def _draft_loop(self) -> None:
        edge, drafter = self.edge, self.drafter
        assert edge is not None and drafter is not None
        loop = asyncio.get_running_loop()
        sync = self.cfg.mode == "sync"
        greedy = self.proposer.mode is VerificationMode.GREEDY
        pick = drafter.next_token if greedy and isinstance(drafter, TokenPicker) else None
        # A branch needs the drafter's runner-up, so token pickers draft none unless they offer
        # them themselves.
        branching = (
            not sync and pick is None and self.cfg.branch_tokens > 0 and self.cfg.branches > 0
            and greedy
        )
        beside = (
            drafter.branch_beside if not sync and pick is not None and self.cfg.branch_tokens > 0
            and self.cfg.branches > 0 and isinstance(drafter, BranchOffering) else None
        )
        batched = isinstance(drafter, BatchDrafter)
        awaiting: int | None = None  # sync: verdict count when the last round was sent
        while edge.done is None:
            if self._drafting_stopped:
                await self._wait_change()
                continue
            if sync and awaiting is not None:
                if self._verdicts == awaiting:
                    await self._wait_change()
                    continue
                awaiting = None
            # Drafts go out as soon as they are held, before anything waits: this also sends
            # drafts a verdict left unsent (past a branch the server holds less of, or a
            # resend), which would otherwise wait for room, and at the draft end for good.
            # (A sync round is k drafts, fewer where one ends the generation: room() is 0 then.)
            if (not sync or edge.room() <= 0) and self._send_drafts(beside) and sync:
                awaiting = self._verdicts
                continue
            if branching:
                self._open_branches()
            due = [b for b in edge.branches if self._branch_due(b)] if branching else []
            if due and (edge.room() <= 0 or not batched):
                await self._extend_branch(due[0])
                continue
            if edge.room() <= 0:
                await self._wait_change()
                continue
            if pick is not None:
                # A drafter that picks tokens without a model drafts inline: it fills the
                # room at once, and what it drafted goes out as one chunk.
                started = self._now()
                while edge.room() > 0:  # (a sync edge's window is its k)
                    edge.push_draft(pick(edge.tokens))
                self._mark("draft", started, self._now(), len(edge.tokens))
            else:
                trajectory = list(edge.tokens)
                tip = edge.tip
                started = self._now()
                if due:
                    # The line and its branches grow in one batched step (drafter.next_logits_batch).
                    logits, *aside = await loop.run_in_executor(self._pool, drafter.next_logits_batch, [
                        trajectory, *([*trajectory[:start], *tokens] for start, tokens in due)])
                    for branch, branch_logits in zip(due, aside):
                        self._grow_branch(branch, branch_logits)
                else:
                    logits = await loop.run_in_executor(self._pool, drafter.next_logits, trajectory)
                self._mark("draft", started, self._now(), len(trajectory))
                if edge.done is not None or edge.tip != tip:
                    continue  # a verdict changed the trajectory meanwhile: draft again from it
                logits = self._target_ids(logits)
                token, dist = self.proposer.propose(logits, len(trajectory))
                if branching:
                    self._choices[len(trajectory), token] = draft_choice(logits)
                edge.push_draft(token, dist)

    def _send_drafts(self, beside: Callable[[int, int, int], tuple[int, ...] | None] | None) -> bool:
        """Send the drafts not yet sent, a chunk at a time (more than a chunk's worth only
        where a server's lookahead is past it); returns whether any went."""
        edge = self.edge
        assert edge is not None
        sent = False
        while (chunk := edge.next_chunk(MAX_CHUNK)) is not None:
            sent = True
            self._mark("send", self._now(), chunk.start, len(chunk.tokens))
            self._send(codec.draft_to_pb(chunk))
            if beside is not None and edge.branch is None:
                self._offer_branch(beside, chunk.start, chunk.tokens)
        return sent

    def _target_ids(self, logits: np.ndarray) -> np.ndarray:
        """The draft's logits over the ids the target has: a draft with more vocabulary rows
        than the target would otherwise now and then draft an id past them, which the server
        refuses (INVALID_ARGUMENT), ending the generation."""
        if self._target_vocab is None or logits.shape[-1] <= self._target_vocab:
            return logits
        return logits[: self._target_vocab]

    def _check_readable(self, tokens: Sequence[int], where: str = "the target committed") -> None:
        """Stop drafting for the rest of the generation once the target has committed a token
        the draft cannot read (a target with more vocabulary rows than the draft; trained
        models never pick those rows, random weights do): nothing can be drafted after it.
        The call is half-closed, so the server decodes the rest alone, in every mode (a sync
        session's server otherwise waits for drafts): nothing is lost."""
        readable = self.drafter.vocab_size if isinstance(self.drafter, VocabSized) else None
        if readable is None or self._drafting_stopped or self.cfg.mode == "none":
            return
        past = next((t for t in tokens if t >= readable), None)
        if past is None:
            return
        self._drafting_stopped = True
        log.warning("%s token id %d, past the draft's %d ids: the server decodes the rest of "
                    "this generation alone", where, past, readable)
        assert self._stream is not None
        self._stream.finish_writing()

    def _offer_branch(self, beside: Callable[[int, int, int], tuple[int, ...] | None], start: int,
                      tokens: Sequence[int]) -> None:
        """Send the branch a token-picking drafter offers beside the earliest wrong draft of
        a chunk, if it offers one there: one branch at a time, as a drafting edge keeps."""
        edge = self.edge
        assert edge is not None
        for position, token in enumerate(tokens, start):
            branch = beside(position, token, self._branch_room(position))
            if branch is not None:
                if branch:
                    self._mark("send-branch", self._now(), position, len(branch))
                    self._send(codec.draft_to_pb(edge.branch_chunk(position, branch)))
                return

    def _branch_point(self) -> int | None:
        """Where to branch now, among the sent drafts whose drafter view is known and that
        have no branch yet (branching.py)."""
        edge = self.edge
        assert edge is not None
        start = edge.committed_len
        choices: list[DraftChoice] = []
        for position in range(start, edge.sent_len):
            choice = self._choices.get((position, edge.tokens[position]))
            if choice is None:
                break
            choices.append(choice)
        index = choose_branch(choices, taken=[p - start for p, _ in edge.branches])
        return None if index is None else start + index

    def _open_branches(self) -> None:
        """Start branches at the branch points, while fewer than --branches are open, each
        with the runner-up there (which costs no drafting step), and send them."""
        edge = self.edge
        assert edge is not None
        while len(edge.branches) < self.cfg.branches:
            start = self._branch_point()
            if start is None:
                return
            runner_up = self._choices[start, edge.tokens[start]].runner_up
            self._mark("send-branch", self._now(), start, 1)
            self._send(codec.draft_to_pb(edge.branch_chunk(start, (runner_up,))))

    def _branch_room(self, start: int) -> int:
        """The longest a branch from `start` may be: --branch-tokens, not past the server's
        lookahead limit or the draft end, and one chunk (a branch goes out whole each time it
        grows)."""
        edge = self.edge
        assert edge is not None
        end = edge.committed_len + self._server_lookahead
        if edge.draft_end is not None:
            end = min(end, edge.draft_end)
        return min(self.cfg.branch_tokens, end - start, MAX_CHUNK)

    def _branch_due(self, branch: tuple[int, tuple[int, ...]]) -> bool:
        """Whether the next drafting step should grow `branch`: while it is shorter than the
        main line past its start (then they grow in one batched step), or whenever the window
        leaves the main line no room."""
        edge = self.edge
        assert edge is not None
        start, tokens = branch
        if tokens[-1] in edge.end_ids:
            return False  # nothing drafted past an end token could be used
        return len(tokens) < self._branch_room(start) and (len(tokens) < len(edge.tokens) - start or edge.room() <= 0)

    async def _extend_branch(self, branch: tuple[int, tuple[int, ...]]) -> None:
        """Draft one more token of a branch alone."""
        edge, drafter = self.edge, self.drafter
        assert edge is not None and drafter is not None
        trajectory = [*edge.tokens[: branch[0]], *branch[1]]
        started = self._now()
        logits = await asyncio.get_running_loop().run_in_executor(self._pool, drafter.next_logits, trajectory)
        self._mark("branch", started, self._now(), len(trajectory))
        self._grow_branch(branch, logits)

    def _grow_branch(self, branch: tuple[int, tuple[int, ...]], logits: np.ndarray) -> None:
        """Add the drafter's choice after `branch` to it and send it again (the server keeps the
        longest), unless a verdict settled the branch while the drafter ran."""
        edge = self.edge
        assert edge is not None
        start, tokens = branch
        if edge.done is not None or branch not in edge.branches:
            return
        choice = draft_choice(self._target_ids(logits))
        self._choices[start + len(tokens), choice.token] = choice
        self._mark("send-branch", self._now(), start, len(tokens) + 1)
        self._send(codec.draft_to_pb(edge.branch_chunk(start, [*tokens, choice.token])))
