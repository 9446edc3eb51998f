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
                 rng: random.Random, branch_coverage: float = 0.0, branch_rng: random.Random | None = None) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if not 0.0 <= branch_coverage <= 1.0:
            raise ValueError(f"branch_coverage must be in [0, 1], got {branch_coverage}")
        if vocab_size < 2:
            raise ValueError("a wrong token needs a vocabulary of at least 2")
        if branch_coverage > 0 and branch_rng is None:
            raise ValueError("branches need a generator of their own (branch_rng)")
        self.prompt_len = prompt_len
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.alpha = alpha
        self.rng = rng
        self.branch_coverage = branch_coverage
        # Branches draw from a generator of their own: the line's draws are then those it
        # would make without branches, up to where a branch is followed.
        self._branch_rng = branch_rng if branch_coverage > 0 else None
        self._offered: set[tuple[int, int]] = set()  # (generated position, wrong draft) already decided

    def choose(self, position: int) -> int:
        """The draft for generated position `position` (0: the first new token).

        Positions past the known continuation are never verified on the right trajectory,
        so any token does; after a wrong draft the target rejects what follows anyway."""
        return self._draw(position, self.rng)

    def _draw(self, position: int, rng: random.Random) -> int:
        right = self.reference[position] if position < len(self.reference) else None
        if right is not None and rng.random() < self.alpha:
            return right
        if right is None:
            return rng.randrange(self.vocab_size)
        wrong = rng.randrange(self.vocab_size - 1)
        return wrong + 1 if wrong >= right else wrong

    def next_token(self, trajectory: Sequence[int]) -> int:
        return self.choose(len(trajectory) - self.prompt_len)

    def branch_beside(self, position: int, drafted: int, length: int) -> tuple[int, ...] | None:
        """For the draft `drafted` at trajectory position `position`: None if it is right;
        if wrong, the branch to send beside it (up to `length` tokens, from the right token
        on, drawn as drafts are), or () for none, the branch coming with chance
        branch_coverage, decided once per wrong draft."""
        generated = position - self.prompt_len
        if not 0 <= generated < len(self.reference) or drafted == self.reference[generated]:
            return None
        if self._branch_rng is None or length < 1 or (generated, drafted) in self._offered:
            return ()
        self._offered.add((generated, drafted))
        if self._branch_rng.random() >= self.branch_coverage:
            return ()
        rest = (self._draw(generated + 1 + i, self._branch_rng) for i in range(length - 1))
        return (self.reference[generated], *rest)


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
