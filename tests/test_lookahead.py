"""The asynchronous edge's lookahead follows the acceptance it sees."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from specsplit.edge.lookahead import MIN_WINDOW, adaptive_window


def test_a_well_predicted_prompt_drafts_far_and_a_poorly_predicted_one_near() -> None:
    assert adaptive_window(0, 0, 32) == 10  # the prior, 0.8: runs of 4
    assert adaptive_window(94, 6, 32) == 30  # 94% (93% with the prior): runs of 14
    assert adaptive_window(94, 6, 16) == 16  # capped
    assert adaptive_window(65, 35, 32) == 6  # 65%: runs of ~2
    assert adaptive_window(10, 40, 32) == MIN_WINDOW


@given(st.integers(0, 10_000), st.integers(0, 10_000), st.integers(1, 64), st.integers(1, 50))
def test_the_window_stays_in_bounds_and_grows_with_acceptance(accepted, rejections, max_window, more) -> None:
    w = adaptive_window(accepted, rejections, max_window)
    assert min(MIN_WINDOW, max_window) <= w <= max_window
    assert adaptive_window(accepted + more, rejections, max_window) >= w
    assert adaptive_window(accepted, rejections + more, max_window) <= w
