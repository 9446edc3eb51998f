"""Drafters that cost nothing to run and hit a set acceptance rate.

They know the target's greedy continuation of the prompt and, at each position, propose
the right token with probability alpha, otherwise another valid id. Beside a wrong draft
they may also offer a branch from the right token (`branch_coverage`: how often), as a real
edge does where its runner-up turns out right (the default pair at RTT 50 ms carried on along
such a branch after 37 of 94 rejections, bench/results/rtt50.md). `SimulatedDrafter`
offers the edge client's inline path (`next_token`): no thread hop, and everything
drafted at once goes out as one chunk, so thousands of drafts per second cost the load
generator little. `PacedSimulatedDrafter` instead takes a set time per token, like a
model would, through the client's ordinary path (`next_logits`, a one-hot vector).
"""
from __future__ import annotations

import random
import time
from collections.abc import Sequence

import numpy as np


class SimulatedDrafter:
    def __init__(self, prompt_len: int, reference: Sequence[int], vocab_size: int, alpha: float,
                 rng: random.Random, branch_coverage: float = 0.0) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= branch_coverage <= 1.0:
            raise ValueError(f"branch_coverage must be in [0, 1], got {branch_coverage}")
        if vocab_size < 2:
            raise ValueError("a wrong token needs a vocabulary of at least 2")
        self.prompt_len = prompt_len
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.alpha = alpha
        self.rng = rng
        self.branch_coverage = branch_coverage
        self._misses: set[int] = set()  # generated positions drafted wrong, not yet offered a branch

    def choose(self, position: int, line: bool = True) -> int:
        """The draft for generated position `position` (0: the first new token); `line`:
        for the line, not for a branch (only the line's wrong drafts get branches).

        Positions past the known continuation are never verified on the right trajectory,
        so any token does; after a wrong draft the target rejects what follows anyway."""
        right = self.reference[position] if position < len(self.reference) else None
        if right is not None and self.rng.random() < self.alpha:
            return right
        if right is None:
            return self.rng.randrange(self.vocab_size)
        wrong = self.rng.randrange(self.vocab_size - 1)
        if line:
            self._misses.add(position)
        return wrong + 1 if wrong >= right else wrong

    def next_token(self, trajectory: Sequence[int]) -> int:
        return self.choose(len(trajectory) - self.prompt_len)

    def branch_beside(self, position: int, length: int) -> list[int] | None:
        """A branch of up to `length` tokens beside the draft at trajectory position
        `position`, or None: offered (with chance branch_coverage) only beside a wrong draft,
        once; it starts with the right token and goes on as drafts do."""
        generated = position - self.prompt_len
        if generated not in self._misses or length < 1:
            return None
        self._misses.discard(generated)
        if self.rng.random() >= self.branch_coverage:
            return None
        return [self.reference[generated], *(self.choose(generated + 1 + i, line=False) for i in range(length - 1))]


class PacedSimulatedDrafter:
    """The same choices, `delay_s` per token, in the client's drafter thread."""

    def __init__(self, choices: SimulatedDrafter, delay_s: float) -> None:
        self.choices = choices
        self.delay_s = delay_s
        # One buffer, rewritten in place: the client's drafting loop is sequential and takes
        # the argmax before it asks again, and a fresh 150k-entry vector per draft costs more.
        self._logits = np.zeros(choices.vocab_size, dtype=np.float32)
        self._hot = 0

    def next_logits(self, trajectory: Sequence[int]) -> np.ndarray:
        time.sleep(self.delay_s)
        token = self.choices.next_token(trajectory)
        self._logits[self._hot] = 0.0
        self._logits[token] = 1.0
        self._hot = token
        return self._logits
