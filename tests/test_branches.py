"""Branches: alternatives the edge drafts beside its drafts, which the server verifies in the
same pass as the drafts they stand beside, or takes up as candidates when a correction
matches their first token (protocol core, drafter caches, branch choice)."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from specsplit.edge.branching import MIN_CHANCE, DraftChoice, choose_branch, draft_choice
from specsplit.edge.stats import GenerationStats
from specsplit.protocol import errors
from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.hashing import HashedSequence
from specsplit.protocol.messages import DraftChunk, OpenRequest, SamplingParams, Verdict, VerificationMode
from specsplit.protocol.server_session import MAX_BRANCHES, ServerSession, TaskBranch
from protocol_sim import VOCAB, target_logits, target_next, task_logits
from test_protocol_core import LIMITS, PROMPT, greedy_path, open_session, run_task


def wrong(token: int) -> int:
    return (token + 1) % VOCAB


def edge_with_drafts(drafts: list[int]) -> EdgeSession:
    e = EdgeSession(PROMPT, window=6)
    for t in drafts:
        e.push_draft(t)
    return e


def test_a_branch_is_verified_in_the_same_pass_as_the_draft_it_stands_beside() -> None:
    right = greedy_path(list(PROMPT), 6)  # what the target will commit
    e = edge_with_drafts([right[0], wrong(right[1]), 7, 7, 7])
    s = open_session()
    s.receive_draft(e.next_chunk())
    # The edge foresaw the rejection at position 4 and drafted on from the target's choice there.
    s.receive_draft(e.branch_chunk(4, [*right[1:4], wrong(right[4])]))
    task = s.next_task(6)
    assert task.drafts == (right[0], wrong(right[1]), 7, 7, 7)
    assert task.branches == (TaskBranch(4, (*right[1:4], wrong(right[4]))),)
    (verdict,) = s.apply(task, *task_logits(s, task))
    # The draft at 4 is rejected for the branch's first token, the branch holds for two more
    # and the row after them gives the correction: five tokens from one pass.
    assert verdict.tokens == tuple(right[:5]) and verdict.accepted == 3 and verdict.proposed == 8
    assert s.branches_verified == s.branches_taken == 1 and s.candidates == [] and verdict.branch_tokens == 0
    # Two drafts were wrong, the candidate at 4 and the branch's at 7: a per-position acceptance
    # counts both (it counted one, as accepted < proposed, and read high wherever branches were used).
    assert verdict.rejected == 2 and s.rejections == 2
    stats = GenerationStats("async")
    stats.add_verdict(verdict, 0.1)
    assert stats.rejections == 2
    assert e.apply_verdict(verdict) == 4
    assert e.tokens == [*PROMPT, *right[:5]] and e.branches_taken == 1 and e.branch is None


@pytest.mark.parametrize("same_position", [False, True])
def test_a_pass_verifies_every_branch_and_follows_the_one_the_target_takes(same_position) -> None:
    """Two branches beside the drafts, at two positions or with two first tokens at one: the
    pass feeds both, and verifies the one whose first token the target chooses where it
    rejects a draft; the other is left."""
    right = greedy_path(list(PROMPT), 6)
    if same_position:  # the target rejects the draft at 3; one branch there is right, one wrong
        drafts, taken, other = [wrong(right[0]), 7, 7, 7], (3, right[:3]), (3, [wrong(wrong(right[0])), 1])
    else:  # it rejects at 5; the branch at 4 stands beside a draft it accepts
        drafts, taken, other = [*right[:2], wrong(right[2]), 7, 7], (5, right[2:5]), (4, [wrong(right[1]), 2])
    e = edge_with_drafts(drafts)
    s = open_session()
    s.receive_draft(e.next_chunk())
    for at, tokens in (other, taken):  # the edge keeps one branch per position: the server, more
        s.receive_draft(DraftChunk(at, tuple(tokens), HashedSequence(e.tokens).hash_before(at), branch=True))
    task = s.next_task(6)
    fed = [(b.at, list(b.tokens)) for b in task.branches]
    assert sorted(fed) == fed and sorted(fed) == sorted([taken, other])
    (verdict,) = s.apply(task, *task_logits(s, task))
    assert s.branch_verified == fed.index(taken) and s.branches_verified == s.branches_taken == 1
    # Up to the rejection, the branch's tokens and the row after them.
    assert verdict.tokens == tuple(right[: taken[0] - len(PROMPT) + len(taken[1]) + 1])
    assert s.candidates == []


def test_a_branch_that_came_after_the_pass_began_becomes_the_candidates() -> None:
    right = greedy_path(list(PROMPT), 5)
    e = edge_with_drafts([right[0], wrong(right[1]), 7])
    s = open_session()
    s.receive_draft(e.next_chunk())
    task = s.next_task(6)
    s.receive_draft(e.branch_chunk(4, right[1:4]))
    (verdict,) = s.apply(task, target_logits(s.tokens, task.start, task.drafts))
    assert verdict.tokens == (right[0], right[1]) and verdict.branch_tokens == 2
    assert s.candidates == right[2:4] and s.branches_taken == 1 and s.branches_verified == 0
    assert e.apply_verdict(verdict) == 4
    assert e.tokens == [*PROMPT, *right[:4]] and e.sent_len == len(e.tokens) and e.branches_taken == 1
    assert e.next_chunk() is None  # the server holds all of it already
    (verdict,) = run_task(s, 6)
    assert verdict.accepted == 2
    e.apply_verdict(verdict)
    assert s.generated == e.generated == right


def test_the_edge_resends_what_the_server_lacks_of_a_branch_it_follows() -> None:
    right = greedy_path(list(PROMPT), 4)
    e = edge_with_drafts([right[0], wrong(right[1])])
    s = open_session()
    s.receive_draft(e.next_chunk())
    e.branch_chunk(4, right[1:4])  # still on its way when the pass ends
    (verdict,) = run_task(s, 6)
    assert verdict.tokens == (right[0], right[1]) and verdict.branch_tokens == 0
    e.apply_verdict(verdict)
    assert e.tokens == [*PROMPT, *right[:4]] and e.sent_len == e.committed_len
    s.receive_draft(e.next_chunk())
    assert s.candidates == right[2:4]


def test_a_branch_the_correction_does_not_match_is_left_unused() -> None:
    right = greedy_path(list(PROMPT), 3)
    e = edge_with_drafts([right[0], wrong(right[1])])
    s = open_session()
    s.receive_draft(e.next_chunk())
    s.receive_draft(e.branch_chunk(4, [wrong(wrong(right[1])), 1, 2]))
    (verdict,) = run_task(s, 6)
    assert verdict.tokens == tuple(right[:2]) and verdict.branch_tokens == 0 and s.candidates == []
    assert s.branches_verified == 0
    e.apply_verdict(verdict)
    assert e.tokens == [*PROMPT, *right[:2]] and e.branch is None


def test_a_branch_with_no_draft_beside_it_is_dropped() -> None:
    right = greedy_path(list(PROMPT), 3)
    e = edge_with_drafts([right[0], wrong(right[1])])
    s = open_session()
    main = e.next_chunk()
    # The branch overtakes the chunk it stands beside (say, the server had lost that chunk).
    s.receive_draft(e.branch_chunk(4, [right[1], right[2]]))
    assert s.drafts_dropped == 2
    s.receive_draft(main)
    (verdict,) = run_task(s, 6)
    assert verdict.tokens == tuple(right[:2]) and verdict.branch_tokens == 0
    e.apply_verdict(verdict)  # the edge follows its branch and sends it again as plain drafts
    assert e.tokens == [*PROMPT, *right[:3]] and e.sent_len == e.committed_len


def test_a_branch_is_not_taken_once_the_trajectory_before_it_changed() -> None:
    right = greedy_path(list(PROMPT), 3)
    e = edge_with_drafts([wrong(right[0]), 5, 6])
    s = open_session()
    s.receive_draft(e.next_chunk())
    # A branch at position 5 assumes the draft at 3 is accepted; it is not, so whatever the
    # correction at 5 later is, the branch's parent hash no longer matches.
    s.receive_draft(e.branch_chunk(5, [1, 2]))
    (verdict,) = run_task(s, 6)
    assert verdict.tokens == (right[0],) and verdict.branch_tokens == 0
    e.apply_verdict(verdict)
    assert e.branch is None


def test_the_server_keeps_a_bounded_number_of_branches() -> None:
    s = open_session(max_new=30)
    traj = HashedSequence([*PROMPT, *([1] * 6)])
    s.receive_draft(DraftChunk(3, (1,) * 6, traj.hash_before(3)))
    for start in range(3, 9):
        for first in (2, 3):
            s.receive_draft(DraftChunk(start, (first,), traj.hash_before(start), branch=True))
    assert len(s._branches) == MAX_BRANCHES and (8, 3) in s._branches and (3, 2) not in s._branches
    s.receive_draft(DraftChunk(8, (3, 4), traj.hash_before(8), branch=True))  # a longer one replaces it
    assert len(s._branches) == MAX_BRANCHES and s._branches[(8, 3)][1] == (3, 4)


def test_sparse_q_refuses_branches() -> None:
    s = ServerSession(
        OpenRequest(prompt_ids=PROMPT, max_new_tokens=8, sampling=SamplingParams(temperature=1.0),
                    verification=VerificationMode.SPARSE_Q),
        LIMITS,
        "s",
    )
    e = edge_with_drafts([1])
    e.next_chunk()
    with pytest.raises(errors.MalformedDraft, match="branch"):
        s.receive_draft(e.branch_chunk(3, [2, 3]))


def test_edge_branch_must_stand_beside_a_sent_draft() -> None:
    e = edge_with_drafts([1, 2])
    with pytest.raises(ValueError):
        e.branch_chunk(4, [3])  # drafted, not sent
    e.next_chunk()
    with pytest.raises(ValueError):
        e.branch_chunk(5, [3])  # no draft there
    with pytest.raises(ValueError):
        e.branch_chunk(4, [2])  # the same token as the draft
    e.branch_chunk(4, [3, 4])
    with pytest.raises(ValueError):
        e.branch_chunk(4, [3, 5])  # not an extension of the branch sent there


def choice(prob: float, runner_up_prob: float) -> DraftChoice:
    return DraftChoice(token=1, prob=prob, runner_up=2, runner_up_prob=runner_up_prob)


def test_branch_goes_where_a_rejection_is_likeliest_to_be_caught() -> None:
    # Draft 1 is unsure, but draft 0 is even less sure of itself than draft 1's runner-up counts.
    assert choose_branch([choice(0.95, 0.03), choice(0.5, 0.45), choice(0.9, 0.08)]) == 1  # 0.95 * 0.45
    assert choose_branch([choice(0.6, 0.38), choice(0.5, 0.45)]) == 0  # 0.38 beats 0.6 * 0.45
    # A second branch goes to the next likeliest place; none where no other is worth one.
    assert choose_branch([choice(0.6, 0.38), choice(0.5, 0.45)], taken=[0]) == 1
    assert choose_branch([choice(0.6, 0.38), choice(0.9, 0.05)], taken=[0]) is None
    assert choose_branch([choice(0.99, 0.005)] * 4) is None  # nothing is worth a branch
    # Past the point where the line is likelier wrong than MIN_CHANCE allows, nothing counts.
    assert choose_branch([choice(0.2, 0.05), choice(0.2, 0.05), choice(0.1, 0.9)]) is None
    assert 0.2 * 0.2 < MIN_CHANCE


def test_draft_choice_reads_top_two_probabilities() -> None:
    logits = np.log(np.array([0.1, 0.6, 0.05, 0.25]))
    c = draft_choice(logits)
    assert (c.token, c.runner_up) == (1, 3)
    assert c.prob == pytest.approx(0.6) and c.runner_up_prob == pytest.approx(0.25)


@given(st.lists(st.integers(-2, 2), min_size=2, max_size=12))
def test_draft_choice_drafts_what_argmax_drafts_and_a_runner_up_beside_it_on_ties(values) -> None:
    """Small integer logits tie often; a runner-up equal to the draft made the edge's branch
    refuse itself (a branch's first token must differ) and ended the generation."""
    logits = np.array(values, dtype=np.float32)
    c = draft_choice(logits)
    assert c.token == int(np.argmax(logits))
    assert c.runner_up != c.token
    assert logits[c.runner_up] == np.delete(logits, c.token).max()


def test_drafter_keeps_the_main_line_cache_while_drafting_a_branch(tiny) -> None:
    from specsplit.edge.drafter import OnnxDrafter

    drafter = OnnxDrafter(tiny.draft_dir)
    fed: list[int] = []
    run = drafter._session.run
    drafter._session.run = lambda names, feed: (fed.append(feed["input_ids"].shape[1]), run(names, feed))[1]
    main = [5, 6, 7, 8, 9, 10]
    for n in range(3, len(main) + 1):
        drafter.next_logits(main[:n])
    branch = [*main[:4], 20, 21]
    for n in (5, 6):
        got_branch = drafter.next_logits(branch[:n])
    fed.clear()
    got_main = drafter.next_logits([*main, 11])
    assert fed == [1]  # the main line's cache was still there: only the new token was fed
    fresh = OnnxDrafter(tiny.draft_dir)
    np.testing.assert_allclose(got_main, fresh.next_logits([*main, 11]), atol=1e-4)
    np.testing.assert_allclose(got_branch, fresh.next_logits(branch), atol=1e-4)


def test_a_batched_step_keeps_the_lines_its_rows_fork_off(tiny) -> None:
    """Three rows that each leave a line of their own (the main line after a change, two
    branches beside it) make three forks in one step: the drafter dropped the oldest cache at
    each fork, the line the last row forks off among them, so the step ran row by row, that
    row fed again from where the lines part."""
    from specsplit.edge.drafter import OnnxDrafter

    drafter = OnnxDrafter(tiny.draft_dir)
    prompt = [5, 6, 7]
    lines = {"x": [*prompt, 20, 21], "y": [*prompt, 30, 31], "main": [*prompt, 40, 41, 42]}
    for line in lines.values():
        drafter.next_logits(line)
    fed: list[tuple[int, int]] = []
    run = drafter._session.run
    drafter._session.run = lambda names, feed: (fed.append(feed["input_ids"].shape), run(names, feed))[1]
    rows = [[*prompt, 40, 41, 43], [*prompt, 20, 22], [*prompt, 30, 32]]
    got = drafter.next_logits_batch(rows)
    assert fed == [(3, 1)]  # one run, each row fed only its new token
    fresh = OnnxDrafter(tiny.draft_dir)
    for row, logits in zip(rows, got):
        np.testing.assert_allclose(logits, fresh.next_logits(row), atol=1e-4)
    fed.clear()
    drafter.next_logits([*rows[0], 44])
    assert fed == [(1, 1)]  # the main line's cache stayed


@pytest.mark.parametrize("holes_kept", [16, 0])  # 0: every single-row step drops the padding
def test_drafter_grows_line_and_branch_in_one_batched_run(tiny, monkeypatch, holes_kept) -> None:
    """next_logits_batch: one run of two rows, each fed only its new token over its own cache
    (the shorter one padded and masked), giving each line what it gets alone. (The tiny
    export is fp32, so to rounding; a quantized export's activations are quantized over both
    rows, which moves the logits a little: an int8 draft's argmax stayed over 40 steps.)
    Consecutive batched steps feed the last step's arrays as they are; the padding they keep
    stays masked through single steps and rollbacks of either line."""
    from specsplit.edge import drafter as drafter_mod
    from specsplit.edge.drafter import OnnxDrafter

    monkeypatch.setattr(drafter_mod, "HOLES_KEPT", holes_kept)
    drafter = OnnxDrafter(tiny.draft_dir)
    fresh = OnnxDrafter(tiny.draft_dir)

    def close(got: np.ndarray, line: list[int]) -> bool:
        want = fresh.next_logits(line)
        return bool(np.abs(got - want).max() < 1e-3 * np.abs(want).max())

    main, branch = [5, 6, 7, 8, 9, 10], [5, 6, 7, 20]
    drafter.next_logits(main)
    drafter.next_logits(branch)
    fed: list[dict] = []
    outputs: list[list[np.ndarray]] = []
    run = drafter._session.run

    def recording_run(names, feed):
        fed.append(feed)
        outputs.append(run(names, feed))
        return outputs[-1]

    drafter._session.run = recording_run
    for step in range(3):
        main, branch = [*main, 30 + step], [*branch, 40 + step]
        got_main, got_branch = drafter.next_logits_batch([main, branch])
        assert close(got_main, main) and close(got_branch, branch)
    assert [f["input_ids"].shape for f in fed] == [(2, 1)] * 3
    past = "past_key_values.0.key"
    assert all(fed[i][past] is outputs[i - 1][1] for i in (1, 2))  # no copy between batched steps
    main, branch = [*main, 33], [*branch, 43]
    got_branch, got_main = drafter.next_logits_batch([branch, main])  # either order keeps the rows
    assert fed[-1][past] is outputs[-2][1]
    assert close(got_main, main) and close(got_branch, branch)
    # The branch (row 1) was padded to the line's width: a single step, a rollback that cuts
    # through the tokens after the padding and a new batched step must still see only the
    # branch's own keys.
    branch = [*branch, 50]
    assert close(drafter.next_logits(branch), branch)
    holes = [c for c in drafter._caches if c.tokens == branch][0].mask.size - len(branch)
    assert holes == (2 if holes_kept else 0)
    branch = [*branch[:5], 60]
    assert close(drafter.next_logits(branch), branch)
    main, branch = [*main, 70], [*branch, 71]
    got_main, got_branch = drafter.next_logits_batch([main, branch])
    assert fed[-1]["input_ids"].shape == (2, 1)
    assert close(got_main, main) and close(got_branch, branch)
    # A second branch joins: three rows, padded together once, then fed as they are.
    other = [*main[:3], 80]
    drafter.next_logits(other)
    for step in range(2):
        main, branch, other = [*main, 90 + step], [*branch, 91 + step], [*other, 92 + step]
        got = drafter.next_logits_batch([main, other, branch])
        assert fed[-1]["input_ids"].shape == (3, 1)
        assert all(close(g, line) for g, line in zip(got, (main, other, branch)))
    assert fed[-1][past] is outputs[-2][1]
