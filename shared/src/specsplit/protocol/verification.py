"""Exact verification of a run of draft tokens against target logits.

Greedy accepts while the draft equals the target's argmax. `match` treats each draft
token as a point-mass proposal: it draws the position's token y from p with the
position's own uniform and accepts the draft iff it is y (probability p(x)); otherwise
y is the correction, distributed as norm(max(0, p - onehot(x))). So the token at a
position is the one the target alone would draw there, whatever was drafted: for a seed,
the text is the same in every mode. `sparse-q` uses the draft's top-k truncated q:
accept with min(1, p(x)/q(x)), on rejection sample from norm(max(0, p - q)); its text
depends on the drafts. Either way the committed token follows the target's processed
distribution p exactly.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from specsplit.protocol.messages import SamplingParams, SparseDist, VerificationMode
from specsplit.protocol.sampling import position_rng, process_logits, sample_from


@dataclass(frozen=True)
class Outcome:
    accepted: int  # leading drafts accepted
    token: int  # the target's token after them: a correction or the bonus


def residual(p: np.ndarray, dist: SparseDist) -> np.ndarray:
    """max(0, p - q) where q is the draft's proposal."""
    r = p.copy()
    r[list(dist.ids)] -= np.asarray(dist.probs, dtype=np.float64)
    np.maximum(r, 0.0, out=r)
    return r


def verify(
    logits: np.ndarray,
    drafts: Sequence[int],
    start: int,
    params: SamplingParams,
    mode: VerificationMode,
    dists: Sequence[SparseDist] = (),
) -> Outcome:
    """Decide drafts[j] at absolute position start + j from logits row j.

    `logits` has len(drafts) + 1 rows: row j is the target's prediction for
    position start + j given everything before it. Greedy reads only each row's argmax,
    so for it `logits` may be those argmax ids (one dimension) instead.
    """
    if logits.shape[0] != len(drafts) + 1:
        raise ValueError(f"need {len(drafts) + 1} logit rows, got {logits.shape[0]}")
    if logits.ndim == 1 and mode is not VerificationMode.GREEDY:
        raise ValueError(f"{mode.name.lower()} verification needs logit rows, not argmax ids")
    if mode is VerificationMode.GREEDY:
        best = logits if logits.ndim == 1 else np.argmax(logits, axis=-1)
        n = 0
        while n < len(drafts) and drafts[n] == int(best[n]):
            n += 1
        return Outcome(n, int(best[n]))

    probs = process_logits(logits, params)
    for j, x in enumerate(drafts):
        rng = position_rng(params.seed, start + j)
        p = probs[j]
        if mode is VerificationMode.MATCH:
            y = sample_from(p, rng.random())  # the bonus below draws the same way: none's token too
            if y == x:
                continue
            return Outcome(j, y)
        dist = dists[j]
        if rng.random() * dist.prob_of(x) < p[x]:  # u < p(x) / q(x), without dividing
            continue
        r = residual(p, dist)
        # r sums to zero only if p == q, where rejection has probability zero.
        return Outcome(j, sample_from(r if r.sum() > 0 else p, rng.random()))
    rng = position_rng(params.seed, start + len(drafts))
    return Outcome(len(drafts), sample_from(probs[-1], rng.random()))
