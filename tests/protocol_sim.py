"""Fake deterministic models and a simulated network for the protocol-core tests."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import numpy as np

from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.hashing import HashedSequence, mix
from specsplit.protocol.messages import Done, DraftChunk, OpenRequest, ServerLimits, Verdict
from specsplit.protocol.server_session import ServerConnection, ServerSession, VerifyTask

VOCAB = 11
EOS = 0


def target_next(tokens: list[int]) -> int:
    """The fake target's greedy choice: a fixed function of the last tokens and length."""
    h = mix(mix(len(tokens), tokens[-1]), tokens[-2] if len(tokens) > 1 else 0)
    return int(h % VOCAB)


def target_logits(tokens: list[int], start: int, drafts: tuple[int, ...]) -> np.ndarray:
    """Logit rows for positions start..start+len(drafts): one-hot-ish at the target's choice."""
    rows = np.zeros((len(drafts) + 1, VOCAB), dtype=np.float32)
    prefix = list(tokens[:start])
    for j in range(len(drafts) + 1):
        rows[j, target_next(prefix)] = 5.0
        if j < len(drafts):
            prefix.append(drafts[j])
    return rows


def task_logits(session: ServerSession, task: VerifyTask) -> tuple[np.ndarray, list[np.ndarray]]:
    """The fake target's rows for a task: its drafts', and per branch those after each of
    the branch's tokens."""
    rows = target_logits(session.tokens, task.start, task.drafts)
    aside = []
    for branch in task.branches:
        fork = (*task.drafts[: branch.at - task.start], *branch.tokens)
        aside.append(target_logits(session.tokens, task.start, fork)[len(fork) - len(branch.tokens) + 1 :])
    return rows, aside


def draft_next(tokens: list[int], alpha: float, salt: int) -> int:
    """Right (the target's choice) with probability about alpha, else a wrong token."""
    h = 0
    for t in tokens[-4:]:
        h = mix(h, t)
    coin = mix(h, salt + len(tokens)) / 2**64
    right = target_next(tokens)
    return right if coin < alpha else (right + 1 + int(coin * 1000) % (VOCAB - 1)) % VOCAB


def reference(prompt: list[int], max_new: int, max_context: int) -> list[int]:
    """What the target alone produces greedily."""
    seq = list(prompt)
    out: list[int] = []
    while True:
        t = target_next(seq)
        seq.append(t)
        out.append(t)
        if t == EOS or len(out) >= max_new or len(seq) >= max_context:
            return out


