"""Target-side logit processing and seeded, position-keyed sampling (numpy only).

Every random draw for a position comes from its own generator keyed by
(session seed, absolute position). Each position is decided exactly once, so the
output for a seed does not depend on how verification was batched or timed.
"""
from __future__ import annotations

import numpy as np

from specsplit.protocol.messages import SamplingParams


def position_rng(seed: int, position: int) -> np.random.Generator:
    return np.random.default_rng([seed & 0xFFFFFFFFFFFFFFFF, position])


def process_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Probabilities after temperature, then top-k, then top-p (float64, sums to 1).

    Works on the last axis, so a (rows, vocab) block is processed row by row.
    """
    z = np.asarray(logits, dtype=np.float64) / params.temperature
    if params.top_k and params.top_k < z.shape[-1]:
        kth = np.partition(z, -params.top_k, axis=-1)[..., -params.top_k, None]
        z = np.where(z < kth, -np.inf, z)
    z = z - z.max(axis=-1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=-1, keepdims=True)
    if 0.0 < params.top_p < 1.0:
        order = np.argsort(-p, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(p, order, axis=-1)
        mass_before = np.cumsum(sorted_p, axis=-1) - sorted_p
        keep_sorted = mass_before < params.top_p  # the token that crosses top_p stays
        keep = np.zeros_like(keep_sorted)
        np.put_along_axis(keep, order, keep_sorted, axis=-1)
        p = np.where(keep, p, 0.0)
        p /= p.sum(axis=-1, keepdims=True)
    return p


def sample_from(weights: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from non-negative (not necessarily normalised) weights."""
    cdf = np.cumsum(weights)
    idx = int(np.searchsorted(cdf, u * cdf[-1], side="right"))
    # Guard the u*total == total edge and trailing zero-weight entries.
    idx = min(idx, len(weights) - 1)
    while weights[idx] <= 0.0 and idx > 0:
        idx -= 1
    return idx
