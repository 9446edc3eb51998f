"""Server side of one generation: committed tokens, the candidate cache, verification.

The session holds one trajectory: the committed tokens followed by admitted
candidates, with a rolling hash per position. A draft chunk is admitted only if its
parent hash equals the session's hash just before the chunk's start, so chunks
drafted on a trajectory the server has since contradicted drop out by themselves.

A branch chunk is an alternative the edge drafted for one of the candidates: the
edge's runner-up there and the drafts that follow it. It waits beside the trajectory.
A verification whose drafts reach a branch's position also feeds the branch (every
branch whose position they reach), after the drafts in the same row, each branch token
seeing what it would see fed in place of the drafts from there; if the target rejects the
candidate there in favour of the branch's first token, the branch's further tokens are
checked against their rows at once. Either way, once a verdict commits the branch's first
token at its position, the rest of the branch becomes the candidates, so the next
verification need not wait a round trip for the edge to draft on from the correction.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsplit.protocol import errors
from specsplit.protocol.messages import (
    MAX_DIST_IDS,
    MAX_STOP_IDS,
    Close,
    Done,
    DoneReason,
    DraftChunk,
    Opened,
    OpenRequest,
    ServerLimits,
    SparseDist,
    Verdict,
    VerificationMode,
)
from specsplit.protocol.trajectory import Trajectory, draft_end_for
from specsplit.protocol.verification import verify

MAX_BRANCHES = 8  # branches a session keeps aside; a newer one pushes out the oldest


@dataclass(frozen=True)
class TaskBranch:
    """An edge's alternative from position `at` (inside a task's drafts) on."""

    at: int
    tokens: tuple[int, ...]


@dataclass(frozen=True)
class VerifyTask:
    """Verify `drafts` at positions start.. ; with no drafts, an autoregressive step.

    With `branches`, the pass also scores each branch's tokens as if fed in place of the
    drafts from its position on."""

    start: int
    drafts: tuple[int, ...]
    dists: tuple[SparseDist, ...] = ()
    branches: tuple[TaskBranch, ...] = ()


def _check_ids(ids: Sequence[int], vocab_size: int, what: str) -> None:
    for t in ids:
        if not 0 <= t < vocab_size:
            raise errors.TokenOutOfVocab(f"{what} holds token id {t} outside the vocabulary [0, {vocab_size})")


class ServerSession:
    def __init__(self, request: OpenRequest, limits: ServerLimits, session_id: str = "") -> None:
        self.session_id = session_id
        self.request = request
        self.limits = limits
        self.mode = self._validate_open(request, limits)
        self.prompt_len = len(request.prompt_ids)
        self.max_new = request.max_new_tokens
        self._line = Trajectory(request.prompt_ids + request.committed_ids)
        # Positions before the floor were fixed when the session opened; no draft may touch them.
        self.floor = len(self._line)
        self.done: Done | None = None
        self.verifications = 0
        self.chunks_received = 0
        self.drafts_received = 0  # tokens of drafts, branches not counted
        self.drafts_dropped = 0
        self.drafts_accepted = 0
        self.rejections = 0  # drafts rejected: where a verification stopped, and where a branch it followed did
        # (position, first token) -> (parent hash, tokens): alternatives waiting for a correction
        self._branches: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        self.branches_taken = 0  # verdicts that moved the candidates onto a branch
        self.branches_verified = 0  # of those, the ones whose branch the same pass verified
        self.branch_verified: int | None = None  # index in the last applied task's branches, if verified
        if request.committed_ids:
            # A resumed generation may already have ended before the reconnect.
            _, reason = self._termination([request.committed_ids[-1]], already_committed=True)
            if reason is not None:
                self.done = Done(reason, self.committed_len)

    @staticmethod
    def _validate_open(req: OpenRequest, limits: ServerLimits) -> VerificationMode:
        if limits.tokenizer_fingerprint and req.tokenizer_fingerprint != limits.tokenizer_fingerprint:
            raise errors.FingerprintMismatch(
                f"tokenizer of draft model {_quoted(req.draft_model) or '(unnamed)'} "
                f"(fingerprint {_quoted(req.tokenizer_fingerprint) or 'none'}) differs from the tokenizer of target "
                f"model {limits.target_model or '(unnamed)'} (fingerprint {limits.tokenizer_fingerprint})"
            )
        if not req.prompt_ids:
            raise errors.InvalidOpen("prompt_ids is empty: send at least one token")
        # Lengths first: what follows walks the ids, on the server's event loop.
        if len(req.prompt_ids) >= limits.max_context:
            raise errors.PromptTooLong(
                f"prompt of {len(req.prompt_ids)} tokens leaves no room in the target's context of {limits.max_context}"
            )
        # A resumed generation has at most reached the context's end (its Done lost on the way).
        if len(req.prompt_ids) + len(req.committed_ids) > limits.max_context:
            raise errors.PromptTooLong(
                f"prompt of {len(req.prompt_ids)} tokens and committed_ids of {len(req.committed_ids)} exceed the "
                f"target's context of {limits.max_context}"
            )
        if len(req.committed_ids) > limits.max_new_tokens:  # they count toward max_new_tokens
            raise errors.InvalidOpen(f"committed_ids of {len(req.committed_ids)} tokens exceed this server's "
                                     f"max_new_tokens limit of {limits.max_new_tokens}")
        if len(req.stop_ids) > MAX_STOP_IDS:  # each committed token is looked up in them
            raise errors.InvalidOpen(f"{len(req.stop_ids)} stop ids exceed the limit of {MAX_STOP_IDS}")
        _check_ids(req.prompt_ids, limits.vocab_size, "prompt_ids")
        _check_ids(req.committed_ids, limits.vocab_size, "committed_ids")
        _check_ids(req.stop_ids, limits.vocab_size, "stop_ids")
        req.sampling.validate()
        if req.max_new_tokens <= 0:
            raise errors.InvalidOpen("max_new_tokens must be at least 1")
        if req.max_new_tokens > limits.max_new_tokens:
            raise errors.InvalidOpen(
                f"max_new_tokens {req.max_new_tokens} exceeds this server's limit of {limits.max_new_tokens}"
            )
        # What a generation can have committed: it ends at its max_new_tokens and at the first
        # end-of-sequence or stop token, which a resumed one's committed_ids may hold only last.
        if len(req.committed_ids) > req.max_new_tokens:
            raise errors.InvalidOpen(f"committed_ids of {len(req.committed_ids)} tokens exceed the generation's "
                                     f"max_new_tokens of {req.max_new_tokens}")
        ends = {*limits.eos_ids, *req.stop_ids}
        if any(t in ends for t in req.committed_ids[:-1]):
            raise errors.InvalidOpen("committed_ids hold an end-of-sequence or stop token before their last: "
                                     "the generation ended there")
        return req.resolved_mode()

    # -- views -----------------------------------------------------------------

    @property
    def committed_len(self) -> int:
        return self._line.committed_len

    @property
    def tokens(self) -> list[int]:
        """The whole trajectory (committed + candidates); do not mutate."""
        return self._line.tokens

    @property
    def candidates(self) -> list[int]:
        return self._line.tokens[self.committed_len :]

    @property
    def generated(self) -> list[int]:
        return self._line.tokens[self.prompt_len : self.committed_len]

    @property
    def candidate_count(self) -> int:
        """len(candidates), without copying them: the scheduler asks for every session every round."""
        return self._line.speculative

    @property
    def candidate_tip(self) -> int:
        return len(self._line)

    def opened(self) -> Opened:
        return Opened(
            session_id=self.session_id,
            target_model=self.limits.target_model,
            max_context=self.limits.max_context,
            max_lookahead=self.limits.max_lookahead,
            vocab_size=self.limits.vocab_size,
        )

    # -- drafts in -------------------------------------------------------------

    def _validate_draft(self, chunk: DraftChunk) -> None:
        if not chunk.tokens:
            raise errors.MalformedDraft("draft chunk carries no tokens")
        if len(chunk.tokens) > self.limits.max_chunk:
            raise errors.DraftTooLarge(
                f"draft chunk of {len(chunk.tokens)} tokens exceeds the limit of {self.limits.max_chunk}"
            )
        _check_ids(chunk.tokens, self.limits.vocab_size, "draft chunk")
        if chunk.branch and self.mode is VerificationMode.SPARSE_Q:
            raise errors.MalformedDraft("branch drafts are not accepted in sparse-q mode")
        if self.mode is VerificationMode.SPARSE_Q:
            if len(chunk.dists) != len(chunk.tokens):
                raise errors.MalformedDraft(
                    f"sparse-q needs one distribution per draft token: {len(chunk.tokens)} tokens, "
                    f"{len(chunk.dists)} distributions"
                )
            for tok, dist in zip(chunk.tokens, chunk.dists):
                self._validate_dist(tok, dist)
        elif chunk.dists:
            raise errors.MalformedDraft("draft distributions are only accepted in sparse-q mode")
        if chunk.start < self.floor:
            raise errors.PositionBehindCommitted(
                f"draft starts at position {chunk.start}, inside the prompt and resumed prefix "
                f"(which end at {self.floor})"
            )
        end = chunk.start + len(chunk.tokens)
        limit = self.committed_len + self.limits.max_lookahead
        if end > limit:
            raise errors.BeyondLookahead(
                f"draft reaches position {end}, past the lookahead limit {limit} "
                f"(committed {self.committed_len} + {self.limits.max_lookahead})"
            )

    def _validate_dist(self, token: int, dist: SparseDist) -> None:
        if len(dist.ids) != len(dist.probs) or not dist.ids:
            raise errors.MalformedDraft("a draft distribution needs as many ids as probs, at least one")
        if len(dist.ids) > MAX_DIST_IDS:  # validated, and searched, on the server's loop
            raise errors.MalformedDraft(f"a draft distribution of {len(dist.ids)} ids exceeds the limit of {MAX_DIST_IDS}")
        _check_ids(dist.ids, self.limits.vocab_size, "draft distribution")
        if len(set(dist.ids)) != len(dist.ids):  # q(x) would be read one way and p - q another
            raise errors.MalformedDraft("a draft distribution names a token id twice")
        if not all(math.isfinite(p) and 0.0 < p <= 1.0 for p in dist.probs):
            raise errors.MalformedDraft("draft probabilities must lie in (0, 1]")
        # The distribution the draft was drawn from, whole: the accept test and the residual take
        # q as it is, so the top of a larger one sent as it stood (summing below 1) would be
        # accepted too often, its output biased without a word.
        if abs((total := sum(dist.probs)) - 1.0) > 1e-3:
            raise errors.MalformedDraft(f"draft probabilities sum to {total:.4f}, not 1")
        if dist.prob_of(token) <= 0.0:
            raise errors.MalformedDraft(f"draft token {token} is missing from its own distribution")

    def receive_draft(self, chunk: DraftChunk) -> int:
        """Admit what can be trusted of a chunk; returns how many new candidates it added.

        Raises a ProtocolError for a malformed chunk. A chunk drafted on another
        trajectory (wrong parent hash, a gap, or a contradiction of committed tokens)
        is dropped silently: that is the normal fate of drafts in flight during a correction.
        """
        self.chunks_received += 1
        if self.done is not None:
            return 0
        self._validate_draft(chunk)
        if chunk.branch:
            self._keep_branch(chunk)
            return 0
        self.drafts_received += len(chunk.tokens)  # the line's drafts: the scheduler times their arrival
        if chunk.start > len(self._line) or chunk.parent_hash != self._line.hash_before(chunk.start):
            self.drafts_dropped += len(chunk.tokens)
            return 0
        admitted = 0
        for j, tok in enumerate(chunk.tokens):
            pos = chunk.start + j
            if pos < len(self._line):
                if self._line.tokens[pos] == tok:
                    continue  # already held (a resend or a confirmed draft)
                if pos < self.committed_len:
                    self.drafts_dropped += len(chunk.tokens) - j
                    return admitted
                # The edge re-drafted from here after a rollback: its new trajectory wins.
                self._line.cut(pos)
            self._line.push(tok, chunk.dists[j] if chunk.dists else None)
            admitted += 1
        return admitted

    def _keep_branch(self, chunk: DraftChunk) -> None:
        """Set a branch aside if it is an alternative to a candidate of this trajectory."""
        start = chunk.start
        if (
            start < self.committed_len
            or start >= len(self._line)
            or chunk.parent_hash != self._line.hash_before(start)
            or chunk.tokens[0] == self._line.tokens[start]
        ):
            self.drafts_dropped += len(chunk.tokens)
            return
        key = (start, chunk.tokens[0])
        self._branches.pop(key, None)  # a resent branch (say, a longer one) replaces the old
        self._branches[key] = (chunk.parent_hash, chunk.tokens)
        while len(self._branches) > MAX_BRANCHES:
            del self._branches[next(iter(self._branches))]

    def _follow_branch(self, new: Sequence[int]) -> bool:
        """If the tokens about to be committed leave the candidates where a branch stands
        and take the branch's first token there, make the branch the candidates from that
        position on (the edge, which sent it, does the same); returns whether it did."""
        agree = self._line.agreement(new)
        position = self.committed_len + agree
        if agree == len(new) or position == len(self._line):
            return False
        branch = self._branches.pop((position, new[agree]), None)
        if branch is None or branch[0] != self._line.hash_before(position):
            return False
        self._line.replace_from(position, branch[1])
        self.branches_taken += 1
        return True

    # -- verification ----------------------------------------------------------

    @property
    def draft_room(self) -> int:
        """The most drafts the next verification may take: its last token is the target's own,
        within max_new_tokens and the context (draft_end_for, past which an edge drafts nothing)."""
        return max(0, draft_end_for(self.prompt_len, self.max_new, self.limits.max_context) - self.committed_len)

    def next_task(self, max_drafts: int) -> VerifyTask | None:
        """The next verification: up to max_drafts candidates, or an AR step if none; with
        the branches that stand beside them."""
        if self.done is not None:
            return None
        n = max(0, min(max_drafts, self._line.speculative, self.draft_room))
        start = self.committed_len
        dists = tuple(self._line.dists(start, start + n)) if self.mode is VerificationMode.SPARSE_Q else ()
        drafts = tuple(self._line.tokens[start : start + n])
        branches = tuple(
            # No longer than the drafts it would replace: the pass feeds both.
            TaskBranch(position, tokens[: start + n - position])
            for (position, _), (parent, tokens) in sorted(self._branches.items())
            if start <= position < start + n and parent == self._line.hash_before(position)
        )
        return VerifyTask(start, drafts, dists, branches)  # type: ignore[arg-type]

    def _termination(self, new: Sequence[int], already_committed: bool = False) -> tuple[int, DoneReason | None]:
        """How many of the new tokens to commit, and why the session ends, if it does."""
        base = self.committed_len - len(new) if already_committed else self.committed_len
        for i, tok in enumerate(new):
            length = base + i + 1
            if tok in self.limits.eos_ids:
                return i + 1, DoneReason.EOS
            if tok in self.request.stop_ids:
                return i + 1, DoneReason.STOP
            if length - self.prompt_len >= self.max_new:
                return i + 1, DoneReason.LENGTH
            if length >= self.limits.max_context:
                return i + 1, DoneReason.CONTEXT
        return len(new), None

    def apply(self, task: VerifyTask, logits: np.ndarray,
              branch_logits: Sequence[np.ndarray] = ()) -> list[Verdict | Done]:
        """Commit the outcome of verifying `task` with the target's logits for it and, if the
        pass fed the task's branches, per branch its rows after each of its tokens."""
        self.branch_verified = None
        if self.done is not None:
            return []
        if task.start != self.committed_len:
            raise RuntimeError(f"stale task at {task.start}, committed point is {self.committed_len}")
        sampling = self.request.sampling
        outcome = verify(logits, task.drafts, task.start, sampling, self.mode, task.dists)
        new = [*task.drafts[: outcome.accepted], outcome.token]
        drafted = [True] * outcome.accepted + [False]  # which new tokens are accepted drafts
        # which new tokens stand where a draft was rejected (the others are accepted drafts, or
        # the target's token past the last draft)
        rejected = [False] * outcome.accepted + [outcome.accepted < len(task.drafts)]
        offered = len(task.drafts)
        for i, (branch, rows) in enumerate(zip(task.branches, branch_logits)):
            if branch.at == task.start + outcome.accepted and branch.tokens[0] == outcome.token:
                # The target chose the branch's first token: the rows after the branch's tokens
                # are the target's view of the positions that follow, as a later pass would
                # compute them. (Branches differ in position or first token: one matches at most.)
                more = verify(rows, branch.tokens[1:], branch.at + 1, sampling, self.mode)
                new += [*branch.tokens[1 : 1 + more.accepted], more.token]
                drafted += [True] * more.accepted + [False]
                rejected += [False] * more.accepted + [more.accepted < len(branch.tokens) - 1]
                offered += len(branch.tokens) - 1
                self.branches_verified += 1
                self.branch_verified = i
                break
        cut, reason = self._termination(new)
        new = new[:cut]
        accepted = sum(drafted[:cut])
        rejections = sum(rejected[:cut])
        # Drafts past an ending were never in question (nor rejected); all others were.
        considered = offered if reason is None else min(offered, cut)
        switched = self._follow_branch(new)
        # Keep candidates beyond the new tokens only if they continue the committed trajectory.
        self._line.commit(new)
        self.verifications += 1
        self.drafts_accepted += accepted
        self.rejections += rejections
        for key in [k for k in self._branches if k[0] < self.committed_len]:
            del self._branches[key]  # their chance has passed
        events: list[Verdict | Done] = [
            Verdict(
                start=task.start,
                tokens=tuple(new),
                accepted=accepted,
                proposed=considered,
                candidate_tip=len(self._line) if reason is None else self.committed_len,
                verifications=self.verifications,
                chunks_received=self.chunks_received,
                drafts_dropped=self.drafts_dropped,
                branch_tokens=self.candidate_count if switched and reason is None else 0,
                rejected=rejections,
            )
        ]
        if reason is not None:
            self._finish(reason)
            events.append(self.done)  # type: ignore[arg-type]
        return events

    def _finish(self, reason: DoneReason) -> None:
        self._line.cut(self.committed_len)
        self._branches.clear()
        self.done = Done(reason, self.committed_len)

    def cancel(self) -> Done | None:
        """The edge closed or went away; returns the Done to send if still open."""
        if self.done is not None:
            return None
        self._finish(DoneReason.CANCELLED)
        return self.done