@dataclass
class Network:
    """Edge and server joined by two in-order queues; a test chooses the interleaving."""

    prompt: list[int]
    max_new: int
    window: int
    alpha: float
    salt: int
    max_context: int = 64
    edge: EdgeSession = field(init=False)
    server: ServerConnection = field(init=False)
    up: deque = field(default_factory=deque)
    down: deque = field(default_factory=deque)
    reconnects: int = 0
    edge_prefixes: set = field(default_factory=set)  # hashes of every trajectory prefix the edge held

    def __post_init__(self) -> None:
        self.limits = ServerLimits(
            vocab_size=VOCAB, max_context=self.max_context, max_lookahead=self.window + 2, eos_ids=(EOS,)
        )
        self.edge = EdgeSession(self.prompt, self.window)
        self._open()

    def _open(self) -> None:
        self.server = ServerConnection(self.limits, f"s{self.reconnects}")
        req = OpenRequest(
            prompt_ids=tuple(self.prompt),
            max_new_tokens=self.max_new,
            committed_ids=tuple(self.edge.generated),
        )
        self.up.append(req)

    @property
    def session(self) -> ServerSession | None:
        return self.server.session

    def check_candidates_came_from_the_edge(self) -> None:
        """The server's trajectory past its committed point is one the edge really drafted."""
        self.edge_prefixes.update(self.edge._line.hashes)
        s = self.session
        assert s is None or s.candidate_count == len(s.candidates)
        if s is not None and s.candidate_tip > s.committed_len:
            assert s._line.hashes[-1] in self.edge_prefixes, "the server admitted a trajectory the edge never held"

    # -- actions ---------------------------------------------------------------

    def draft(self) -> None:
        if self.edge.room() > 0:
            self.edge.push_draft(draft_next(self.edge.tokens, self.alpha, self.salt))

    def branch(self, offset: int, length: int, right: bool, another: bool = False) -> None:
        """Send a branch (at most two open, as the client drafts them): if `right`, beside the
        first draft the target will reject, from the target's choice there (a branch the
        server can verify with that draft); else beside the draft `offset` past the committed
        point, from a token the target may not want. With a branch open, send the earliest
        longer, unless `another` opens a second one."""
        tokens = self.edge.tokens
        branches = self.edge.branches
        if branches and not (another and len(branches) < 2):
            start, branch = branches[0][0], list(branches[0][1])
        else:
            start = self.edge.committed_len + offset
            if right:
                start = self.edge.committed_len
                while start < len(tokens) and tokens[start] == target_next(tokens[:start]):
                    start += 1
            if start >= self.edge.sent_len or any(start == at for at, _ in branches):
                return
            first = target_next(tokens[:start]) if right else (tokens[start] + 1 + offset) % VOCAB
            if first == tokens[start]:
                return
            branch = [first]
        prefix = tokens[:start]
        limit = self.edge.committed_len + self.limits.max_lookahead
        grown = len(branch) + length - 1
        while len(branch) < grown and start + len(branch) < limit:
            branch.append(draft_next([*prefix, *branch], self.alpha, self.salt))
        self.up.append(self.edge.branch_chunk(start, branch))
        self.edge_prefixes.update(HashedSequence([*prefix, *branch]).hashes)

    def send(self, max_tokens: int) -> None:
        chunk = self.edge.next_chunk(max_tokens)
        if chunk is not None:
            self.up.append(chunk)

    def deliver_up(self) -> None:
        if self.up:
            self.down.extend(self.server.receive(self.up.popleft()))

    def deliver_down(self) -> None:
        while self.down:
            msg = self.down.popleft()
            if isinstance(msg, Verdict):
                self.edge.apply_verdict(msg)
                return
            if isinstance(msg, Done):
                self.edge.apply_done(msg)
                return

    def verify(self, budget: int) -> None:
        s = self.session
        if s is None or s.done is not None:
            return
        task = s.next_task(budget)
        assert task is not None
        before = s.rejections
        events = s.apply(task, *task_logits(s, task))
        verdict = events[0]
        assert isinstance(verdict, Verdict)
        # A rejection where fewer drafts were taken than looked at, one more where a branch
        # the verdict followed had its own; each counted in the session's total.
        followed = s.branch_verified is not None
        assert int(verdict.accepted < verdict.proposed) <= verdict.rejected <= 1 + followed
        assert s.rejections - before == verdict.rejected
        self.down.extend(events)

    def next_generation(self, prompt: list[int], max_new: int, stale: int) -> None:
        """The edge's next generation on the same stream, once the last is Done: `stale`
        drafts of the last one still in flight ahead of the new Open."""
        old = self.edge
        if stale:
            self.up.append(DraftChunk(old.committed_len, tuple(range(1, stale + 1)), old._line.hash_before(old.committed_len)))
        self.prompt, self.max_new = list(prompt), max_new
        self.edge = EdgeSession(self.prompt, self.window)
        self.up.append(OpenRequest(prompt_ids=tuple(self.prompt), max_new_tokens=self.max_new))

    def reconnect(self) -> None:
        """The stream breaks: everything in flight is lost; the edge re-opens."""
        self.up.clear()
        self.down.clear()
        self.reconnects += 1
        self.edge.reconnect()
        self._open()

    def finish(self, max_steps: int = 10_000) -> None:
        """A fair schedule that must end the generation."""
        for _ in range(max_steps):
            if self.edge.done is not None:
                return
            self.draft()
            self.send(4)
            while self.up:
                self.deliver_up()
            self.verify(4)
            while self.down and self.edge.done is None:
                self.deliver_down()
        raise AssertionError("generation did not finish")
