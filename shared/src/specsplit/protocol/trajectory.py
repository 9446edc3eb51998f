"""A generation's tokens as either side holds them: the committed ones, then the speculative
ones past them (the edge's drafts, the server's candidates).

Both sides commit a verdict's tokens, follow a branch and drop a stale tail alike; this is
that bookkeeping, written once. Each speculative position keeps the draft distribution it
was drafted with (sparse-q) or None, and every position its rolling hash (hashing.py), which
is how each side tells which trajectory a chunk was drafted on.
"""
from __future__ import annotations

from collections.abc import Sequence

from specsplit.protocol.hashing import HashedSequence
from specsplit.protocol.messages import SparseDist


class Trajectory:
    def __init__(self, committed: Sequence[int]) -> None:
        self._seq = HashedSequence(committed)
        self.committed_len = len(self._seq)
        self._dists: list[SparseDist | None] = []  # one per speculative position

    def __len__(self) -> int:
        return len(self._seq)

    @property
    def tokens(self) -> list[int]:
        """Committed + speculative tokens; do not mutate."""
        return self._seq.tokens

    @property
    def hashes(self) -> list[int]:
        """The prefix hash after each position; do not mutate."""
        return self._seq.hashes

    @property
    def speculative(self) -> int:
        return len(self._seq) - self.committed_len

    def hash_before(self, position: int) -> int:
        return self._seq.hash_before(position)

    def agreement(self, new: Sequence[int]) -> int:
        """How many of `new` equal the speculative tokens, from the committed point on."""
        return self._seq.agreement(self.committed_len, new)

    def dists(self, start: int, end: int) -> list[SparseDist | None]:
        """The distributions of the speculative positions start..end-1."""
        return self._dists[start - self.committed_len : end - self.committed_len]

    def push(self, token: int, dist: SparseDist | None = None) -> None:
        self._seq.append(token)
        self._dists.append(dist)

    def cut(self, length: int) -> None:
        """Drop the speculative tokens from position `length` on (never a committed one)."""
        if length < self.committed_len:
            raise ValueError(f"cannot cut at {length}, inside the committed {self.committed_len} tokens")
        self._seq.truncate(length)
        del self._dists[length - self.committed_len :]

    def replace_from(self, position: int, tokens: Sequence[int]) -> None:
        """Make `tokens` the speculative ones from `position` on (a branch followed, a correction)."""
        self.cut(position)
        self._seq.extend(tokens)
        self._dists.extend([None] * len(tokens))

    def commit(self, new: Sequence[int]) -> int:
        """Commit `new` from the committed point on: the speculative tokens it confirms stay,
        those it contradicts and all after them go. Returns how many it confirmed."""
        agree = self.agreement(new)
        if agree < len(new):
            self.replace_from(self.committed_len + agree, new[agree:])
        del self._dists[: len(new)]
        self.committed_len += len(new)
        return agree


def draft_end_for(prompt_len: int, max_new_tokens: int, max_context: int) -> int:
    """The trajectory length past which a server verifies no draft: a generation's last token,
    like the context's, is always the target's own (a correction or a bonus)."""
    return min(prompt_len + max_new_tokens - 1, max_context - 1)
