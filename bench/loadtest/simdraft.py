"""Drafters that cost nothing to run and hit a set acceptance rate.

They know the target's greedy continuation of the prompt and, at each position, propose
the right token with probability alpha, otherwise another valid id. `SimulatedDrafter`
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
                 rng: random.Random) -> None:
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"alpha must be in [0, 1], got {alpha}")
        if vocab_size < 2:
            raise ValueError("a wrong token needs a vocabulary of at least 2")
        self.prompt_len = prompt_len
        self.reference = list(reference)
        self.vocab_size = vocab_size
        self.alpha = alpha
        self.rng = rng

    def choose(self, position: int) -> int:
        """The draft for generated position `position` (0: the first new token).

        Positions past the known continuation are never verified on the right trajectory,
        so any token does; after a wrong draft the target rejects what follows anyway."""
        right = self.reference[position] if position < len(self.reference) else None
        if right is not None and self.rng.random() < self.alpha:
            return right
        if right is None:
            return self.rng.randrange(self.vocab_size)
        wrong = self.rng.randrange(self.vocab_size - 1)
        return wrong + 1 if wrong >= right else wrong

    def next_token(self, trajectory: Sequence[int]) -> int:
        return self.choose(len(trajectory) - self.prompt_len)


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
