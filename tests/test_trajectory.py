"""The trajectory both sides keep (protocol/trajectory.py), under any sequence of edits."""
from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsplit.protocol.hashing import HashedSequence
from specsplit.protocol.messages import SparseDist
from specsplit.protocol.trajectory import Trajectory

tokens = st.lists(st.integers(0, 5), max_size=6)
edits = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, 5)),
        st.tuples(st.just("cut"), st.integers(0, 8)),
        st.tuples(st.just("replace_from"), st.integers(0, 8), tokens),
        st.tuples(st.just("commit"), tokens),
    ),
    max_size=30,
)


@given(st.lists(st.integers(0, 5), min_size=1, max_size=4), edits)
def test_edits_keep_hashes_dists_and_the_committed_prefix(prompt: list[int], steps: list[tuple]) -> None:
    line = Trajectory(prompt)
    model: list[int] = list(prompt)  # what the tokens should be
    model_dists: dict[int, SparseDist] = {}  # position -> the dist pushed there, while it stands
    for step in steps:
        committed = list(line.tokens[: line.committed_len])
        if step[0] == "push":
            dist = SparseDist((step[1],), (1.0,))
            line.push(step[1], dist)
            model_dists[len(model)] = dist
            model.append(step[1])
        elif step[0] in ("cut", "replace_from"):
            at = line.committed_len + step[1]
            if at > len(line):
                continue
            if step[0] == "cut":
                new = []
                line.cut(at)
            else:
                new = step[2]
                line.replace_from(at, new)
            model = [*model[:at], *new]
            model_dists = {p: d for p, d in model_dists.items() if p < at}
        else:
            new = step[1]
            start = line.committed_len
            expected_agree = 0
            while expected_agree < len(new) and start + expected_agree < len(model) \
                    and model[start + expected_agree] == new[expected_agree]:
                expected_agree += 1
            assert line.commit(new) == expected_agree
            if expected_agree < len(new):
                model = [*model[: start + expected_agree], *new[expected_agree:]]
                model_dists = {p: d for p, d in model_dists.items() if p < start + expected_agree}
            assert line.committed_len == start + len(new)
        assert line.tokens == model
        assert line.tokens[: len(committed)] == committed  # nothing committed ever changes
        assert line.hashes == HashedSequence(model).hashes
        assert line.speculative == len(model) - line.committed_len
        assert line.dists(line.committed_len, len(line)) == [
            model_dists.get(p) for p in range(line.committed_len, len(model))
        ]


def test_cut_refuses_a_committed_position() -> None:
    line = Trajectory([1, 2, 3])
    line.push(4)
    with pytest.raises(ValueError, match="inside the committed"):
        line.cut(2)
