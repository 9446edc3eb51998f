"""The per-draft acceptance both sides estimate from verdicts: the server to size a
verification, the edge to size its lookahead. One estimate, so the two agree."""
from __future__ import annotations

PRIOR_ACCEPTED, PRIOR_REJECTED = 4.0, 1.0  # a prior acceptance of 0.8, worth five observations


def acceptance_estimate(accepted: int, rejections: int) -> float:
    """Per-draft acceptance under a geometric model: each verification shows its accepted
    drafts as successes and, if it stopped early, one failure."""
    return (accepted + PRIOR_ACCEPTED) / (accepted + rejections + PRIOR_ACCEPTED + PRIOR_REJECTED)


def observed_acceptance(accepted: int, rejections: int) -> float | None:
    """The same ratio without the prior, as reports show it (None before any draft was judged)."""
    judged = accepted + rejections
    return accepted / judged if judged else None
