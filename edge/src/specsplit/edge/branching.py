"""Where an edge should draft a branch beside its line, and from which token.

A branch pays off when the server rejects the draft it stands beside and corrects that
position to the branch's first token: the server verifies the branch in the same pass (or
takes it up as its candidates) instead of waiting a round trip for drafts from the
correction. With p_j the drafter's probability of its own draft j (counted from the
committed point) and r_i that of its runner-up at i, that happens about p_0 ... p_{i-1} r_i
of the time: every draft before i accepted, then the runner-up right. The edge branches
where that chance is largest, if it is large enough to pay for the branch: a branch costs
the edge about a seventh more per drafting step (a quarter with an int8 draft) and the server
its tokens in each pass.
"""
from __future__ import annotations

from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

# Below this a branch costs more than it brings. On the default pair at RTT 50 ms, async with
# branches against async without, 12 prompts twice each: 1.04x at 0.3, 1.12x at 0.15, 1.09x
# at 0.05 (docs/benchmarks.md).
MIN_CHANCE = 0.15


@dataclass(frozen=True)
class DraftChoice:
    """The drafter's view of one greedy draft: its token and runner-up, with probabilities."""

    token: int
    prob: float
    runner_up: int
    runner_up_prob: float


def draft_choice(logits: np.ndarray) -> DraftChoice:
    # The draft is np.argmax's pick (proposer.py), the first of tied tokens; argpartition
    # orders ties as it likes, so the runner-up is whichever of its top two is not that one
    # (with a tie at the top, a token as likely as the draft).
    first = int(np.argmax(logits))
    top2 = np.argpartition(-logits, 1)[:2]
    second = int(top2[1]) if int(top2[0]) == first else int(top2[0])
    z = np.exp(logits - logits[first]).sum()
    return DraftChoice(first, float(1.0 / z), second, float(np.exp(logits[second] - logits[first]) / z))


def choose_branch(choices: Sequence[DraftChoice], taken: Collection[int] = ()) -> int | None:
    """The index in `choices` (the drafts from the committed point on), other than those
    `taken` (branched at already), to branch at; None if no branch has a chance of at least
    MIN_CHANCE."""
    alive = 1.0  # chance that every draft before this one is accepted
    best, best_chance = None, MIN_CHANCE
    for i, choice in enumerate(choices):
        chance = alive * choice.runner_up_prob
        if chance >= best_chance and i not in taken:
            best, best_chance = i, chance
        alive *= choice.prob
        if alive < MIN_CHANCE:
            break
    return best
