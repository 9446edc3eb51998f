"""How a generation ends early, from the caller's side: the failures it may raise."""
from __future__ import annotations

import grpc

from specsplit.protocol.errors import ProtocolError


class StreamEnded(ConnectionError):
    """The server ended the call before the session's Done."""


class OnCommitFailed(Exception):
    """The caller's on_commit raised (its exception is the cause): the caller's own failure
    (a closed stdout, say), which ends the generation and is never retried, though it may be
    an OSError as a lost connection is."""


class CallCancelled(Exception):
    """The generation's call was cancelled on this side while it ran (GenerateStream.abort,
    or its channel closed): the caller gave the generation up, so it is not retried."""


class StreamStalled(Exception):
    """Nothing came from the server for longer than the stall timeout: to the caller, the
    server is as UNAVAILABLE as one that refuses connections."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return str(self)


# What `generate` raises when the server or the link failed the generation (retries spent),
# as against the caller's own failures (OnCommitFailed, settings it refused).
GENERATION_FAILURES = (grpc.aio.AioRpcError, StreamStalled, ConnectionError, ProtocolError)


def status_name(exc: BaseException) -> str:
    """What to count a failed generation under: its gRPC status name where it has one (a stalled
    stream is UNAVAILABLE to a caller), else its type's name."""
    code = getattr(exc, "code", None)
    return code().name if callable(code) else type(exc).__name__
