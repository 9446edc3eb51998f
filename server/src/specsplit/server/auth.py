"""Optional per-device bearer tokens, checked by a gRPC server interceptor.

Tokens file: one `DEVICE_ID TOKEN` pair per line; blank lines and lines starting with # are
skipped. A token is printable ASCII (all gRPC metadata carries), at least 16 characters, a
`#` in it as good as any other character. A call without
an `authorization: Bearer ...` header is UNAUTHENTICATED; a token no device holds is
PERMISSION_DENIED. A health check (Health/Check) stays open, so that probes work; Health/Watch
and reflection, streams that end only when their client ends them, need a token as
generation does, so that no client without one can hold streams open without limit (a tool
such as grpcurl sends the header as any client does).
"""
from __future__ import annotations

import asyncio
import hmac
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path

import grpc

from specsplit.common.aio import within

OPEN_SERVICES = ("/grpc.health.v1.Health/Check",)


def load_tokens(path: Path) -> dict[str, str]:
    """token -> device id."""
    tokens: dict[str, str] = {}
    try:
        text = Path(path).read_text(encoding="utf-8-sig")  # an editor's byte-order mark would hide a first comment
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text ({exc.reason})") from None
    for n, line in enumerate(text.splitlines(), start=1):
        # A comment is a whole line: a # inside a token cut it short, to a prefix that let in
        # whoever held just that, while the device's whole token was refused.
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise ValueError(f"{path}:{n}: expected 'DEVICE_ID TOKEN'")
        device, token = parts
        if not (token.isascii() and token.isprintable()):
            # gRPC metadata carries none other, so no device could send it; and comparing one
            # failed every call, every device's.
            raise ValueError(f"{path}:{n}: token of device {device} is not printable ASCII")
        if len(token) < 16:
            raise ValueError(f"{path}:{n}: token of device {device} is shorter than 16 characters")
        if token in tokens:  # else the later line would win, and deleting it would not revoke the token
            raise ValueError(f"{path}:{n}: device {device} has the token of device {tokens[token]}: give each its own")
        tokens[token] = device
    if not tokens:
        raise ValueError(f"{path} holds no tokens")
    return tokens


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    """The token of a call's `authorization: Bearer ...` metadata (the scheme in any case, as
    HTTP's are), or None without one."""
    header = dict(metadata or ()).get("authorization", "")
    if not isinstance(header, str):
        return None
    scheme, _, token = header.strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


FIRST_MESSAGE_WAIT_S = 5.0


# Told of every refused call: its status, the client's peer address and the message.
OnRefusal = Callable[[grpc.StatusCode, str, str], None]


def _deny(code: grpc.StatusCode, message: str, on_refusal: OnRefusal | None) -> grpc.RpcMethodHandler:
    async def abort(request_iterator, context):  # type: ignore[no-untyped-def]
        if on_refusal is not None:
            on_refusal(code, context.peer(), message)
        # Take the first message before refusing: a status sent while the client's first
        # write is still in flight reaches a gRPC Python client as INTERNAL, not as `code`.
        try:
            await within(anext(aiter(request_iterator), None), FIRST_MESSAGE_WAIT_S)
        except (asyncio.TimeoutError, grpc.RpcError):
            pass
        await context.abort(code, message)

    return grpc.stream_stream_rpc_method_handler(abort)


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, tokens: dict[str, str], on_refusal: OnRefusal | None = None) -> None:
        self._tokens = tokens
        self._on_refusal = on_refusal  # so that refusals are counted and logged: token guessing shows

    def device_for(self, token: str) -> str | None:
        presented = token.encode("utf-8", "surrogateescape")  # compare_digest takes ASCII str only
        for known, device in self._tokens.items():
            if hmac.compare_digest(known.encode(), presented):
                return device
        return None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        if handler_call_details.method.startswith(OPEN_SERVICES):
            return await continuation(handler_call_details)
        metadata = handler_call_details.invocation_metadata
        token = bearer_token(metadata)
        if token is None:
            sent = "authorization" in dict(metadata or ())
            return _deny(grpc.StatusCode.UNAUTHENTICATED, ("'authorization' metadata that is not 'Bearer <token>'" if sent
                                                           else "missing 'authorization: Bearer <token>' metadata"),
                         self._on_refusal)
        if self.device_for(token) is None:
            return _deny(grpc.StatusCode.PERMISSION_DENIED, "this token belongs to no registered device",
                         self._on_refusal)
        return await continuation(handler_call_details)
