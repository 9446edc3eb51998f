"""Deterministic cases of the protocol core: admission, rollback, termination, violations."""
from __future__ import annotations

import dataclasses

import pytest

from specsplit.protocol import errors
from specsplit.protocol.edge_session import EdgeSession
from specsplit.protocol.hashing import HashedSequence, mix
from specsplit.protocol.messages import (
    Close,
    Done,
    DoneReason,
    DraftChunk,
    OpenRequest,
    SamplingParams,
    ServerLimits,
    SparseDist,
    Verdict,
    VerificationMode,
)
from specsplit.protocol.server_session import ServerConnection, ServerSession
from specsplit.protocol.trajectory import draft_end_for
from protocol_sim import EOS, VOCAB, target_next, task_logits

LIMITS = ServerLimits(vocab_size=VOCAB, max_context=40, max_lookahead=8, max_chunk=6, eos_ids=(EOS,))
PROMPT = (3, 4, 5)


def open_session(**kw) -> ServerSession:
    return ServerSession(OpenRequest(prompt_ids=PROMPT, max_new_tokens=kw.pop("max_new", 20), **kw), LIMITS, "s")


def greedy_path(prefix: list[int], n: int) -> list[int]:
    seq = list(prefix)
    for _ in range(n):
        seq.append(target_next(seq))
    return seq[len(prefix):]


def chunk_on(trajectory: list[int], start: int, end: int) -> DraftChunk:
    seq = HashedSequence(trajectory)
    return DraftChunk(start, tuple(trajectory[start:end]), seq.hash_before(start))


def run_task(s: ServerSession, budget: int):
    task = s.next_task(budget)
    return s.apply(task, *task_logits(s, task))


def test_hash_chain_matches_incremental_mix() -> None:
    seq = HashedSequence([1, 2, 3])
    h = 0x243F6A8885A308D3
    for t in [1, 2, 3]:
        h = mix(h, t)
    assert seq.hashes[-1] == h
    seq.truncate(1)
    seq.extend([2, 3])
    assert seq.hashes[-1] == h


def test_verdict_that_confirms_an_in_flight_chunk_keeps_it() -> None:
    s = open_session()
    good = greedy_path(list(PROMPT), 3)  # a, b, c: all what the target wants
    traj = list(PROMPT) + good
    s.receive_draft(chunk_on(traj, 3, 4))  # [a] arrives
    # The server verifies [a]: accepts it, and its bonus token equals b, the edge's next draft.
    (verdict,) = run_task(s, 4)
    assert verdict.tokens == (good[0], good[1]) and verdict.accepted == 1
    # [b, c] was in flight, drafted on a trajectory the verdict confirmed: c is kept.
    assert s.receive_draft(chunk_on(traj, 4, 6)) == 1
    assert s.candidates == [good[2]]
    assert s.drafts_dropped == 0


def test_verdict_that_contradicts_an_in_flight_chunk_drops_it() -> None:
    s = open_session()
    a = target_next(list(PROMPT))
    wrong_b = (target_next(list(PROMPT) + [a]) + 1) % VOCAB
    traj = list(PROMPT) + [a, wrong_b, 7]
    s.receive_draft(chunk_on(traj, 3, 4))
    (verdict,) = run_task(s, 4)  # commits a and the target's b, not wrong_b
    assert verdict.tokens[1] != wrong_b
    assert s.receive_draft(chunk_on(traj, 4, 6)) == 0
    assert s.candidates == []
    assert s.drafts_dropped == 2


def test_chunk_with_wrong_parent_hash_is_dropped_not_an_error() -> None:
    s = open_session()
    chunk = DraftChunk(3, (1, 2), parent_hash=12345)
    assert s.receive_draft(chunk) == 0
    assert s.candidates == [] and s.drafts_dropped == 2


def test_redrafted_trajectory_replaces_stale_candidates() -> None:
    s = open_session()
    s.receive_draft(chunk_on(list(PROMPT) + [1, 2, 3], 3, 6))
    s.receive_draft(chunk_on(list(PROMPT) + [1, 9], 3, 5))
    assert s.candidates == [1, 9]


