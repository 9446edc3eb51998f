"""Losslessness of the protocol core as the server runs it (hypothesis): a verification's
task is built, drafts and branches keep arriving while the target's pass runs, and only then
is the result applied; greedy and match-sampled, with stop ids, short contexts and
reconnects. The committed text must be the target's own, token for token.

test_protocol_properties.py builds and applies a task in one step, greedy only, far from the
context limit and without stop ids: a context check off by one, or a match draw at the wrong
position, passed it."""
from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.hashing import mix
from specsplit.protocol.messages import Done, OpenRequest, SamplingParams, ServerLimits, Verdict
from specsplit.protocol.sampling import position_rng, process_logits, sample_from
from specsplit.protocol.server_session import ServerConnection, ServerSession, VerifyTask
from specsplit.protocol.trajectory import draft_end_for

VOCAB = 11
EOS = 0


def logits_after(prefix: list[int]) -> np.ndarray:
    """The target: logits that depend on the length and the last two tokens."""
    h = mix(mix(len(prefix), prefix[-1]), prefix[-2] if len(prefix) > 1 else 0)
    return np.random.default_rng(h).normal(size=VOCAB) * 2.0


def target_token(prefix: list[int], params: SamplingParams) -> int:
    """What the target alone commits after `prefix` (the server-only mode's draw)."""
    logits = logits_after(prefix)
    if params.greedy:
        return int(np.argmax(logits))
    return sample_from(process_logits(logits, params), position_rng(params.seed, len(prefix)).random())


def reference(prompt: list[int], max_new: int, context: int, params: SamplingParams, stop: tuple[int, ...]) -> list[int]:
    seq, out = list(prompt), []
    while True:
        token = target_token(seq, params)
        seq.append(token)
        out.append(token)
        if token == EOS or token in stop or len(out) >= max_new or len(seq) >= context:
            return out


def rows(prefix: list[int], drafts: tuple[int, ...] | list[int]) -> np.ndarray:
    """The target's logit rows for a verification of `drafts` after `prefix`."""
    seq, out = list(prefix), []
    for j in range(len(drafts) + 1):
        out.append(logits_after(seq))
        if j < len(drafts):
            seq.append(drafts[j])
    return np.array(out)


