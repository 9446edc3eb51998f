"""Typed protocol violations. Each names the gRPC status a transport should answer with."""
from __future__ import annotations

# gRPC's server pushback: trailing metadata that tells a client to retry after this many ms.
PUSHBACK_METADATA = "grpc-retry-pushback-ms"
# How the details of an INTERNAL status begin when the server failed on its own account: its
# target failed the session's verification, or the server failed on a message of the stream.
# An edge does not retry these (unlike an INTERNAL that gRPC's client makes of a call ended
# while it was writing).
VERIFICATION_FAILED = "verification failed"
SERVER_FAULT = "server fault"
SERVERS_OWN_FAILURES = (VERIFICATION_FAILED, SERVER_FAULT)


class ProtocolError(Exception):
    """A peer broke the protocol; `status` is a grpc.StatusCode name."""

    status: str = "INVALID_ARGUMENT"
    # Where the same request may succeed later: how long to wait first. A transport sends it as
    # PUSHBACK_METADATA, which tells the peer that this RESOURCE_EXHAUSTED is worth retrying,
    # unlike one for an oversized message.
    retry_after_s: float | None = None

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class DraftBeforeOpen(ProtocolError):
    status = "FAILED_PRECONDITION"


class SecondOpen(ProtocolError):
    status = "FAILED_PRECONDITION"


class FingerprintMismatch(ProtocolError):
    status = "FAILED_PRECONDITION"


class InvalidOpen(ProtocolError):
    """Bad sampling values, empty prompt, unknown mode and the like."""

    status = "INVALID_ARGUMENT"


class PromptTooLong(ProtocolError):
    status = "OUT_OF_RANGE"


class TokenOutOfVocab(ProtocolError):
    status = "INVALID_ARGUMENT"


class MalformedDraft(ProtocolError):
    status = "INVALID_ARGUMENT"


class DraftTooLarge(ProtocolError):
    status = "RESOURCE_EXHAUSTED"


class PositionBehindCommitted(ProtocolError):
    status = "OUT_OF_RANGE"


class BeyondLookahead(ProtocolError):
    status = "OUT_OF_RANGE"


class ServerBrokeProtocol(ProtocolError):
    """The edge got from its server what the protocol does not allow (a server bug, or a
    server of another build): the server's failure, not the caller's settings, and not
    retried, since a server that breaks the protocol would break it again."""

    status = "INTERNAL"


class VerdictOutOfOrder(ServerBrokeProtocol):
    """A verdict that does not start at the edge's committed point, or that commits past the
    generation's end."""


class NotOpenedFirst(ServerBrokeProtocol):
    """The server's first message for a session was not its Opened."""


class ServerBusy(ProtocolError):
    """Admission control: the server holds as many sessions as it allows. Sessions end within
    seconds, so an edge may try again after a second, on another server if it has one."""

    status = "RESOURCE_EXHAUSTED"
    retry_after_s = 1.0


class ServerDraining(ProtocolError):
    """The server is shutting down. UNAVAILABLE, the status edges retry, so that a device
    given several servers opens its session on the next one."""

    status = "UNAVAILABLE"


class MessageTooLarge(ProtocolError):
    status = "RESOURCE_EXHAUSTED"


class MalformedMessage(ProtocolError):
    """Bytes that do not parse as an EdgeMessage, or one that carries none of its kinds."""

    status = "INVALID_ARGUMENT"


class ClosedBeforeOpen(ProtocolError):
    status = "FAILED_PRECONDITION"


class DraftsTimedOut(ProtocolError):
    """A sync session's edge sent no drafts for the server's limit: its server takes no step
    alone, so the session would hold its place (and KV cache) for good."""

    status = "DEADLINE_EXCEEDED"


class OpenTimeout(ProtocolError):
    """A stream's first message did not come in time: it held a call and sent nothing."""

    status = "DEADLINE_EXCEEDED"