def test_edge_rolls_back_on_contradiction_and_resends_from_committed_point() -> None:
    e = EdgeSession(PROMPT, window=4)
    for t in (1, 2, 3):
        e.push_draft(t)
    assert e.next_chunk().tokens == (1, 2, 3)
    resync = e.apply_verdict(Verdict(start=3, tokens=(1, 5), accepted=1, proposed=2, candidate_tip=5))
    assert resync == 4 and e.tokens == [3, 4, 5, 1, 5] and e.committed_len == 5
    assert e.wasted == 2 and e.sent_len == 5
    e.push_draft(6)
    assert e.next_chunk().start == 5


def test_edge_keeps_speculation_a_verdict_confirms() -> None:
    e = EdgeSession(PROMPT, window=4)
    for t in (1, 2, 3):
        e.push_draft(t)
    e.next_chunk()
    assert e.apply_verdict(Verdict(start=3, tokens=(1, 2), accepted=1, proposed=1, candidate_tip=6, chunks_received=1)) is None
    assert e.tokens == [3, 4, 5, 1, 2, 3] and e.committed_len == 5 and e.room() == 3


def test_edge_resends_what_the_server_reports_lost() -> None:
    e = EdgeSession(PROMPT, window=4)
    for t in (1, 2, 3):
        e.push_draft(t)
    e.next_chunk()
    # The server had received the chunk but holds nothing past the commit: it lost it.
    e.apply_verdict(Verdict(start=3, tokens=(1,), accepted=1, proposed=1, candidate_tip=4, chunks_received=1))
    chunk = e.next_chunk()
    assert chunk is not None and chunk.start == 4 and chunk.tokens == (2, 3) and e.resends == 1


@pytest.mark.parametrize("max_new, context, drafts", [(1, 100, 0), (2, 100, 1), (4, 100, 3), (8, 100, 6), (8, 6, 2)])
def test_the_edge_drafts_nothing_the_server_would_not_verify(max_new, context, drafts) -> None:
    """The last token of a generation (or of the context) is always the target's: a draft
    there, or past it, is drafting thrown away. Both sides count where that starts alike."""
    end = draft_end_for(len(PROMPT), max_new, context)
    e = EdgeSession(PROMPT, window=6, draft_end=end)
    while e.room() > 0:
        e.push_draft(1)
    assert e.speculative == drafts
    s = ServerSession(OpenRequest(prompt_ids=PROMPT, max_new_tokens=max_new),
                      dataclasses.replace(LIMITS, max_context=context))
    assert e.speculative == min(e.window, s.draft_room)  # the server verifies every one the edge drafts


def test_edge_rejects_out_of_order_verdict() -> None:
    e = EdgeSession(PROMPT, window=2)
    with pytest.raises(errors.VerdictOutOfOrder):
        e.apply_verdict(Verdict(start=5, tokens=(1,), accepted=0, proposed=0, candidate_tip=6))


def test_the_edge_session_takes_nothing_after_its_done() -> None:
    """A verdict after Done moved the committed point past what Done said; a second Done
    replaced the first; drafting after Done claimed the window was full."""
    e = EdgeSession(PROMPT, window=2)
    e.apply_verdict(Verdict(start=3, tokens=(1,), accepted=0, proposed=0, candidate_tip=4))
    e.apply_done(Done(DoneReason.LENGTH, 4))
    with pytest.raises(errors.VerdictOutOfOrder, match="after the session's Done"):
        e.apply_verdict(Verdict(start=4, tokens=(2,), accepted=0, proposed=0, candidate_tip=5))
    with pytest.raises(errors.VerdictOutOfOrder, match="a second Done"):
        e.apply_done(Done(DoneReason.EOS, 4))
    with pytest.raises(ValueError, match="the generation is over"):
        e.push_draft(3)
    assert e.committed_len == 4 and e.done == Done(DoneReason.LENGTH, 4)


def test_numpy_token_ids_hash_as_ints() -> None:
    import numpy as np

    ints = HashedSequence([3, 4, 5])
    assert HashedSequence(np.asarray([3, 4, 5], dtype=np.int64)).hashes == ints.hashes  # was: OverflowError
    assert EdgeSession(np.asarray(PROMPT), window=2).tip == EdgeSession(PROMPT, window=2).tip


