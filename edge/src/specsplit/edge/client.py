"""The edge's gRPC client: drafts continuously and streams candidates to the server.

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
import contextlib
import logging
import math
import numbers
import operator
import random
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import grpc
import numpy as np

from specsplit.common.aio import within
from specsplit.common.tls import handshake_failed
from specsplit.edge.branching import DraftChoice, choose_branch, draft_choice
from specsplit.edge.drafter import BRANCHES as MAX_BRANCHES, BatchDrafter, BranchOffering, Drafter, TokenPicker
from specsplit.edge.lookahead import adaptive_window
from specsplit.edge.proposer import Proposer
from specsplit.edge.stats import GenerationStats
from specsplit.edge.stream import GenerateStream
from specsplit.protocol import codec, errors
from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.messages import (
    MAX_CHUNK,
    MAX_DIST_IDS,
    MAX_STOP_IDS,
    Done,
    DraftMode,
    Opened,
    OpenRequest,
    SamplingParams,
    Verdict,
    VerificationMode,
)

log = logging.getLogger(__name__)

MODES = {"async": DraftMode.ASYNC, "sync": DraftMode.SYNC, "none": DraftMode.NONE}
GRPC_FRAME_BYTES = 5  # length prefix of every gRPC message
# Statuses after which the same generation is re-opened (here or on the next server); any
# other status, only when the server says when to try again (a full server: retry_delay).
# INTERNAL too: gRPC's Python client reports a call that its server ends while the client is
# still writing (a draining server's last streams, now and then) as INTERNAL, not as the
# status the server sent; and a re-opened generation loses nothing, so retrying is safe. A
# server's own INTERNAL (its target failed the session's verification: errors.VERIFICATION_FAILED)
# is not retried: it would most likely fail again, after every backoff.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
# What a server answers an Open with when it takes no session at all (draining, full): the
# same server will answer a new call alike, so a kept call that fails so moves on (_open).
SERVER_REFUSALS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


class StreamEnded(ConnectionError):
    """The server ended the call before the session's Done."""


class OnCommitFailed(Exception):
    """The caller's on_commit raised (its exception is the cause): the caller's own failure
    (a closed stdout, say), which ends the generation and is never retried, though it may be
    an OSError as a lost connection is."""


class StreamStalled(Exception):
    """Nothing came from the server for longer than the stall timeout: to the caller, the
    server is as UNAVAILABLE as one that refuses connections."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


class ConfigError(ValueError):
    """A setting no generation can run with; `field` names it (`EdgeConfig`, `ConnectOptions`;
    a sampling setting as `sampling.top_p`, say)."""

    def __init__(self, field_name: str, problem: str) -> None:
        super().__init__(f"{field_name} {problem}")
        self.field = field_name
        self.problem = problem


def _whole(value: object) -> bool:
    """An int or numpy integer, not a bool (which Python counts as one)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


# EdgeConfig's whole-number settings and their least values.
_AT_LEAST = {"window": 1, "k": 1, "branch_tokens": 0, "max_new_tokens": 1, "sparse_top_k": 1}


@dataclass(frozen=True)
class ConnectOptions:
    credentials: grpc.ChannelCredentials | None = None  # TLS (and mutual TLS) when set
    # The name the server's certificate must hold, where the address dialled is another (an IP address)
    tls_server_name: str | None = None
    token: str | None = None  # bearer token sent as `authorization` metadata
    stall_timeout_s: float | None = 60.0  # no message for this long: the stream is treated as dead
    retries: int = 5  # re-opens after a lost server or stream, cycling through the addresses given
    backoff_s: float = 0.5  # doubled after each failed attempt, up to 8 s

    def __post_init__(self) -> None:
        # gRPC metadata carries printable ASCII only; any other token fails every call with
        # INTERNAL, which would be retried as if the server were lost.
        if self.token is not None and not (self.token and self.token.isascii() and self.token.isprintable()):
            raise ConfigError("token", "must be printable ASCII, without line ends")
        if not _whole(self.retries) or self.retries < 0:
            raise ConfigError("retries", f"must be a whole number, 0 or more, got {self.retries!r}")
        if self.stall_timeout_s is not None and (not _real(self.stall_timeout_s)
                                                 or not 0 < self.stall_timeout_s < math.inf):
            raise ConfigError("stall_timeout_s", f"must be above 0, got {self.stall_timeout_s!r}")
        if not _real(self.backoff_s) or not 0 <= self.backoff_s < math.inf:
            raise ConfigError("backoff_s", f"must be 0 or more, got {self.backoff_s!r}")

    def check_servers(self, servers: int) -> None:
        """ConfigError unless the attempts reach every one of `servers` failed over along."""
        if servers > self.retries + 1:
            raise ConfigError("retries", f"{self.retries} leaves no attempt for the last of the {servers} servers "
                              f"(a failover is a retry): give {servers - 1} or more")


