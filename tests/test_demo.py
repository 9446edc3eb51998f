"""The demo's verdict on its two decodings."""
from __future__ import annotations

from demo import problems


def test_the_demo_fails_on_differing_outputs_and_on_a_pair_that_agrees_on_nothing() -> None:
    good = {"token_ids": [1, 2, 3], "acceptance_rate": 0.8}
    assert problems(good, {"token_ids": [1, 2, 3]}) == []
    assert "differs" in problems(good, {"token_ids": [1, 2, 4]})[0]
    noise = {"token_ids": [7, 7, 7], "acceptance_rate": 0.0}  # a random target: equal noise both ways
    assert "wrong weights" in problems(noise, {"token_ids": [7, 7, 7]})[0]
