"""Several grpc.aio servers on one port (SO_REUSEPORT), so that new calls are taken in
parallel. A grpc.aio server asks gRPC for its next call only once its event loop has taken
the last one, so one server takes calls one after another; the kernel deals connections
among the servers' sockets, and every server serves the same handlers."""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import grpc


def check_listeners(count: int) -> None:
    if count < 1:
        raise ValueError(f"listeners must be at least 1, got {count}")


def bind_listeners(count: int, host: str, port: int, register: Callable[[grpc.aio.Server], None],
                   options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] = (),
                   credentials: grpc.ServerCredentials | None = None) -> tuple[list[grpc.aio.Server], int]:
    """`count` servers bound to host:port (0: a free port), each given its handlers by
    `register`; not started. Returns them and the port they share."""
    check_listeners(count)
    servers: list[grpc.aio.Server] = []
    for _ in range(count):
        server = grpc.aio.server(options=[*options, ("grpc.so_reuseport", 1)], interceptors=list(interceptors))
        register(server)
        address = f"{host}:{port}"
        bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        if bound == 0:
            shared = " beside the first listener (a platform without SO_REUSEPORT needs --listeners 1)" if servers else ""
            raise OSError(f"could not bind {address}{shared}")
        port = bound  # port 0 asks for a free port once: the others share the one it got
        servers.append(server)
    return servers, port
