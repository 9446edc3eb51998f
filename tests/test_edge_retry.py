"""Which failures an edge re-opens its generation after, how long it waits first, and where it goes."""
from __future__ import annotations

import asyncio

import grpc
import pytest

from specsplit.edge.client import EdgeConfig, StreamStalled, generate, retry_delay


def _refused(code: grpc.StatusCode, *trailing: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), "refused")


@pytest.mark.parametrize(("exc", "delay"), [
    (_refused(grpc.StatusCode.UNAVAILABLE), 0.5),
    (_refused(grpc.StatusCode.DEADLINE_EXCEEDED), 0.5),
    (_refused(grpc.StatusCode.INTERNAL), 0.5),  # a server's end racing the edge's writes reads so
    (grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                          "verification failed: out of memory"), None),  # the server's own failure
    (StreamStalled("nothing for 60 s"), 0.5),
    (ConnectionError("ended before Done"), 0.5),
    (_refused(grpc.StatusCode.RESOURCE_EXHAUSTED, ("grpc-retry-pushback-ms", "1500")), 1.5),
    (_refused(grpc.StatusCode.RESOURCE_EXHAUSTED, ("grpc-retry-pushback-ms", "100")), 0.5),  # never below the backoff
    (_refused(grpc.StatusCode.RESOURCE_EXHAUSTED), None),  # an oversized message: the same again anywhere
    (_refused(grpc.StatusCode.RESOURCE_EXHAUSTED, ("grpc-retry-pushback-ms", "soon")), None),
    (_refused(grpc.StatusCode.INVALID_ARGUMENT), None),
])
def test_retry_delay(exc: Exception, delay: float | None) -> None:
    assert retry_delay(exc, 0.5) == delay


def test_a_generation_needs_somewhere_to_go() -> None:
    with pytest.raises(ValueError, match="needs a server address"):
        asyncio.run(generate([], [1, 2, 3], EdgeConfig(mode="none")))
