"""Greedy losslessness of the protocol core under arbitrary interleavings (hypothesis)."""
from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from protocol_sim import VOCAB, Network, reference
from specsplit.protocol.messages import Verdict

ACTIONS = ["draft", "draft", "draft", "send", "branch", "up", "down", "verify", "reconnect"]


def play(net: Network, data: st.DataObject) -> None:
    """Random interleavings of the edge's, the network's and the server's actions, then a fair
    schedule to the end of the generation."""
    random_steps(net, data)
    net.finish()


def random_steps(net: Network, data: st.DataObject, most: int = 200) -> None:
    """Up to `most` of the edge's, the network's and the server's actions, in a random order."""
    steps = data.draw(st.integers(0, most), label="steps")
    for _ in range(steps):
        if net.edge.done is not None:
            break
        action = data.draw(st.sampled_from(ACTIONS))
        if action == "draft":
            net.draft()
        elif action == "send":
            net.send(data.draw(st.integers(1, 5), label="chunk"))
        elif action == "branch":
            net.branch(data.draw(st.integers(0, 7), label="offset"), data.draw(st.integers(1, 5), label="length"),
                       data.draw(st.booleans(), label="right"), data.draw(st.booleans(), label="another"))
        elif action == "up":
            net.deliver_up()
        elif action == "down":
            net.deliver_down()
        elif action == "verify":
            net.verify(data.draw(st.integers(0, 6), label="budget"))
        elif net.reconnects < 3:
            net.reconnect()
        net.check_candidates_came_from_the_edge()


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
    max_new=st.integers(1, 24),
    window=st.integers(1, 8),
    alpha=st.sampled_from([0.0, 0.3, 0.7, 0.9, 1.0]),
    salt=st.integers(0, 2**16),
    data=st.data(),
)
def test_committed_tokens_equal_target_greedy(prompt, max_new, window, alpha, salt, data) -> None:
    net = Network(prompt, max_new, window, alpha, salt)
    play(net, data)
    want = reference(prompt, max_new, net.max_context)
    assert net.edge.generated == want
    session = net.session
    assert session is not None and session.generated == want


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompts=st.lists(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6), min_size=2, max_size=3),
    max_new=st.integers(1, 16),
    window=st.integers(1, 8),
    alpha=st.sampled_from([0.0, 0.7, 1.0]),
    salt=st.integers(0, 2**16),
    data=st.data(),
)
def test_generations_one_after_another_on_one_stream(prompts, max_new, window, alpha, salt, data) -> None:
    """A stream that carries a device's generations one after another (a new Open after each
    Done, the last one's drafts still in flight) gives each what a stream of its own would."""
    net = Network(prompts[0], max_new, window, alpha, salt)
    for n, prompt in enumerate(prompts):
        if n:
            net.next_generation(prompt, max_new, stale=data.draw(st.integers(0, 3), label="stale"))
        play(net, data)
        assert net.edge.generated == reference(prompt, max_new, net.max_context)
        assert net.session is not None and net.session.generated == net.edge.generated


@settings(max_examples=100, deadline=None)
@given(
    prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
    window=st.integers(1, 8),
    salt=st.integers(0, 2**16),
)
def test_a_perfect_draft_is_always_accepted(prompt, window, salt) -> None:
    """With a draft equal to the target and no reconnects, no draft is ever wasted."""
    net = Network(prompt, 20, window, 1.0, salt)
    net.finish()
    assert net.edge.generated == reference(prompt, 20, net.max_context)
    assert net.session is not None and net.session.drafts_dropped == 0


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    prompt=st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=6),
    window=st.integers(1, 8),
    salt=st.integers(0, 2**16),
    data=st.data(),
)
def test_drafts_the_server_lost_are_sent_again(prompt, window, salt, data) -> None:
    """Whatever a random schedule left in flight or dropped (reconnects, stale chunks, wrong
    branches), a fair schedule after it puts the edge's drafts to use again: with a perfect
    draft, the server soon verifies drafts in every pass instead of stepping alone. An edge
    that lost track of what the server lost (neither starting again from the committed point
    at a reconnect nor resending what a verdict shows missing) would leave it stepping alone to
    the end, as lossless as ever: the committed tokens cannot show it."""
    net = Network(prompt, 40, window, 1.0, salt, max_context=128)
    random_steps(net, data, most=120)
    alone = 0  # fair rounds whose pass verified no draft: the server stepped alone
    while net.edge.done is None:
        net.draft()
        net.send(4)
        while net.up:
            net.deliver_up()
        sent = len(net.down)
        net.verify(4)
        alone += any(isinstance(m, Verdict) and m.proposed == 0 for m in list(net.down)[sent:])
        while net.down and net.edge.done is None:
            net.deliver_down()
    assert alone <= 2
    assert net.edge.generated == reference(prompt, 40, net.max_context)
