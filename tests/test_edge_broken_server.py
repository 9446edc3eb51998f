"""A server that breaks the protocol (a bug, or a server of another build) fails the edge's
generation with a ProtocolError that says what it sent: not a ValueError deep in the edge's
session (taken for a setting of the user's own), and never an answer the edge accepted
though it could not be right."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from fake_server import fake_server
from specsplit.edge.client import ConnectOptions, EdgeConfig, generate
from specsplit.protocol import codec
from specsplit.protocol.errors import ProtocolError
from specsplit.protocol.messages import Done, DoneReason, Verdict
from specsplit.v1 import specsplit_pb2 as pb

PROMPT = [1, 2, 3]
VOCAB = 100


class _SameTokenDrafter:
    """Drafts token 9 again and again (no model): sync's drafts, which this server ignores."""

    def next_logits(self, trajectory):  # type: ignore[no-untyped-def]
        logits = np.zeros(VOCAB, dtype=np.float32)
        logits[9] = 1.0
        return logits


def _sending(*messages: pb.ServerMessage):  # type: ignore[no-untyped-def]
    """A server's Generate that reads the Open, sends `messages`, then idles until the edge goes."""
    async def handler(requests, context):  # type: ignore[no-untyped-def]
        await anext(aiter(requests))
        for message in messages:
            yield message.SerializeToString()
        await asyncio.sleep(10)
    return handler


def _opened(max_context: int = 4096, max_lookahead: int = 8) -> pb.ServerMessage:
    return pb.ServerMessage(opened=pb.Opened(session_id="s", target_model="t", max_context=max_context,
                                             max_lookahead=max_lookahead, vocab_size=VOCAB))


def _verdict(*tokens: int) -> pb.ServerMessage:
    n = len(PROMPT)
    return codec.server_to_pb(Verdict(n, tokens, 0, 0, n + len(tokens)))


async def _generate(mode: str, *messages: pb.ServerMessage) -> None:
    server, address = await fake_server(_sending(*messages))
    try:
        await asyncio.wait_for(generate(address, PROMPT, EdgeConfig(mode=mode, max_new_tokens=2),
                                        drafter=None if mode == "none" else _SameTokenDrafter(),  # type: ignore[arg-type]
                                        connect=ConnectOptions(stall_timeout_s=5, retries=0)), 20)
    finally:
        await server.stop(None)


@pytest.mark.parametrize(("messages", "said"), [
    # A lookahead of 0 raised ValueError("the lookahead window must be at least 1") in the edge's session.
    ((_opened(max_lookahead=0),), "allows a lookahead of 0"),
    ((_opened(max_context=1),), "a context of 1 tokens"),
    # Accepted without a word, the verdict moved nothing; the edge waited on.
    ((_opened(), pb.ServerMessage(verdict=pb.Verdict(start=len(PROMPT)))), "commits no token"),
    # Accepted: the edge printed more than --max-new-tokens.
    ((_opened(), _verdict(5, 6, 7)), "commits past the generation's end at 5"),
    # Ignored: the session went on as if nothing had come.
    ((_opened(), _opened()), "a second Opened in one session"),
])
@pytest.mark.parametrize("mode", ["none", "sync"])
def test_a_server_that_breaks_the_protocol_fails_the_generation_saying_how(messages, said, mode) -> None:
    with pytest.raises(ProtocolError, match=said):
        asyncio.run(_generate(mode, *messages))


def test_a_server_keeping_to_the_protocol_is_served_by_the_same_script() -> None:
    """The script's own control: an Opened, a verdict of the two tokens asked for, a Done."""
    asyncio.run(_generate("none", _opened(), _verdict(5, 6), codec.server_to_pb(Done(DoneReason.LENGTH, len(PROMPT) + 2))))


def test_the_edge_command_line_ends_on_a_broken_server_with_the_server_s_exit_status(tiny) -> None:
    """1, as for a lost server, not 2, which says the user's own settings were refused."""
    import subprocess
    import sys
    import threading

    loop, ready = asyncio.new_event_loop(), threading.Event()
    served: dict = {}

    def serve() -> None:
        served["server"], served["address"] = loop.run_until_complete(fake_server(_sending(_opened(max_lookahead=0))))
        ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    assert ready.wait(30)
    try:
        proc = subprocess.run([sys.executable, "-m", "specsplit.edge.cli", "generate", "--server", served["address"],
                               "--draft", str(tiny.draft_dir), "--mode", "none", "--retries", "0", "hello"],
                              capture_output=True, text=True, timeout=120)
    finally:
        asyncio.run_coroutine_threadsafe(served["server"].stop(None), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(30)
    assert proc.returncode == 1 and "error: the server's Opened allows a lookahead of 0" in proc.stderr, proc.stderr
