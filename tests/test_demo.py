"""The demo's verdict on its two decodings."""
from __future__ import annotations

from demo import MIN_DRAFTS_JUDGED, problems


def test_the_demo_fails_on_differing_outputs_and_on_a_pair_that_agrees_on_nothing() -> None:
    good = {"token_ids": [1, 2, 3], "acceptance_rate": 0.8, "drafts_proposed": 100}
    assert problems(good, {"token_ids": [1, 2, 3]}) == []
    assert "differs" in problems(good, {"token_ids": [1, 2, 4]})[0]
    noise = {"token_ids": [7, 7, 7], "acceptance_rate": 0.0, "drafts_proposed": 100}  # equal noise both ways
    assert "wrong weights" in problems(noise, {"token_ids": [7, 7, 7]})[0]
    # Too few drafts to judge (a run of a token or two): no verdict on the weights.
    short = {"token_ids": [7], "acceptance_rate": 0.0, "drafts_proposed": MIN_DRAFTS_JUDGED - 1}
    assert problems(short, {"token_ids": [7]}) == []