@dataclass(frozen=True)
class EdgeConfig:
    mode: str = "async"
    window: int = 32  # async: how far ahead of the committed point to draft (with adaptive_window: at most)
    adaptive_window: bool = True  # async: size the lookahead from the acceptance seen so far (lookahead.py)
    k: int = 4  # sync: drafts per round
    branch_tokens: int = 8  # async, greedy: the longest branch drafted beside the main line (0 or 1: none)
    # async, greedy: how many branches may be open beside the main line at once. Two ran 1.012x
    # and 0.988x one in two side-by-side runs (docs/benchmarks.md): no gain for the edge's extra work.
    branches: int = 1
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    verification: VerificationMode | None = None
    sparse_top_k: int = 8
    stop_ids: tuple[int, ...] = ()
    timeline: bool = False  # record drafting, sends and verdicts with timestamps

    def __post_init__(self) -> None:
        """ConfigError, naming the field, for a value no generation can run with: found here
        rather than by the server, a round trip later, or deep in the encoding."""
        if self.mode not in MODES:
            raise ConfigError("mode", f"must be one of {sorted(MODES)}, got {self.mode!r}")
        for name, least in _AT_LEAST.items():
            value = getattr(self, name)
            if not _whole(value) or value < least:
                raise ConfigError(name, f"must be a whole number of at least {least}, got {value!r}")
        if self.max_new_tokens >= 2**32:  # the protocol's uint32
            raise ConfigError("max_new_tokens", f"must be below 2**32, got {self.max_new_tokens}")
        if not _whole(self.branches) or not 0 <= self.branches <= MAX_BRANCHES:
            raise ConfigError("branches", f"must be 0 (none) to {MAX_BRANCHES}, the branches the drafter keeps "
                              f"caches for, got {self.branches!r}")
        try:
            token_ids(self.stop_ids, "stop_ids")
        except ValueError as exc:
            raise ConfigError("stop_ids", str(exc).removeprefix("stop_ids ")) from None
        if len(self.stop_ids) > MAX_STOP_IDS:
            raise ConfigError("stop_ids", f"may hold at most {MAX_STOP_IDS} ids, got {len(self.stop_ids)}")
        if self.sparse_top_k > MAX_DIST_IDS:
            raise ConfigError("sparse_top_k", f"must be at most {MAX_DIST_IDS}, got {self.sparse_top_k}")
        if not isinstance(self.sampling, SamplingParams):
            raise ConfigError("sampling", f"must be a SamplingParams, got {self.sampling!r}")
        if problem := self.sampling.problem():  # the server's own rules
            raise ConfigError(f"sampling.{problem[0]}", problem[1])
        if self.verification is not None and not isinstance(self.verification, VerificationMode):
            raise ConfigError("verification", f"must be a VerificationMode or None, got {self.verification!r}")
        if self.verification is not None and (self.verification is VerificationMode.GREEDY) != self.sampling.greedy:
            name = self.verification.name.lower().replace("_", "-")
            raise ConfigError("verification", "greedy is for temperature 0; sampled output takes match or sparse-q"
                              if self.verification is VerificationMode.GREEDY
                              else f"{name} verifies sampled output: give a temperature above 0")


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
class _Record:
    """What a generation measures, kept over its attempts: after a retry, its times still count
    from the first attempt's start and its counts go on from the attempts before."""

    stats: GenerationStats
    resumed: int = 0  # the caller's committed_ids: generated before this call, not by it
    warned_k: bool = False  # that sync's k is past what the server takes
    t0: float = field(default_factory=time.perf_counter)
    commit_times: list[float] = field(default_factory=list)
    timeline: list[tuple] = field(default_factory=list)