class ServerConnection:
    """One stream: sessions one after another, each begun by an Open once the one before it
    is Done (a device keeps its stream for its next generation instead of starting a call);
    drafts and an optional Close go to the current session."""

    def __init__(self, limits: ServerLimits, stream_id: str) -> None:
        self.limits = limits
        self.stream_id = stream_id
        self.opens = 0
        self.session: ServerSession | None = None

    @property
    def idle(self) -> bool:
        """No session, or the last one is Done: the next message may be an Open."""
        return self.session is None or self.session.done is not None

    def receive(self, event: OpenRequest | DraftChunk | Close) -> list[Opened | Done]:
        if isinstance(event, OpenRequest):
            if not self.idle:
                raise errors.SecondOpen("this stream's session is still open: send the next Open after its Done")
            self.opens += 1
            # The first session is named after its stream, later ones numbered after it.
            session_id = self.stream_id if self.opens == 1 else f"{self.stream_id}.{self.opens}"
            self.session = ServerSession(event, self.limits, session_id)
            out: list[Opened | Done] = [self.session.opened()]
            if self.session.done is not None:
                out.append(self.session.done)
            return out
        if self.session is None:
            raise errors.DraftBeforeOpen("the first message of a stream must be Open")
        if isinstance(event, DraftChunk):
            # A done session ignores drafts: those the edge sent before it read the Done.
            self.session.receive_draft(event)
            return []
        done = self.session.cancel()
        return [done] if done is not None else []


QUOTED_CHARS = 64  # of a client's own text in a message the server logs and sends back


def _quoted(text: str) -> str:
    """A client's text as a message may show it: cut short, with its line ends and other
    control characters escaped, so that it can neither forge log lines nor swell them."""
    if not text:
        return ""
    cut = text[:QUOTED_CHARS]
    return ascii(cut)[1:-1] + ("..." if len(text) > QUOTED_CHARS else "")
