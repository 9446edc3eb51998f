"""The wait for a generation's first verdict is the prompt's prefill: a long prompt on a CPU
server takes minutes, and a stall timeout that did not allow for it re-opened the generation
again and again (each re-open prefilling the prompt again) until the edge gave up on a
server that was working all along."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from fake_server import fake_server
from specsplit.edge.attempt import PREFILL_ALLOWANCE_S
from specsplit.edge.client import ConnectOptions, EdgeConfig, StreamStalled, generate
from specsplit.protocol import codec
from specsplit.protocol.messages import Done, DoneReason, Opened, Verdict
from specsplit.v1 import specsplit_pb2 as pb

STALL_S = 0.5
PROMPT = list(range(1, 41))  # 40 tokens: the first verdict may take 0.5 s + 40 x the allowance


def _answers(first_s: float, second_s: float, opens: list[int]):  # type: ignore[no-untyped-def]
    """A server that sends Opened at once, its first verdict after `first_s` and its second
    after `second_s` more; nothing in between."""
    async def handler(requests, context):  # type: ignore[no-untyped-def]
        prompt = list(codec.edge_from_pb(pb.EdgeMessage.FromString(await anext(aiter(requests)))).prompt_ids)
        opens.append(len(prompt))
        yield codec.server_to_pb(Opened("s", "t", 4096, 8, 100)).SerializeToString()
        n = len(prompt)
        for delay, token in ((first_s, 5), (second_s, 6)):
            await asyncio.sleep(delay)
            yield codec.server_to_pb(Verdict(n, (token,), 0, 0, n + 1)).SerializeToString()
            n += 1
        yield codec.server_to_pb(Done(DoneReason.LENGTH, n)).SerializeToString()
    return handler


async def _generate(first_s: float, second_s: float, opens: list[int]) -> list[int]:
    server, address = await fake_server(_answers(first_s, second_s, opens))
    try:
        result = await generate(address, PROMPT, EdgeConfig(mode="none", max_new_tokens=2),
                                connect=ConnectOptions(stall_timeout_s=STALL_S, retries=0))
        return list(result.tokens)
    finally:
        await server.stop(None)


def test_a_first_verdict_past_the_stall_timeout_is_waited_for_by_the_prompt_s_length() -> None:
    assert 2 * STALL_S < STALL_S + len(PROMPT) * PREFILL_ALLOWANCE_S  # the wait below is within the allowance
    opens: list[int] = []
    assert asyncio.run(_generate(2 * STALL_S, 0.0, opens)) == [5, 6]
    assert opens == [len(PROMPT)]  # opened once: no re-open


def test_after_the_first_verdict_the_stall_timeout_is_its_own() -> None:
    with pytest.raises((StreamStalled, grpc.aio.AioRpcError)):
        asyncio.run(_generate(0.0, 4 * STALL_S, []))
