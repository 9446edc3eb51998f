"""When an interrupted generation is re-opened, and after how long."""
from __future__ import annotations

import random

import grpc

from specsplit.common.tls import handshake_failed
from specsplit.protocol import errors

# Statuses after which the same generation is re-opened (here or on the next server); any
# other status, only when the server says when to try again (a full server: retry_delay).
# INTERNAL too: gRPC's Python client reports a call that its server ends while the client is
# still writing (a draining server's last streams, now and then) as INTERNAL, not as the
# status the server sent; and a re-opened generation loses nothing, so retrying is safe. A
# server's own INTERNAL (its target failed the session's verification, or it failed on a
# message of the stream: errors.SERVERS_OWN_FAILURES) is not retried: it would most likely
# fail again, after every backoff.
RETRYABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL)
# What a server answers an Open with when it takes no session at all (draining, full): the
# same server will answer a new call alike, so a kept call that fails so moves on (Attempt._open).
SERVER_REFUSALS = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)


def describe(exc: Exception) -> str:
    """`exc` in one line, for the warning that a retry follows."""
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"{exc.code().name}: {exc.details()}"
    return f"{type(exc).__name__}: {exc}"


# A retry waits up to this many times its least wait, at random (`spread`).
RETRY_SPREAD = 1.5
MAX_BACKOFF_S = 8.0  # the backoff doubles after each failed attempt, up to this


def next_backoff(backoff: float) -> float:
    return min(backoff * 2, MAX_BACKOFF_S)


def retry_span(retries: int, backoff: float) -> float:
    """The least time `retries` re-opens in a row wait in all, from a first backoff of
    `backoff`: how long a server may be down before the edge gives up."""
    total = 0.0
    for _ in range(retries):
        total, backoff = total + backoff, next_backoff(backoff)
    return total


def spread(least: float) -> float:
    """A retry's wait: `least` and up to half as much again, at random. Edges refused together
    by a full server, or cut off together by a lost one, would otherwise all come back at the
    same instants (the backoff doubles alike for all), each wave finding the server as full."""
    return least * random.uniform(1.0, RETRY_SPREAD)


def retry_delay(exc: Exception, backoff: float, servers: int = 1) -> float | None:
    """The least wait before re-opening after `exc`, or None if a retry would not help: a lost
    stream or server waits the backoff; a refusal that carries the server's pushback (a full
    server) waits at least that long. A failed TLS handshake (a CA that did not sign the
    server's certificate, a name it does not hold, TLS to a plaintext port) fails the same way
    on the same server: it is retried only where there are `servers` to fail over to."""
    if not isinstance(exc, grpc.aio.AioRpcError):
        return backoff
    details = exc.details() or ""
    if servers == 1 and handshake_failed(details):
        return None
    if exc.code() == grpc.StatusCode.INTERNAL and details.startswith(errors.SERVERS_OWN_FAILURES):
        return None
    if exc.code() in RETRYABLE:
        return backoff
    pushback = pushback_of(exc)
    if pushback is None:
        return None
    try:
        return max(backoff, int(pushback) / 1000)
    except ValueError:  # gRPC: a pushback that does not parse means "do not retry"
        return None


def pushback_of(exc: grpc.aio.AioRpcError) -> str | None:
    """The server's pushback on `exc` (how many ms to wait before trying again), if it sent
    one: a full server does; a RESOURCE_EXHAUSTED without it refused a message for its size."""
    return (exc.trailing_metadata() or grpc.aio.Metadata()).get(errors.PUSHBACK_METADATA)