def test_the_edge_session_refuses_an_empty_prompt_and_empty_chunks() -> None:
    with pytest.raises(ValueError, match="needs a prompt"):
        EdgeSession([], window=2)
    e = EdgeSession(PROMPT, window=2)
    e.push_draft(1)
    for bad in (0, -1):  # an empty chunk the server refuses, or one that moved sent_len back
        with pytest.raises(ValueError, match="at least one token"):
            e.next_chunk(bad)
    assert e.sent_len == e.committed_len and e.next_chunk(1) is not None


@pytest.mark.parametrize(
    ("kw", "reason", "length"),
    [
        ({"max_new": 3}, DoneReason.LENGTH, 3),
        ({"stop_ids": None}, DoneReason.STOP, None),
    ],
)
def test_termination(kw, reason, length) -> None:
    path = greedy_path(list(PROMPT), 6)
    if kw.get("stop_ids", 0) is None:
        kw = {"stop_ids": (path[1],)}
        length = path.index(path[1]) + 1
    s = open_session(**kw)
    events = []
    while s.done is None:
        events += run_task(s, 4)
    assert s.generated == path[:length]
    assert isinstance(events[-1], Done) and events[-1].reason == reason


@pytest.mark.parametrize(("prompt", "reason", "length"), [
    ((1, 1, 2), DoneReason.EOS, 2),  # the fake target's path from here is 8, EOS
    (PROMPT, DoneReason.CONTEXT, 3),  # 7, 10, 8: no EOS before the context (6) is full
])
def test_eos_and_context_end_the_session(prompt, reason, length) -> None:
    limits = ServerLimits(vocab_size=VOCAB, max_context=6, max_lookahead=8, eos_ids=(EOS,))
    s = ServerSession(OpenRequest(prompt_ids=prompt, max_new_tokens=20), limits)
    while s.done is None:
        run_task(s, 8)
    assert s.generated == greedy_path(list(prompt), 3)[:length]
    assert s.done.reason == reason
    assert (EOS in s.generated) == (reason == DoneReason.EOS)


# -- one test per protocol violation ----------------------------------------------


def test_draft_before_open() -> None:
    with pytest.raises(errors.DraftBeforeOpen) as exc:
        ServerConnection(LIMITS, "s").receive(DraftChunk(3, (1,), 0))
    assert exc.value.status == "FAILED_PRECONDITION"


def test_second_open() -> None:
    conn = ServerConnection(LIMITS, "s")
    conn.receive(OpenRequest(prompt_ids=PROMPT, max_new_tokens=4))
    with pytest.raises(errors.SecondOpen) as exc:
        conn.receive(OpenRequest(prompt_ids=PROMPT, max_new_tokens=4))
    assert exc.value.status == "FAILED_PRECONDITION"


def test_an_open_after_done_starts_the_streams_next_session() -> None:
    conn = ServerConnection(LIMITS, "s")
    conn.receive(OpenRequest(prompt_ids=PROMPT, max_new_tokens=4))
    first = conn.session
    conn.receive(Close())
    assert conn.idle
    stale = DraftChunk(len(PROMPT), (1, 2), HashedSequence(PROMPT).hash_before(len(PROMPT)))
    assert conn.receive(stale) == [] and first.candidate_count == 0  # a done session ignores drafts
    (opened,) = conn.receive(OpenRequest(prompt_ids=(5, 6), max_new_tokens=4))
    assert opened.session_id == "s.2" and conn.session is not first and conn.session.tokens == [5, 6]
    assert not conn.idle
    with pytest.raises(errors.SecondOpen):
        conn.receive(OpenRequest(prompt_ids=PROMPT, max_new_tokens=4))


def test_close_cancels() -> None:
    conn = ServerConnection(LIMITS, "s")
    conn.receive(OpenRequest(prompt_ids=PROMPT, max_new_tokens=4))
    (done,) = conn.receive(Close())
    assert done.reason == DoneReason.CANCELLED and conn.session.next_task(4) is None


