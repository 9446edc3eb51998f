"""Which failures an edge re-opens its generation after, how long it waits first, and where it goes."""
from __future__ import annotations

import asyncio
import socket

import grpc
import pytest

from specsplit.edge.client import ConnectOptions, EdgeConfig, StreamStalled, generate
from specsplit.edge.retry import RETRY_SPREAD, retry_delay, spread


def _refused(code: grpc.StatusCode, *trailing: tuple[str, str]) -> grpc.aio.AioRpcError:
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailing), "refused")


@pytest.mark.parametrize(("exc", "delay"), [
    (_refused(grpc.StatusCode.UNAVAILABLE), 0.5),
    (_refused(grpc.StatusCode.DEADLINE_EXCEEDED), 0.5),
    (_refused(grpc.StatusCode.INTERNAL), 0.5),  # a server's end racing the edge's writes reads so
    (grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                          "verification failed: out of memory"), None),  # the server's own failure
    (grpc.aio.AioRpcError(grpc.StatusCode.INTERNAL, grpc.aio.Metadata(), grpc.aio.Metadata(),
                          "server fault: failed on a message of the stream"), None),  # the same
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


@pytest.mark.parametrize("details", [
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Tls handshake failed "
    "(TSI_PROTOCOL_FAILURE): SSL_ERROR_SSL: error:1a000064:ECDSA routines:OPENSSL_internal:BAD_SIGNATURE",
    "failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:1: Custom verification check failed "
    "with error: UNAUTHENTICATED: Hostname Verification Check failed.",
])
def test_a_failed_tls_handshake_is_retried_only_on_another_server(details: str) -> None:
    """The same handshake fails the same way: retried five times, it cost about 15 s before
    the error said which TLS setting to look at."""
    exc = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(), details)
    assert retry_delay(exc, 0.5) is None
    assert retry_delay(exc, 0.5, servers=2) == 0.5
    socket_closed = grpc.aio.AioRpcError(grpc.StatusCode.UNAVAILABLE, grpc.aio.Metadata(), grpc.aio.Metadata(),
                                         "failed to connect to all addresses; last error: UNAVAILABLE: Socket closed")
    assert retry_delay(socket_closed, 0.5) == 0.5  # a server going away looks the same: retried


def test_a_generation_needs_somewhere_to_go() -> None:
    with pytest.raises(ValueError, match="needs a server address"):
        asyncio.run(generate([], [1, 2, 3], EdgeConfig(mode="none")))


def test_edges_refused_together_do_not_come_back_together() -> None:
    """Every retry waited exactly its backoff or the pushback: edges a full server refused at
    once came back at the same instants, and each wave found it as full."""
    waits = [spread(1.0) for _ in range(200)]
    assert all(1.0 <= w <= RETRY_SPREAD for w in waits)  # never sooner than the server asked
    assert max(waits) - min(waits) > 0.3 * (RETRY_SPREAD - 1.0)


def test_an_address_that_takes_tcp_but_never_answers_fails_an_attempt_after_the_connect_timeout() -> None:
    """gRPC gives a connection 20 s to send its HTTP/2 settings: with the default 12 retries, an
    edge pointed at a port of something else waited over 5 minutes to give up. The bound below
    is no measurement, only under those 20 s with a wide margin."""
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)  # the kernel takes connections; nothing ever answers them
    address = f"127.0.0.1:{silent.getsockname()[1]}"
    with silent, pytest.raises(grpc.aio.AioRpcError) as failed:
        asyncio.run(asyncio.wait_for(generate(address, [1, 2, 3], EdgeConfig(mode="none"),
                                              connect=ConnectOptions(connect_timeout_s=0.5, retries=0)), 15))
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE and "SETTINGS" in failed.value.details()


@pytest.mark.parametrize("backoff_s", [0.5, 0.1, 0.0])
def test_grpc_waits_less_between_connection_attempts_than_the_edge_between_retries(monkeypatch, backoff_s) -> None:
    """A channel retries its connection on gRPC's own backoff (1 s growing to 120 s, by 1.6,
    20% jitter) and fails a call made while it waits at once: the edge's retries (8 s apart at
    most) fell in those waits, so an edge whose server was down for a minute gave up though it
    was back (by hand: down 12 s, up at the 16 s retry now, at the 27 s one before)."""
    from specsplit.edge import client
    from specsplit.edge.retry import MAX_BACKOFF_S

    seen: dict[str, int | str] = {}
    monkeypatch.setattr(client.grpc.aio, "insecure_channel", lambda address, options: seen.update(options))
    client.open_channel("127.0.0.1:1", ConnectOptions(backoff_s=backoff_s))
    jitter = 1.2
    assert seen["grpc.initial_reconnect_backoff_ms"] * jitter <= max(backoff_s * 1000, 1 * jitter)
    assert seen["grpc.max_reconnect_backoff_ms"] * jitter <= MAX_BACKOFF_S * 1000