@dataclass
class Run:
    prompt: list[int]
    max_new: int
    context: int
    params: SamplingParams
    stop: tuple[int, ...]
    alpha: float
    rnd: random.Random
    window: int
    capped: bool = False  # the edge drafts nothing past the draft end (as the real edge's async mode)
    edge: EdgeSession = field(init=False)
    conn: ServerConnection = field(init=False)
    up: deque = field(default_factory=deque)
    down: deque = field(default_factory=deque)
    # A task whose pass is running: (its session, the task, its rows, its branches' rows)
    running: tuple[ServerSession, VerifyTask, np.ndarray, list[np.ndarray]] | None = None
    reconnects: int = 0

    def __post_init__(self) -> None:
        self.limits = ServerLimits(vocab_size=VOCAB, max_context=self.context, max_lookahead=self.window + 2,
                                   eos_ids=(EOS,))
        end = draft_end_for(len(self.prompt), self.max_new, self.context) if self.capped else None
        self.edge = EdgeSession(self.prompt, self.window, draft_end=end)
        self.open()

    def open(self) -> None:
        self.conn = ServerConnection(self.limits, "s")
        self.running = None
        self.up.append(OpenRequest(tuple(self.prompt), self.max_new, self.params, stop_ids=self.stop,
                                   committed_ids=tuple(self.edge.generated)))

    def draft_after(self, prefix: list[int]) -> int:
        return target_token(prefix, self.params) if self.rnd.random() < self.alpha else self.rnd.randrange(VOCAB)

    def step(self, action: float, free: bool) -> None:
        edge, rnd = self.edge, self.rnd
        if action < 0.25:
            if edge.room() > 0:
                edge.push_draft(self.draft_after(edge.tokens))
        elif action < 0.35:
            if chunk := edge.next_chunk(rnd.randint(1, 5)):
                assert edge.draft_end is None or chunk.start + len(chunk.tokens) <= edge.draft_end
                self.up.append(chunk)
        elif action < 0.40:
            if free and edge.sent_len > edge.committed_len and not edge.branches:
                self.branch(rnd.randrange(edge.committed_len, edge.sent_len))
        elif action < 0.55:
            if self.up:
                self.down.extend(self.conn.receive(self.up.popleft()))
        elif action < 0.70:
            while self.down:
                message = self.down.popleft()
                if isinstance(message, Verdict):
                    edge.apply_verdict(message)
                    break
                if isinstance(message, Done):
                    edge.apply_done(message)
                    break
        elif action < 0.80:
            self.start_pass(rnd.randint(0, 6))
        elif action < 0.92:
            self.end_pass()
        elif free and self.reconnects < 3:
            self.reconnects += 1
            self.up.clear()
            self.down.clear()
            edge.reconnect()
            self.open()

    def branch(self, start: int) -> None:
        """A branch beside a sent draft: the target's token there, or any other."""
        tokens = self.edge.tokens[:start]
        first = target_token(tokens, self.params) if self.rnd.random() < 0.6 else self.rnd.randrange(VOCAB)
        if first == self.edge.tokens[start]:
            return
        branch = [first]
        end = self.edge.committed_len + self.limits.max_lookahead
        if self.edge.draft_end is not None:
            end = min(end, self.edge.draft_end)  # as the real edge keeps its branches (attempt._branch_room)
        for _ in range(self.rnd.randint(0, 4)):
            if start + len(branch) >= end:
                break
            branch.append(self.draft_after(tokens + branch))
        self.up.append(self.edge.branch_chunk(start, branch))

    def start_pass(self, budget: int) -> None:
        """Build a task and compute its rows from the trajectory as it is now, as the engine
        does; drafts that arrive before it ends may change the candidates meanwhile."""
        session = self.conn.session
        if session is None or session.done is not None or self.running is not None:
            return
        task = session.next_task(budget)
        prefix = list(session.tokens[: task.start])
        aside = []
        for b in task.branches:
            fork = (*task.drafts[: b.at - task.start], *b.tokens)
            aside.append(rows(prefix, fork)[len(fork) - len(b.tokens) + 1 :])
        self.running = (session, task, rows(prefix, task.drafts), aside)

    def end_pass(self) -> None:
        if self.running is None:
            return
        session, task, line, aside = self.running
        self.running = None
        if session is not self.conn.session:
            return  # its stream was replaced meanwhile
        if self.params.greedy and self.rnd.random() < 0.5:  # greedy sessions may get argmax ids only
            line, aside = np.argmax(line, -1), [np.argmax(x, -1) for x in aside]
        self.down.extend(session.apply(task, line, aside))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
    max_new=st.integers(1, 24),
    window=st.integers(1, 8),
    context=st.sampled_from([8, 16, 24, 64]),
    sampled=st.booleans(),
    temperature=st.sampled_from([0.5, 1.0, 1.5]),
    top_p=st.sampled_from([1.0, 0.8]),
    top_k=st.sampled_from([0, 4]),
    seed=st.integers(0, 2**32 - 1),
    stop=st.lists(st.integers(1, VOCAB - 1), max_size=2, unique=True),
    alpha=st.sampled_from([0.0, 0.5, 0.8, 1.0]),
    schedule=st.integers(0, 2**32 - 1),
    capped=st.booleans(),
)
def test_pipelined_verification_commits_the_targets_own_text(prompt, max_new, window, context, sampled, temperature,
                                                            top_p, top_k, seed, stop, alpha, schedule, capped) -> None:
    if len(prompt) >= context:
        return  # refused at Open: the prompt leaves no room
    params = SamplingParams(temperature, top_p, top_k, seed) if sampled else SamplingParams()
    run = Run(prompt, max_new, context, params, tuple(stop), alpha, random.Random(schedule), window, capped)
    fair = [0.05, 0.3, 0.5, 0.6, 0.7, 0.9]  # after the random part: draft, send, deliver, verify, apply, in turn
    for step in range(3000):
        if run.edge.done is not None:
            break
        run.step(run.rnd.random() if step < 400 else fair[step % len(fair)], free=step < 400)
    else:
        raise AssertionError("the generation did not finish")
    want = reference(prompt, max_new, context, params, tuple(stop))
    assert run.edge.generated == want
    assert run.conn.session is not None and run.conn.session.generated == want