@pytest.mark.parametrize("bad", [VOCAB, VOCAB + 100, -1])
def test_token_outside_vocabulary(bad) -> None:
    s = open_session()
    with pytest.raises(errors.TokenOutOfVocab) as exc:
        s.receive_draft(DraftChunk(3, (1, bad), s.tokens and HashedSequence(PROMPT).hash_before(3)))
    assert exc.value.status == "INVALID_ARGUMENT"
    with pytest.raises(errors.TokenOutOfVocab):
        open_session(stop_ids=(bad,))


def test_prompt_token_outside_vocabulary() -> None:
    with pytest.raises(errors.TokenOutOfVocab):
        ServerSession(OpenRequest(prompt_ids=(1, VOCAB), max_new_tokens=4), LIMITS)


def test_position_behind_committed_point() -> None:
    s = open_session()
    with pytest.raises(errors.PositionBehindCommitted) as exc:
        s.receive_draft(chunk_on(list(PROMPT) + [1], 2, 4))
    assert exc.value.status == "OUT_OF_RANGE"


def test_position_beyond_the_window() -> None:
    s = open_session()
    traj = list(PROMPT) + [1] * 10
    s.receive_draft(chunk_on(traj, 3, 9))
    with pytest.raises(errors.BeyondLookahead) as exc:
        s.receive_draft(chunk_on(traj, 9, 12))  # ends at 12 > 3 + 8
    assert exc.value.status == "OUT_OF_RANGE"


def test_oversize_chunk_and_empty_chunk() -> None:
    s = open_session()
    with pytest.raises(errors.DraftTooLarge):
        s.receive_draft(chunk_on(list(PROMPT) + [1] * 7, 3, 10))
    with pytest.raises(errors.MalformedDraft):
        s.receive_draft(DraftChunk(3, (), 0))


def test_oversize_prompt() -> None:
    with pytest.raises(errors.PromptTooLong) as exc:
        ServerSession(OpenRequest(prompt_ids=(1,) * 40, max_new_tokens=4), LIMITS)
    assert exc.value.status == "OUT_OF_RANGE"


@pytest.mark.parametrize(
    "sampling",
    [
        SamplingParams(temperature=-1.0),
        SamplingParams(temperature=float("nan")),
        SamplingParams(temperature=1.0, top_p=1.5),
        SamplingParams(temperature=1.0, top_k=-3),
        SamplingParams(temperature=1.0, top_k=2**32),  # the wire's field has 32 bits
        SamplingParams(temperature=1e-46),  # 0 on the wire: greedy to the server, sampled to the edge
    ],
)
def test_absurd_sampling_values(sampling) -> None:
    with pytest.raises(errors.InvalidOpen):
        open_session(sampling=sampling)


def test_empty_prompt_and_zero_max_new() -> None:
    with pytest.raises(errors.InvalidOpen):
        ServerSession(OpenRequest(prompt_ids=(), max_new_tokens=4), LIMITS)
    with pytest.raises(errors.InvalidOpen):
        open_session(max_new=0)


def test_fingerprint_mismatch_names_both_models() -> None:
    limits = ServerLimits(vocab_size=VOCAB, max_context=40, target_model="big", tokenizer_fingerprint="aaa")
    with pytest.raises(errors.FingerprintMismatch) as exc:
        ServerSession(
            OpenRequest(prompt_ids=PROMPT, max_new_tokens=4, draft_model="small", tokenizer_fingerprint="bbb"),
            limits,
        )
    assert exc.value.status == "FAILED_PRECONDITION"
    assert "small" in exc.value.message and "big" in exc.value.message


def test_a_clients_text_in_a_refusal_can_neither_forge_log_lines_nor_swell_them() -> None:
    """The draft's name and fingerprint are the client's own text: pasted in as sent, a line
    end forged a log line of the server's, and a name of 500 kB made a line and a status of
    500 kB."""
    limits = ServerLimits(vocab_size=VOCAB, max_context=40, target_model="big", tokenizer_fingerprint="aaa")
    forged = "d\n2026-12-03 09:30:00,000 INFO specsplit.server.service: session x: opened" + "x" * 500_000
    with pytest.raises(errors.FingerprintMismatch) as exc:
        ServerSession(OpenRequest(prompt_ids=PROMPT, max_new_tokens=4, draft_model=forged,
                                  tokenizer_fingerprint="\r" * 100_000), limits)
    message = exc.value.message
    assert "\n" not in message and "\r" not in message and len(message) < 500
    assert "draft model d\\n2026-12-03" in message  # escaped, still readable


