"""The verification-size policy."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsplit.common.acceptance import acceptance_estimate
from specsplit.server.policy import (
    Explorer,
    PassCostModel,
    choose_drafts,
    choose_width,
    WAIT_STEP_S,
    _first_waits,
    expected_tokens,
    plan,
)


def cpu_like_costs() -> PassCostModel:
    m = PassCostModel()
    for n, c in {0: 0.5, 1: 1.0, 4: 1.1, 8: 1.2, 16: 1.5, 24: 1.9}.items():
        m.observe(n, c)
    return m


def test_expected_tokens() -> None:
    assert expected_tokens(0, 0.5) == 1.0
    assert abs(expected_tokens(2, 0.5) - 1.75) < 1e-12
    assert expected_tokens(5, 1.0) == 6.0


def test_high_acceptance_takes_many_drafts_low_takes_few() -> None:
    costs = cpu_like_costs()
    assert choose_drafts(24, 24, 0.95, costs) >= 16
    assert choose_drafts(24, 24, 0.3, costs) == 0  # an autoregressive step beats a costly pass
    assert choose_drafts(3, 24, 0.95, costs) <= 3


def test_without_a_cost_curve_everything_offered_is_taken() -> None:
    assert choose_drafts(7, 24, 0.1, PassCostModel()) == 7


@given(st.lists(st.tuples(st.integers(0, 40), st.floats(0.01, 10)), min_size=2, max_size=20),
       st.integers(0, 40), st.integers(0, 40), st.floats(0, 1))
def test_choice_is_within_bounds(obs, available, limit, alpha) -> None:
    m = PassCostModel()
    for n, c in obs:
        m.observe(n, c)
    n = choose_drafts(available, limit, alpha, m)
    assert 0 <= n <= min(available, limit)


def test_acceptance_estimate_moves_from_the_prior() -> None:
    assert abs(acceptance_estimate(0, 0) - 0.8) < 1e-12
    assert acceptance_estimate(100, 2) > 0.95
    assert acceptance_estimate(2, 50) < 0.2


def test_the_policy_explores_larger_passes_than_it_has_timed() -> None:
    """Timing only small passes must not lock the policy into autoregressive steps."""
    m = PassCostModel()
    m.observe(0, 0.5)
    m.observe(1, 1.0)
    assert choose_drafts(16, 24, 0.8, m) == 16


def test_plan_waits_for_drafts_on_their_way_only_when_it_pays() -> None:
    costs = cpu_like_costs()
    n, wait = plan(1, 24, 0.95, costs, draft_rate=20.0, max_wait_s=0.5)
    assert wait > 0 and n > 1  # one candidate now, ten more within half a second: wait
    n, wait = plan(1, 24, 0.95, costs, draft_rate=0.0, max_wait_s=0.5)
    assert wait == 0  # nothing is coming: act now
    n, wait = plan(20, 24, 0.95, costs, draft_rate=20.0, max_wait_s=0.5)
    assert wait == 0 and n >= 16  # plenty in hand


def _plan_over_every_wait(available: int, limit: int, alpha: float, costs: PassCostModel, draft_rate: float,
                          max_wait_s: float) -> tuple[int, float]:
    """plan() as it was: every wait of the grid weighed, in order."""
    best_rate, best = -1.0, (min(available, limit), 0.0)
    for k in range(int(max_wait_s / WAIT_STEP_S) + 1):
        wait = k * WAIT_STEP_S
        n = choose_drafts(min(limit, available + int(draft_rate * wait)), limit, alpha, costs)
        rate = expected_tokens(n, alpha) / (wait + costs.cost(n))
        if rate > best_rate * 1.0001:
            best_rate, best = rate, (n, wait)
    return best


@given(st.integers(0, 30), st.integers(1, 30), st.floats(0.0, 0.99),
       st.one_of(st.just(0.0), st.floats(0.01, 300.0)), st.floats(0.0, 3.0),
       st.lists(st.floats(0.001, 1.0), min_size=2, max_size=5))
def test_plan_weighs_only_the_first_wait_for_each_draft_and_plans_as_over_every_wait(
        available, limit, alpha, rate, max_wait, costs_by_size) -> None:
    costs = PassCostModel()
    for n, c in zip((0, 1, 4, 8, 16), sorted(costs_by_size)):
        costs.observe(n, c)
    assert plan(available, limit, alpha, costs, rate, max_wait) == \
        _plan_over_every_wait(available, limit, alpha, costs, rate, max_wait)


def test_a_long_max_wait_does_not_make_a_plan_weigh_more_waits() -> None:
    """A wait per draft still to come, not one per 50 ms of --max-wait-ms: an hour's limit
    would otherwise weigh 72,000 waits for each session at each pick."""
    assert len(_first_waits(2, 24, 0.01, 3600.0)) <= 23
    assert _first_waits(2, 24, 0.0, 3600.0) == [0.0]
    assert _first_waits(0, 4, 40.0, 0.5) == [0.0, 0.05, 0.1]  # 2 drafts a step: the first two steps bring all 4


def _linear_costs(fixed: float, per_token: float) -> PassCostModel:
    """Pass time by padded tokens: a fixed part plus a part per token."""
    m = PassCostModel()
    for p in (1, 64, 1024, 8192):
        m.observe(p, fixed + per_token * p)
    return m


def _buckets(w: int) -> int:
    return next(b for b in (1, 2, 4, 8, 16, 32) if b >= w)


def test_a_compute_bound_batch_is_cut_and_a_launch_bound_one_is_not() -> None:
    rows = [(1, 8, 0.68)] * 128  # 128 sessions, each offering 8 drafts after its one committed token
    assert choose_width(rows, lambda w: 128 * _buckets(w), _linear_costs(0.007, 0.0)) == 9  # flat: take all
    cut = choose_width(rows, lambda w: 128 * _buckets(w), _linear_costs(0.007, 0.00005))
    assert cut in (2, 4)  # 16 padded tokens each for ~2.9 committed is the worst choice here


def test_a_batch_the_host_cannot_serve_faster_is_not_cut() -> None:
    """Cutting shortens the pass, but not the host's work on its sessions: once that is the
    longer, a narrower pass brings the next no sooner and commits less."""
    rows = [(1, 8, 0.68)] * 128
    costs = _linear_costs(0.007, 0.00005)
    assert choose_width(rows, lambda w: 128 * _buckets(w), costs, host_s=0.005) in (2, 4)  # the pass is longer
    assert choose_width(rows, lambda w: 128 * _buckets(w), costs, host_s=0.2) == 9


def test_a_long_feed_split_over_rows_does_not_set_the_width() -> None:
    """A 12-token prompt among 63 rows of 8: split over rows, it need not pad the others to 16."""
    rows = [(12, 7, 0.8)] + [(1, 7, 0.8)] * 63
    costs = _linear_costs(0.04, 0.00005)

    def padded(w: int) -> int:
        b = _buckets(w)
        return _buckets(w) * sum(-(-f // b) for f, _, _ in rows)

    assert choose_width(rows, padded, costs) == 16  # no splitting: the prompt's row sets the floor
    assert choose_width(rows, padded, costs, split_width=32) == 8


def test_one_long_feed_does_not_pad_the_whole_batch() -> None:
    rows = [(1, 15, 0.68)] + [(1, 1, 0.68)] * 63
    assert choose_width(rows, lambda w: 64 * _buckets(w), _linear_costs(0.005, 0.0001)) == 2


def test_without_a_cost_curve_nothing_is_cut() -> None:
    assert choose_width([(1, 8, 0.68)] * 4, lambda w: 4 * w, PassCostModel()) == 9


@given(st.lists(st.tuples(st.integers(1, 40), st.integers(0, 24), st.floats(0.0, 1.0)), min_size=1, max_size=40),
       st.floats(0.0, 0.01), st.floats(0.0, 1e-3))
def test_the_width_never_cuts_into_what_a_session_must_feed(rows, fixed, per_token) -> None:
    w = choose_width(rows, lambda w: len(rows) * w, _linear_costs(fixed + 1e-4, per_token))
    assert max(f for f, _, _ in rows) <= w <= max(f + n for f, n, _ in rows)



@given(st.lists(st.tuples(st.integers(1, 100), st.integers(0, 24), st.floats(0.0, 1.0)), min_size=1, max_size=40),
       st.integers(1, 60))
def test_a_split_width_keeps_within_the_rows_a_pass_may_take(rows, max_rows) -> None:
    def padded(w: int) -> int | None:
        pieces = sum(-(-f // w) for f, _, _ in rows)
        return None if pieces > max_rows else pieces * w

    w = choose_width(rows, padded, _linear_costs(0.005, 1e-5), split_width=32)
    top = min(32, max(f + n for f, n, _ in rows))
    assert padded(w) is not None or all(padded(v) is None for v in range(1, top + 1))


def test_a_session_the_policy_gave_up_on_verifies_drafts_now_and_then() -> None:
    e = Explorer(base_patience=4, max_patience=16)
    taken = []
    for _ in range(40):
        n = e.adjust(0, lambda: 8)  # the policy always declines the 8 drafts on offer
        e.record(n, 8)
        taken.append(n)
    explored = [i for i, n in enumerate(taken) if n]
    assert explored == [4, 13, 30]  # after 4, then 8, then 16 declined passes
    # Once the policy itself verifies drafts again, the patience starts over.
    e.record(e.adjust(3, lambda: 8), 8)
    assert e.patience == 4 and e.declined == 0


def test_no_exploration_without_drafts_on_offer() -> None:
    e = Explorer()
    for _ in range(20):
        e.record(e.adjust(0, lambda: 0), 0)  # nothing offered: a plain step declines nothing
    assert e.declined == 0 and e.adjust(0, lambda: 5) == 0


# Mostly declined passes with drafts on offer, so that runs long enough to explore are common:
# drawn evenly, a chosen 0 came one time in nine and no example explored; so, about two in
# five do. The cap on the patience is the next test's.
PASSES = st.lists(st.tuples(st.sampled_from([0] * 40 + list(range(1, 9))), st.integers(0, 8)), max_size=300)


@given(PASSES)
def test_exploration_is_rare_and_never_overrides_a_choice(passes) -> None:
    """Never overrides a verification the policy chose; at least `base_patience` declined
    passes before each exploration; and never more than `max_patience` declines in a row."""
    e = Explorer(base_patience=4, max_patience=32)
    declined_run = 0
    for chosen, offered in passes:
        chosen = min(chosen, offered)
        n = e.adjust(chosen, lambda: offered)
        if chosen:
            assert n == chosen
        elif n:
            assert declined_run >= 4
        e.record(n, offered)
        declined_run = declined_run + 1 if (offered and not n) else (declined_run if not offered else 0)
        assert declined_run <= 32


def test_a_draft_that_stays_poor_is_explored_ever_less_often_up_to_the_cap() -> None:
    """Every pass declines its 4 drafts on offer and every exploration takes them (and so
    does not win the policy back): the waits double from the base patience to the cap."""
    e = Explorer(base_patience=4, max_patience=32)
    gaps, run = [], 0
    for _ in range(200):
        n = e.adjust(0, lambda: 4)
        if n:
            gaps.append(run)
            run = 0
        else:
            run += 1
        e.record(n, 4)
    assert gaps[:6] == [4, 8, 16, 32, 32, 32]


def test_pass_costs_follow_new_measurements() -> None:
    """The cost model memoises its lookups; a pass timed since must show in them."""
    costs = PassCostModel(weight=1.0)
    costs.observe(1, 0.01)
    costs.observe(8, 0.02)
    assert costs.cost(4) == pytest.approx(0.01 + 0.01 * 3 / 7)
    costs.observe(8, 0.09)
    assert costs.cost(4) == pytest.approx(0.01 + 0.08 * 3 / 7)


def test_with_one_size_timed_every_size_costs_what_it_cost() -> None:
    costs = PassCostModel()
    costs.observe(8, 0.02)
    assert costs.cost(1) == costs.cost(8) == costs.cost(32) == 0.02


def test_a_pass_timed_at_zero_leaves_every_plan_finite() -> None:
    """A clock that ticks coarsely times a pass at 0: plan and choose_drafts divided by it, and
    the worker's pick failed with ZeroDivisionError, taking the server down."""
    costs = PassCostModel()
    costs.observe(1, 0.0)
    costs.observe(4, 0.01)
    assert costs.cost(1) > 0
    drafts, wait = plan(3, 8, 0.8, costs, 10.0, 0.5)
    assert 0 <= drafts <= 8 and wait >= 0
    assert 0 <= choose_drafts(3, 8, 0.8, costs) <= 8
