"""Edge side of one generation: its trajectory, the lookahead window, what to send.

The edge drafts ahead of the committed point by at most `window` tokens and never
waits for verdicts. A verdict that contradicts its trajectory rolls the trajectory
back to the committed point; the drafter then re-syncs its KV cache from there.

An edge may also draft a branch: an alternative to one of its drafts (its runner-up
there and what follows it), sent aside. If a verdict commits the branch's first token at
that position, the server has made the rest of the branch its candidates (the verdict says
how many of them it holds) and so does the edge: it carries on from the branch's end
instead of from the correction.
"""
from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence

from specsplit.protocol import errors
from specsplit.protocol.messages import Done, DraftChunk, SparseDist, Verdict
from specsplit.protocol.trajectory import Trajectory


class EdgeSession:
    def __init__(self, prompt_ids: Sequence[int], window: int, committed_ids: Sequence[int] = (),
                 draft_end: int | None = None, end_ids: Iterable[int] = (), commit_end: int | None = None) -> None:
        """`draft_end`: the trajectory's length past which no draft is drafted, where the
        server would verify none (its generation or context ends; None: no such end).
        `commit_end`: the length no verdict commits past (the generation's end; None: none).
        `end_ids`: tokens that end a generation (end-of-sequence, stop ids), past which a
        draft is never of use: accepted, the generation ends there; rejected, the line is cut
        before it."""
        if window < 1:
            raise ValueError("the lookahead window must be at least 1")
        if len(prompt_ids) == 0:
            raise ValueError("a generation needs a prompt")
        self.prompt_len = len(prompt_ids)
        self.window = window
        self.draft_end = draft_end
        self.commit_end = commit_end
        self.end_ids = frozenset(end_ids)
        self._line = Trajectory([*prompt_ids, *committed_ids])
        self.sent_len = self.committed_len
        self._chunks_sent = 0
        # (chunk index, end position; None for a branch, which moves no tip)
        self._in_flight: deque[tuple[int, int | None]] = deque()
        self._branches: dict[int, tuple[int, ...]] = {}  # start -> tokens, of branches sent
        self.done: Done | None = None
        self.drafted = 0
        self.wasted = 0  # drafted tokens thrown away by rollbacks
        self.resends = 0
        self.branch_drafted = 0  # tokens sent in branches
        self.branches_taken = 0

    # -- views -----------------------------------------------------------------

    @property
    def committed_len(self) -> int:
        return self._line.committed_len

    @property
    def tokens(self) -> list[int]:
        """Committed + speculative tokens; do not mutate."""
        return self._line.tokens

    @property
    def generated(self) -> list[int]:
        return self._line.tokens[self.prompt_len : self.committed_len]

    @property
    def tip(self) -> int:
        """Hash of the whole trajectory: a cheap test of whether it changed."""
        return self._line.hash_before(len(self._line))

    @property
    def speculative(self) -> int:
        return self._line.speculative

    def room(self) -> int:
        """How many more tokens may be drafted before a verdict opens the window (or, near
        the draft end, before the generation's last tokens come as verdicts; or, after a
        drafted end token, before a verdict settles it)."""
        if self.done is not None:
            return 0
        if self.speculative and self._line.tokens[-1] in self.end_ids:
            return 0  # nothing drafted past it could be used
        room = self.window - self.speculative
        return room if self.draft_end is None else min(room, self.draft_end - len(self._line))

    # -- drafting and sending --------------------------------------------------

    def push_draft(self, token: int, dist: SparseDist | None = None) -> None:
        if self.done is not None:
            raise ValueError("the generation is over")
        if self.room() <= 0:
            raise ValueError("the lookahead window is full")
        self._line.push(token, dist)
        self.drafted += 1

    def next_chunk(self, max_tokens: int | None = None) -> DraftChunk | None:
        """Drafts not yet sent, as one chunk of at most `max_tokens` (None if there are none)."""
        if max_tokens is not None and max_tokens < 1:
            raise ValueError(f"a chunk holds at least one token, got max_tokens={max_tokens}")
        if self.done is not None or self.sent_len >= len(self._line):
            return None
        start = self.sent_len
        end = len(self._line) if max_tokens is None else min(len(self._line), start + max_tokens)
        dists = self._line.dists(start, end)
        chunk = DraftChunk(
            start=start,
            tokens=tuple(self._line.tokens[start:end]),
            parent_hash=self._line.hash_before(start),
            dists=tuple(dists) if all(d is not None for d in dists) else (),  # type: ignore[arg-type]
        )
        self._in_flight.append((self._chunks_sent, end))
        self._chunks_sent += 1
        self.sent_len = end
        return chunk

    @property
    def branches(self) -> list[tuple[int, tuple[int, ...]]]:
        """The branches sent and still open, (position, tokens), earliest first."""
        return sorted(self._branches.items())

    @property
    def branch(self) -> tuple[int, tuple[int, ...]] | None:
        """The earliest branch sent and still open."""
        branches = self.branches
        return branches[0] if branches else None

    def branch_chunk(self, start: int, tokens: Sequence[int]) -> DraftChunk:
        """Send `tokens` as an alternative to the sent drafts from `start` on (one branch per
        position; a longer one for the same position replaces it)."""
        if self.done is not None:
            raise ValueError("the generation is over")
        if not self.committed_len <= start < self.sent_len:
            raise ValueError(
                f"a branch must stand beside a sent draft: {start} is outside [{self.committed_len}, {self.sent_len})"
            )
        if not tokens or tokens[0] == self._line.tokens[start]:
            raise ValueError("a branch's first token must differ from the draft it stands beside")
        old = self._branches.get(start)
        if old is not None and tuple(tokens[: len(old)]) != old:
            raise ValueError(f"position {start} already has a branch that this one does not extend")
        self.branch_drafted += len(tokens) - (len(old) if old is not None else 0)
        self._branches[start] = tuple(tokens)
        self._in_flight.append((self._chunks_sent, None))
        self._chunks_sent += 1
        return DraftChunk(start=start, tokens=tuple(tokens), parent_hash=self._line.hash_before(start), branch=True)

    # -- verdicts in -----------------------------------------------------------

    def apply_verdict(self, verdict: Verdict) -> int | None:
        """Commit a verdict; returns the first position whose token changed or was
        added (the drafter re-syncs its cache from there), or None if the verdict
        only confirmed drafts."""
        if self.done is not None:
            raise errors.VerdictOutOfOrder("a verdict after the session's Done")
        if verdict.start != self.committed_len:
            raise errors.VerdictOutOfOrder(
                f"verdict starts at {verdict.start} but the committed point is {self.committed_len}"
            )
        new = verdict.tokens
        if self.commit_end is not None and self.committed_len + len(new) > self.commit_end:
            raise errors.VerdictOutOfOrder(f"a verdict of {len(new)} tokens at {verdict.start} commits past the "
                                           f"generation's end at {self.commit_end}")
        switched = self._follow_branch(new)
        held = min(len(new), self._line.speculative)  # drafts the verdict's tokens stand on
        start, drafted_to = self.committed_len, len(self._line)
        agree = self._line.commit(new)
        diverged = start + agree  # the first position the verdict changed, if it changed one
        resync = switched
        if agree < len(new):
            resync = diverged if switched is None else switched  # a switch comes first
            self.wasted += drafted_to - diverged
            if agree < held:
                # Everything sent past the divergence is stale on the server too.
                self.sent_len = diverged
                self._in_flight.clear()
        self.sent_len = max(self.sent_len, self.committed_len)
        if switched is not None:
            # The server holds as candidates what the verdict says of the branch; what it
            # lacks (a longer branch still on its way, say) goes again as plain drafts.
            self.sent_len = min(len(self._line), self.committed_len + verdict.branch_tokens)
            self._in_flight.clear()
        # A branch for a committed position is spent; one past a change hangs off drafts now gone.
        self._branches = {
            p: b for p, b in self._branches.items() if p >= self.committed_len and (resync is None or p < resync)
        }
        self._resend_if_dropped(verdict)
        return resync

    def _follow_branch(self, new: Sequence[int]) -> int | None:
        """If the verdict's tokens leave this edge's drafts where it sent a branch, taking
        the branch's first token there, make the branch its drafts from that position on, as
        the server does; returns the position, or None."""
        agree = self._line.agreement(new)
        position = self.committed_len + agree
        if agree == len(new) or position == len(self._line):
            return None
        branch = self._branches.pop(position, None)
        if branch is None or branch[0] != new[agree]:
            return None
        self.wasted += len(self._line) - position
        self._line.replace_from(position, branch)
        self.branches_taken += 1
        return position

    def _resend_if_dropped(self, verdict: Verdict) -> None:
        """If the server held less than the chunks it had received should have given
        it, something was dropped there (say, after a reconnect): send it again."""
        expected_tip = None
        while self._in_flight and self._in_flight[0][0] < verdict.chunks_received:
            end = self._in_flight.popleft()[1]
            expected_tip = end if end is not None else expected_tip
        if expected_tip is None:
            return
        expected_tip = min(expected_tip, len(self._line))
        if verdict.candidate_tip < expected_tip:
            self.sent_len = max(self.committed_len, min(self.sent_len, verdict.candidate_tip))
            self._in_flight.clear()
            self.resends += 1
            # A branch beside drafts the server lacks stands beside nothing there.
            self._branches = {p: b for p, b in self._branches.items() if p < self.sent_len}

    def apply_done(self, done: Done) -> None:
        if self.done is not None:
            raise errors.VerdictOutOfOrder("a second Done for one session")
        if done.committed_length != self.committed_len:
            raise errors.VerdictOutOfOrder(
                f"Done says {done.committed_length} tokens are committed, the edge has {self.committed_len}"
            )
        self.wasted += self.speculative
        self._line.cut(self.committed_len)
        self._branches.clear()
        self.done = done

    def reconnect(self) -> None:
        """A new stream: the new server session holds nothing past the committed point."""
        self.sent_len = self.committed_len
        self._chunks_sent = 0
        self._in_flight.clear()
        self._branches.clear()