def test_sparse_q_needs_valid_distributions() -> None:
    s = open_session(sampling=SamplingParams(temperature=1.0), verification=VerificationMode.SPARSE_Q)
    parent = HashedSequence(PROMPT).hash_before(3)
    with pytest.raises(errors.MalformedDraft):
        s.receive_draft(DraftChunk(3, (1,), parent))  # no distribution
    with pytest.raises(errors.MalformedDraft):
        s.receive_draft(DraftChunk(3, (1,), parent, (SparseDist((2, 3), (0.5, 0.5)),)))  # token not in it
    with pytest.raises(errors.MalformedDraft):
        s.receive_draft(DraftChunk(3, (1,), parent, (SparseDist((1, 3), (0.9, 0.9)),)))  # sums over 1
    # The top of a larger distribution, as it stood: accepted too often, the output biased (was: taken)
    with pytest.raises(errors.MalformedDraft, match="sum to 0.6000, not 1"):
        s.receive_draft(DraftChunk(3, (1,), parent, (SparseDist((1, 3), (0.36, 0.24)),)))
    with pytest.raises(errors.MalformedDraft, match="twice"):
        s.receive_draft(DraftChunk(3, (1,), parent, (SparseDist((1, 3, 1), (0.4, 0.2, 0.3)),)))  # 1 named twice
    assert s.receive_draft(DraftChunk(3, (1,), parent, (SparseDist((1, 3), (0.6, 0.4)),))) == 1


def test_resumed_session_continues_from_committed_prefix() -> None:
    path = greedy_path(list(PROMPT), 8)
    s = ServerSession(OpenRequest(prompt_ids=PROMPT, max_new_tokens=8, committed_ids=tuple(path[:3])), LIMITS)
    with pytest.raises(errors.PositionBehindCommitted):
        s.receive_draft(chunk_on(list(PROMPT) + path, 5, 7))
    while s.done is None:
        run_task(s, 2)
    want = path[: path.index(EOS) + 1] if EOS in path else path
    assert s.generated == want


def test_stop_ids_and_distributions_are_bounded() -> None:
    """A million stop ids, looked up for every committed token on the server's loop, held up
    every session (about 7 ms a token); so would distributions of a million ids."""
    from specsplit.protocol.messages import MAX_DIST_IDS, MAX_STOP_IDS

    with pytest.raises(errors.InvalidOpen, match=f"65 stop ids exceed the limit of {MAX_STOP_IDS}"):
        ServerSession(OpenRequest((1, 2), 4, stop_ids=tuple(range(1, 66))), ServerLimits(vocab_size=100, max_context=64))
    ServerSession(OpenRequest((1, 2), 4, stop_ids=tuple(range(1, 65))), ServerLimits(vocab_size=100, max_context=64))
    sampled = OpenRequest((1, 2), 4, sampling=SamplingParams(temperature=1.0), verification=VerificationMode.SPARSE_Q)
    session = ServerSession(sampled, ServerLimits(vocab_size=1000, max_context=64))
    wide = SparseDist(tuple(range(MAX_DIST_IDS + 1)), tuple([1.0 / (MAX_DIST_IDS + 1)] * (MAX_DIST_IDS + 1)))
    with pytest.raises(errors.MalformedDraft, match=f"exceeds the limit of {MAX_DIST_IDS}"):
        session.receive_draft(DraftChunk(2, (3,), HashedSequence((1, 2)).hash_before(2), (wide,)))


def test_an_open_is_refused_by_its_lengths_before_its_ids_are_walked() -> None:
    """A million committed ids (a resumed Open, under the message limit) were walked, hashed and
    checked on the server's loop, 0.4 s of it, though they could only end the session at once."""
    limits = ServerLimits(vocab_size=100, max_context=64, max_new_tokens=32)
    with pytest.raises(errors.InvalidOpen, match="committed_ids of 33 tokens exceed this server's max_new_tokens"):
        ServerSession(OpenRequest((1, 2), 4, committed_ids=(1,) * 33), limits)
    with pytest.raises(errors.PromptTooLong, match="prompt of 64 tokens"):
        ServerSession(OpenRequest((1,) * 63 + (10**6,), 4), limits)  # too long, before its bad id is seen


