"""Typed protocol violations. Each names the gRPC status a transport should answer with."""
from __future__ import annotations


class ProtocolError(Exception):
    """A peer broke the protocol; `status` is a grpc.StatusCode name."""

    status: str = "INVALID_ARGUMENT"

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


class VerdictOutOfOrder(ProtocolError):
    """The edge got a verdict that does not start at its committed point (server bug)."""

    status = "INTERNAL"


class ServerBusy(ProtocolError):
    """Admission control: the server holds as many sessions as it allows."""

    status = "RESOURCE_EXHAUSTED"


class ServerDraining(ProtocolError):
    """The server is shutting down. UNAVAILABLE, the status edges retry, so that a device
    given several servers opens its session on the next one."""

    status = "UNAVAILABLE"


class MalformedMessage(ProtocolError):
    """Bytes that do not parse as an EdgeMessage."""

    status = "INVALID_ARGUMENT"


class ClosedBeforeOpen(ProtocolError):
    status = "FAILED_PRECONDITION"


class OpenTimeout(ProtocolError):
    """A stream's first message did not come in time: it held a call and sent nothing."""

    status = "DEADLINE_EXCEEDED"