class _Generation:
    def __init__(
        self,
        drafter: Drafter | None,
        prompt_ids: Sequence[int],
        cfg: EdgeConfig,
        fingerprint: str,
        draft_model: str,
        committed_ids: Sequence[int],
        on_commit: Callable[[list[int]], None] | None,
        record: _Record | None = None,  # the generation's so far, where this is a retry's attempt
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
        record = record or _Record(GenerationStats(mode=cfg.mode), resumed=len(committed_ids))
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
        self.stall_timeout_s: float | None = None
        self.metadata: tuple[tuple[str, str], ...] = ()
        self._stream: GenerateStream | None = None

    def _send(self, msg) -> None:  # type: ignore[no-untyped-def]
        assert self._stream is not None
        self.stats.bytes_up += msg.ByteSize() + GRPC_FRAME_BYTES
        self._stream.send(msg)

    async def _read_one(self, call):  # type: ignore[no-untyped-def]
        try:
            msg = await within(call.read(), self.stall_timeout_s)
        except asyncio.TimeoutError:
            call.cancel()
            raise StreamStalled(f"no message from the server for {self.stall_timeout_s} s") from None
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
            self._server_lookahead = opened.max_lookahead
            if self.cfg.mode == "sync":
                self._k = min(self.cfg.k, opened.max_lookahead, MAX_CHUNK)
                if self._k < self.cfg.k and not self._record.warned_k:  # once a generation, not each attempt
                    self._record.warned_k = True
                    log.warning("sync: k %d is past what the server takes at once; drafting %d per round",
                                self.cfg.k, self._k)
            window = self._k if self.cfg.mode == "sync" else self._lookahead()
            self.edge = EdgeSession(self.prompt_ids, window, self.committed_ids)
            drafting = None if self.cfg.mode == "none" else asyncio.create_task(self._draft_loop())
            reading = asyncio.create_task(self._read_loop(stream.call, t0))
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
        fresh = stream.begin(self.metadata)
        while True:
            self._send(codec.open_to_pb(self.request))
            try:
                event = await self._read_one(stream.call)
            except (StreamEnded, grpc.aio.AioRpcError) as exc:
                if fresh or (isinstance(exc, grpc.aio.AioRpcError) and exc.code() in SERVER_REFUSALS):
                    raise
                stream.abort()
                fresh = stream.begin(self.metadata)
                continue
            if not isinstance(event, Opened):
                raise ConnectionError(f"expected Opened first, got {type(event).__name__}")
            return event

    async def _read_loop(self, call, t0: float) -> None:  # type: ignore[no-untyped-def]
        edge = self.edge
        assert edge is not None
        while True:
            event = await self._read_one(call)
            now = time.perf_counter() - t0
            if isinstance(event, Verdict):
                edge.apply_verdict(event)
                self._verdicts += 1
                if self._choices:  # the drafter's views of committed positions serve no branch
                    self._choices = {k: c for k, c in self._choices.items() if k[0] >= edge.committed_len}
                self.stats.add_verdict(event, now)
                if self.cfg.mode == "async":
                    edge.window = self._lookahead()
                self.commit_times.extend([now] * len(event.tokens))
                self._mark("verdict", now, event.start, len(event.tokens), event.accepted, event.verify_ms, event.proposed)
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
            and isinstance(drafter, BranchOffering) else None
        )
        batched = isinstance(drafter, BatchDrafter)
        awaiting: int | None = None  # sync: verdict count when the last round was sent
        while edge.done is None:
            if sync and awaiting is not None:
                if self._verdicts == awaiting:
                    await self._wait_change()
                    continue
                awaiting = None
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
                for _ in range(min(edge.room(), self._k - edge.speculative) if sync else edge.room()):
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
                token, dist = self.proposer.propose(logits, len(trajectory))
                if branching:
                    self._choices[len(trajectory), token] = draft_choice(logits)
                edge.push_draft(token, dist)
            if sync and edge.speculative < self._k:
                continue
            # (More than a chunk's worth unsent only where a server's lookahead is past it.)
            while (chunk := edge.next_chunk(MAX_CHUNK)) is not None:
                if sync:
                    awaiting = self._verdicts
                self._mark("send", self._now(), chunk.start, len(chunk.tokens))
                self._send(codec.draft_to_pb(chunk))
                if beside is not None and edge.branch is None:
                    self._offer_branch(beside, chunk.start, chunk.tokens)

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
        lookahead limit, and one chunk (a branch goes out whole each time it grows)."""
        edge = self.edge
        assert edge is not None
        return min(self.cfg.branch_tokens, edge.committed_len + self._server_lookahead - start, MAX_CHUNK)

    def _branch_due(self, branch: tuple[int, tuple[int, ...]]) -> bool:
        """Whether the next drafting step should grow `branch`: while it is shorter than the
        main line past its start (then they grow in one batched step), or whenever the window
        leaves the main line no room."""
        edge = self.edge
        assert edge is not None
        start, tokens = branch
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
        choice = draft_choice(logits)
        self._choices[start + len(tokens), choice.token] = choice
        self._mark("send-branch", self._now(), start, len(tokens) + 1)
        self._send(codec.draft_to_pb(edge.branch_chunk(start, [*tokens, choice.token])))


def open_channel(address: str, connect: ConnectOptions) -> grpc.aio.Channel:
    options: list[tuple[str, int | str]] = [("grpc.keepalive_time_ms", 20_000), ("grpc.keepalive_timeout_ms", 10_000)]
    if connect.tls_server_name:
        options.append(("grpc.ssl_target_name_override", connect.tls_server_name))
    if connect.credentials is not None:
        return grpc.aio.secure_channel(address, connect.credentials, options=options)
    return grpc.aio.insecure_channel(address, options=options)


async def generate(
    via: str | Sequence[str] | grpc.aio.Channel | GenerateStream,
    prompt_ids: Sequence[int],
    cfg: EdgeConfig,
    drafter: Drafter | None = None,
    fingerprint: str = "",
    draft_model: str = "",
    committed_ids: Sequence[int] = (),
    on_commit: Callable[[list[int]], None] | None = None,
    connect: ConnectOptions = ConnectOptions(),
) -> GenerationResult:
    """Generate one completion of `prompt_ids` through a server. A lost server or stream
    costs only time: the generation is re-opened with everything committed so far, so the
    final text is the same.

    `via` says where: a server's host:port, or a list to fail over along, each attempt on a
    connection of its own; a channel, every attempt on a call of its own on it; or a device's
    kept GenerateStream (stream.py), which the generation runs on and leaves open for the
    device's next one, a retry going to the stream's next server; a stream carries one
    generation at a time. `committed_ids`: tokens already generated after the prompt (a
    generation resumed elsewhere), which the server takes as committed. `on_commit` gets
    the whole generated list after each verdict. A drafter may be shared by generations
    running at once: correct, but their drafting steps take turns and share its caches, so
    a drafter each is faster.

    Raises ValueError (ConfigError for settings) before any call for what no server would
    take; grpc.aio.AioRpcError with the server's status (refused, or the stream lost and the
    retries spent), StreamStalled (no message for the stall timeout, retries spent; its
    code() is UNAVAILABLE) or ConnectionError (the call ended before Done, retries spent);
    OnCommitFailed where `on_commit` raised; ProtocolError where the server broke the
    protocol; RuntimeError for a stream carrying another generation."""
    if isinstance(via, str):
        via = [via]
    if not isinstance(via, (grpc.aio.Channel, GenerateStream)) and not via:
        raise ValueError("generate needs a server address")
    prompt_ids, committed = token_ids(prompt_ids, "prompt_ids"), token_ids(committed_ids, "committed_ids")
    if not prompt_ids:
        raise ValueError("prompt_ids is empty: a generation needs a prompt")
    for name, value in (("draft_model", draft_model), ("fingerprint", fingerprint)):
        if not isinstance(value, str):
            raise ValueError(f"{name} must be a str, got {value!r}")
    if isinstance(via, Sequence):
        connect.check_servers(len(via))
    # A kept stream is the generation's from its first attempt to its last: another one
    # taking it during a retry's backoff would leave the retry nothing to re-open on.
    backoff = connect.backoff_s
    servers = via.servers if isinstance(via, GenerateStream) else 1 if isinstance(via, grpc.aio.Channel) else len(via)
    record = _Record(GenerationStats(mode=cfg.mode), resumed=len(committed))
    with via.carrying() if isinstance(via, GenerateStream) else contextlib.nullcontext():
        for attempt in range(connect.retries + 1):
            gen = _Generation(drafter, prompt_ids, cfg, fingerprint, draft_model, committed, on_commit, record)
            gen.stall_timeout_s = connect.stall_timeout_s
            gen.metadata = (("authorization", f"Bearer {connect.token}"),) if connect.token else ()
            try:
                if isinstance(via, GenerateStream):
                    result = await gen.run(via)
                elif isinstance(via, grpc.aio.Channel):
                    result = await _on_own_call(gen, via)
                else:
                    async with open_channel(via[attempt % len(via)], connect) as ch:
                        result = await _on_own_call(gen, ch)
                result.stats.reconnects = attempt
                return result
            except (grpc.aio.AioRpcError, StreamStalled, ConnectionError) as exc:
                least = retry_delay(exc, backoff, servers)
                if least is None or attempt == connect.retries:
                    raise
                delay = spread(least)
                if gen.edge is not None:
                    committed = gen.edge.generated  # includes what earlier attempts committed
                if isinstance(via, GenerateStream):
                    via.fail_over()
                # A retry can take seconds (backoff doubles up to 8 s): say so, or a device looks hung.
                log.warning("generation interrupted (%s); re-opening it in %.1f s (retry %d of %d)",
                            _describe(exc), delay, attempt + 1, connect.retries)
                await asyncio.sleep(delay)
                backoff = min(backoff * 2, 8.0)
    raise AssertionError("the retry loop returns or raises")


def token_ids(ids: Sequence[int], name: str) -> list[int]:
    """`ids` as a list of ints (a tokenizer's numpy integers too); ValueError naming `name`
    for anything that is not a token id, found before the protobuf encoding would be."""
    ids = list(ids)  # looked at twice below: an iterator would be spent by the first look
    try:
        out = [operator.index(t) for t in ids]
    except TypeError:
        raise ValueError(f"{name} must be token ids (whole numbers), got {ids!r:.80}") from None
    if any(isinstance(t, bool) for t in ids):
        raise ValueError(f"{name} must be token ids (whole numbers), got a bool")
    if bad := [t for t in out if not 0 <= t < 2**32]:
        raise ValueError(f"{name} must be token ids (0 to 2**32 - 1), got {bad[0]}")
    return out


def _describe(exc: Exception) -> str:
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


# A retry waits up to this many times its least wait, at random (`spread`).
RETRY_SPREAD = 1.5


def spread(least: float) -> float:
    """A retry's wait: `least` and up to half as much again, at random. Edges refused together
    by a full server, or cut off together by a lost one, would otherwise all come back at the
    same instants (the backoff doubles alike for all), each wave finding the server as full."""
    return least * random.uniform(1.0, RETRY_SPREAD)


def retry_delay(exc: Exception, backoff: float, servers: int = 1) -> float | None:
    """The least wait before re-opening after `exc`, or None if a retry would not help: a lost
    stream or server waits the backoff; a refusal that carries the server's pushback (a full
    server) waits at least that long. A failed TLS handshake (a CA that did not sign the
    server's certificate, a name it does not hold, TLS to a plaintext port) fails the same way
    on the same server: it is retried only where there are `servers` to fail over to."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return backoff
    details = exc.details() or ""
    if servers == 1 and handshake_failed(details):
        return None
    if exc.code() == grpc.StatusCode.INTERNAL and details.startswith(errors.VERIFICATION_FAILED):
        return None
    if exc.code() in RETRYABLE:
        return backoff
    pushback = (exc.trailing_metadata() or grpc.aio.Metadata()).get(errors.PUSHBACK_METADATA)
    if pushback is None:
        return None
    try:
        return max(backoff, int(pushback) / 1000)
    except ValueError:  # gRPC: a pushback that does not parse means "do not retry"
        return None


async def _on_own_call(gen: _Generation, channel: grpc.aio.Channel) -> GenerationResult:
    """A generation on a call that ends with it: half-closed after its Done."""
    stream = GenerateStream.on(channel)
    result = await gen.run(stream)
    stream.close()
    return result