@pytest.mark.parametrize(("committed", "max_new", "error", "message"), [
    # Each was taken: a session 4 tokens past the context (Done at once, committed_length 44),
    # one past its own max_new_tokens, one that went on generating after its end-of-sequence.
    ((6,) * 8, 8, errors.PromptTooLong, "exceed the target's context of 40"),
    ((6,) * 3, 2, errors.InvalidOpen, "committed_ids of 3 tokens exceed the generation's max_new_tokens of 2"),
    ((6, EOS, 7), 8, errors.InvalidOpen, "stop token before their last"),
    ((6, 9, 7), 8, errors.InvalidOpen, "stop token before their last"),  # 9: a stop id
])
def test_a_resumed_open_no_generation_could_have_committed_is_refused(committed, max_new, error, message) -> None:
    prompt = (3,) * 36
    with pytest.raises(error, match=message):
        ServerSession(OpenRequest(prompt, max_new, committed_ids=committed, stop_ids=(9,)), LIMITS)


@pytest.mark.parametrize(("committed", "reason"), [((6,) * 4, DoneReason.CONTEXT), ((6, 6, EOS), DoneReason.EOS)])
def test_a_resumed_open_whose_done_was_lost_ends_at_once(committed, reason) -> None:
    """At the context's end, or ending at its end-of-sequence: what a generation whose Done
    was lost on the way resumes with."""
    session = ServerSession(OpenRequest((3,) * 36, 8, committed_ids=committed), LIMITS)
    assert session.done is not None and session.done.reason is reason


def test_a_done_reason_this_side_does_not_know_is_a_protocol_error() -> None:
    """A newer server's reason: the edge's callers handle ProtocolError (before: a bare ValueError)."""
    from specsplit.protocol import codec
    from specsplit.v1 import specsplit_pb2 as pb

    known = codec.server_from_pb(pb.ServerMessage(done=pb.Done(reason=int(DoneReason.EOS), committed_length=3)))
    assert known.reason is DoneReason.EOS
    with pytest.raises(errors.ProtocolError, match="unknown done reason 99"):
        codec.server_from_pb(pb.ServerMessage(done=pb.Done(reason=99, committed_length=3)))


def test_a_verdicts_rejections_cross_the_wire_and_an_older_servers_are_inferred() -> None:
    """Verdict.rejected counts a followed branch's rejection too; a server older than the field
    sends none, and the edge counts as it did, one where fewer drafts were taken than looked at."""
    from specsplit.protocol import codec
    from specsplit.v1 import specsplit_pb2 as pb

    two = Verdict(start=3, tokens=(1, 2, 3), accepted=1, proposed=5, candidate_tip=6, rejected=2)
    assert codec.server_from_pb(codec.server_to_pb(two)) == two
    none = Verdict(start=3, tokens=(1, 2), accepted=1, proposed=1, candidate_tip=5, rejected=0)
    assert codec.server_from_pb(codec.server_to_pb(none)) == none
    for accepted, proposed, inferred in ((1, 3, 1), (2, 2, 0), (0, 0, 0)):
        older = pb.ServerMessage(verdict=pb.Verdict(start=3, tokens=[1] * (accepted + 1), accepted=accepted,
                                                    proposed=proposed, candidate_tip=5))
        assert codec.server_from_pb(older).rejected == inferred


def test_the_edge_drafts_nothing_past_a_drafted_end_token_until_a_verdict_settles_it() -> None:
    e = EdgeSession(PROMPT, window=6, end_ids=(9,))
    e.push_draft(1)
    assert e.room() == 5
    e.push_draft(9)  # an end token: accepted, the generation ends; rejected, the line is cut before it
    assert e.room() == 0
    with pytest.raises(ValueError, match="window is full"):
        e.push_draft(2)
    e.next_chunk()
    # The target rejects it for 5: the line goes on from there, with room again.
    e.apply_verdict(Verdict(start=3, tokens=(1, 5), accepted=1, proposed=2, candidate_tip=5, chunks_received=1,
                            rejected=1))
    assert e.tokens == [3, 4, 5, 1, 5] and e.room() == 6
