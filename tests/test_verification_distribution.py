"""The sampled verification modes reproduce the target's processed distribution exactly.

Two positions are drawn per trial, so acceptance of a run of drafts, the residual
after a rejection and the bonus token all matter. A chi-square test compares the
joint counts with p(y0) * p(y1 | y0); fixed seeds keep it deterministic, and the
planted-bias cases show the test has the power to catch a wrong verifier.
"""
from __future__ import annotations

import numpy as np
import pytest
from scipy.stats import chisquare

from specsplit.protocol import verification
from specsplit.protocol.messages import SamplingParams, SparseDist, VerificationMode
from specsplit.protocol.sampling import process_logits, sample_from
from specsplit.protocol.verification import verify

V = 6
TRIALS = 12_000
_r = np.random.default_rng(7)
TARGET0 = _r.normal(0, 1.5, V)
TARGET1 = _r.normal(0, 1.5, (V, V))  # row y0: logits for the second position
DRAFT0 = _r.normal(0, 1.5, V)
DRAFT1 = _r.normal(0, 1.5, (V, V))
DRAFT_TOP_K = 3

PARAMS = [
    SamplingParams(temperature=1.0, seed=11),
    SamplingParams(temperature=0.7, top_p=0.85, seed=12),
    SamplingParams(temperature=1.3, top_k=4, seed=13),
    SamplingParams(temperature=0.9, top_p=0.9, top_k=5, seed=14),
]


def draft_dist(logits: np.ndarray) -> SparseDist:
    """The edge's proposal: softmax truncated to its top-k and renormalised."""
    p = np.exp(logits - logits.max())
    top = np.argsort(-p)[:DRAFT_TOP_K]
    q = p[top] / p[top].sum()
    return SparseDist(tuple(int(i) for i in top), tuple(float(x) for x in q))


def draw(dist: SparseDist, rng: np.random.Generator) -> int:
    return dist.ids[sample_from(np.asarray(dist.probs), rng.random())]


def joint_counts(params: SamplingParams, mode: VerificationMode) -> np.ndarray:
    counts = np.zeros((V, V))
    edge_rng = np.random.default_rng(1000 + params.seed)
    for trial in range(TRIALS):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=params.seed * 100_003 + trial)
        q0 = draft_dist(DRAFT0)
        x0 = draw(q0, edge_rng)
        q1 = draft_dist(DRAFT1[x0])
        x1 = draw(q1, edge_rng)
        logits = np.stack([TARGET0, TARGET1[x0], TARGET0])  # the last row is never reached at two tokens
        out = verify(logits, (x0, x1), 10, p, mode, (q0, q1))
        if out.accepted == 0:
            y0 = out.token
            y1 = verify(TARGET1[y0][None, :], (), 11, p, mode).token  # the next autoregressive step
        elif out.accepted == 1:
            y0, y1 = x0, out.token
        else:
            y0, y1 = x0, x1
        counts[y0, y1] += 1
    return counts


def chi_square_p(params: SamplingParams, mode: VerificationMode) -> float:
    p0 = process_logits(TARGET0, params)
    p1 = process_logits(TARGET1, params)
    expected = (p0[:, None] * p1).ravel() * TRIALS
    observed = joint_counts(params, mode).ravel()
    support = expected > 0
    assert observed[~support].sum() == 0, "a token outside the target's support was committed"
    return float(chisquare(observed[support], expected[support]).pvalue)


@pytest.mark.parametrize("mode", [VerificationMode.MATCH, VerificationMode.SPARSE_Q])
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}")
def test_output_follows_target_distribution(params, mode) -> None:
    assert chi_square_p(params, mode) > 1e-3


def test_planted_bias_no_residual_is_caught(monkeypatch) -> None:
    """Sampling the correction from p instead of the residual over-weights the draft."""
    monkeypatch.setattr(verification, "residual", lambda p, dist: p.copy())
    assert chi_square_p(PARAMS[0], VerificationMode.SPARSE_Q) < 1e-6


@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-p{p.top_p}-k{p.top_k}")
def test_match_commits_the_targets_own_draw_whatever_was_drafted(params) -> None:
    """For a seed, match verification commits at each position the token the target alone
    (no drafts: the server-only mode) would draw there, so the text does not depend on the
    drafts, their timing or the mode; the drafts only decide how many positions one pass settles."""
    rng = np.random.default_rng(params.seed)
    for trial in range(300):
        p = SamplingParams(params.temperature, params.top_p, params.top_k, seed=trial)
        alone = verify(TARGET0[None, :], (), 10, p, VerificationMode.MATCH).token
        alone_next = verify(TARGET1[alone][None, :], (), 11, p, VerificationMode.MATCH).token
        x0, x1 = (int(t) for t in rng.integers(0, V, 2))
        out = verify(np.stack([TARGET0, TARGET1[x0], TARGET0]), (x0, x1), 10, p, VerificationMode.MATCH)
        committed = [x0, x1][: out.accepted] + [out.token]
        assert committed[: 2] == [alone, alone_next][: len(committed)], trial


def test_planted_bias_ignoring_q_is_caught(monkeypatch) -> None:
    """Accepting with p(x) instead of p(x)/q(x) under-accepts what the draft proposes."""
    monkeypatch.setattr(SparseDist, "prob_of", lambda self, token: 1.0)
    assert chi_square_p(PARAMS[0], VerificationMode.SPARSE_Q) < 1e-6


def test_sampling_is_reproducible_per_seed() -> None:
    params = SamplingParams(temperature=1.0, seed=5)
    logits = np.stack([TARGET0, TARGET1[0]])
    a = [verify(logits, (0,), 3, params, VerificationMode.MATCH) for _ in range(3)]
    assert a[0] == a[1] == a[2]


def test_greedy_accepts_exactly_the_argmax_prefix() -> None:
    logits = np.eye(V)[[2, 4, 1]] * 3.0
    assert verify(logits, (2, 4), 0, SamplingParams(), VerificationMode.GREEDY) == verification.Outcome(2, 1)
    assert verify(logits, (2, 5), 0, SamplingParams(), VerificationMode.GREEDY) == verification.Outcome(1, 4)


def test_logit_processing_truncates_and_renormalises() -> None:
    logits = np.log(np.array([0.5, 0.3, 0.15, 0.05]))
    p = process_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))
    np.testing.assert_allclose(p, [0.625, 0.375, 0, 0])
    p = process_logits(logits, SamplingParams(temperature=1.0, top_k=3))
    np.testing.assert_allclose(p, np.array([0.5, 0.3, 0.15, 0]) / 0.95)
