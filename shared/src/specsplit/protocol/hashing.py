"""Rolling 64-bit trajectory hash shared by edge and server.

h[i] = mix(h[i-1], token[i]); a draft chunk starting at position s carries h[s-1]
of the trajectory it was drafted on, so the server can tell whether that trajectory
is the one it holds without epochs or acknowledgements.
"""
from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from specsplit.common.prefix import common_prefix

MASK64 = (1 << 64) - 1
ROOT_HASH = 0x243F6A8885A308D3  # hash "before" position 0


def mix(prev: int, token: int) -> int:
    """splitmix64 finaliser over (prev, token): cheap, well distributed, deterministic."""
    x = (prev ^ ((token + 1) * 0x9E3779B97F4A7C15)) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)


class HashedSequence:
    """A token sequence with its prefix hashes, truncatable at any point."""

    __slots__ = ("tokens", "hashes")

    def __init__(self, tokens: Iterable[int] = ()) -> None:
        self.tokens: list[int] = []
        self.hashes: list[int] = []
        self.extend(tokens)

    def __len__(self) -> int:
        return len(self.tokens)

    def append(self, token: int) -> None:
        token = operator.index(token)  # a numpy integer would overflow mix's arithmetic
        prev = self.hashes[-1] if self.hashes else ROOT_HASH
        self.tokens.append(token)
        self.hashes.append(mix(prev, token))

    def extend(self, tokens: Iterable[int]) -> None:
        for t in tokens:
            self.append(t)

    def agreement(self, start: int, tokens: Sequence[int]) -> int:
        """How many of `tokens` equal this sequence's, position by position from `start`."""
        return common_prefix(self.tokens[start:], tokens)

    def truncate(self, length: int) -> None:
        del self.tokens[length:]
        del self.hashes[length:]

    def hash_before(self, position: int) -> int:
        """Hash of the prefix that ends just before `position`."""
        return self.hashes[position - 1] if position > 0 else ROOT_HASH
