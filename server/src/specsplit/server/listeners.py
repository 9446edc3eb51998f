"""Several grpc.aio servers on one port (SO_REUSEPORT), so that new calls are taken in
parallel. A grpc.aio server asks gRPC for its next call only once its event loop has taken
the last one, so one server takes calls one after another; the kernel deals connections
among the servers' sockets, and every server serves the same handlers.

SO_REUSEPORT (gRPC sets it even for one server) would also let a second server process bind
the port and take a share of its connections without a word; so the port is first bound
alone, without it, as a check that nobody listens there (check_port_free)."""
from __future__ import annotations

import errno
import socket
from collections.abc import Callable, Sequence
from typing import Any

import grpc

from specsplit.common.address import bracketed

# gRPC's message size options are C ints.
MAX_MESSAGE_BYTES = 2**31 - 1
# Hosts that bind every address of the machine (an empty one too, as socket binds it).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0", "::"})


class BindError(OSError):
    """A port the server could not bind once it had loaded its model (another process took it
    since the check, say): its own line for the operator, not a traceback."""


def bind_addresses(host: str, port: int) -> list[tuple]:
    """getaddrinfo's answers for binding `host` (an IPv6 address bare or in brackets) on `port`."""
    return socket.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)


def check_port_free(host: str, port: int) -> None:
    """Raise OSError if something already listens on host:port, or no address of `host` can
    be bound there. Port 0 (any free one) is always free, but its host is checked as any
    other's (a host that does not resolve, or is not this machine's). Like gRPC, a host name whose
    addresses cannot all be bound (localhost's ::1 where IPv6 is off) is served on those that
    can. Two servers starting at the same instant can still both pass before either binds."""
    bare = host.strip("[]")  # gRPC writes IPv6 addresses in brackets, getaddrinfo without
    where = f"{bracketed(host)}:{port}"
    if not 0 <= port <= 65535:
        raise OSError(f"port {port} is out of range (0 to 65535)")
    try:
        addresses = bind_addresses(host, port)
    except socket.gaierror as exc:
        raise OSError(f"cannot bind {where}: {exc.strerror}") from None
    if bare in WILDCARD_HOSTS and socket.has_ipv6:
        # gRPC binds a wildcard as IPv6's, both families at once: a server on [::1] alone (or
        # an IPv6-only [::]) holds the port for IPv4's wildcard too.
        addresses = [*addresses, (socket.AF_INET6, socket.SOCK_STREAM, 0, "", ("::", port, 0, 0))]
    bound = 0
    for family, kind, proto, _, address in addresses:
        try:
            with socket.socket(family, kind, proto) as probe:
                # As gRPC binds: ports whose old connections linger in TIME_WAIT are free.
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)  # both families, as gRPC's
                probe.bind(address)
                bound += 1
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise OSError(f"{where} is already in use (another server?)") from None
            if exc.errno not in (errno.EADDRNOTAVAIL, errno.EAFNOSUPPORT):
                raise OSError(f"cannot bind {where}: {exc.strerror}") from None
    if not bound:
        raise OSError(f"cannot bind {where}: no address of {bare} is on this machine")


def bind_listeners(count: int, host: str, port: int, register: Callable[[grpc.aio.Server], None],
                   options: Sequence[tuple[str, Any]] = (), interceptors: Sequence[Any] = (),
                   credentials: grpc.ServerCredentials | None = None) -> tuple[list[grpc.aio.Server], int]:
    """`count` servers bound to host:port (0: a free port), each given its handlers by
    `register`; not started. Returns them and the port they share."""
    if count < 1:
        raise ValueError(f"listeners must be at least 1, got {count}")
    try:
        check_port_free(host, port)  # again: the start's check was a model's load ago
    except OSError as exc:
        raise BindError(str(exc)) from None
    servers: list[grpc.aio.Server] = []
    for _ in range(count):
        server = grpc.aio.server(options=[*options, ("grpc.so_reuseport", 1)], interceptors=list(interceptors))
        register(server)
        address = f"{bracketed(host)}:{port}"  # gRPC wants an IPv6 address in brackets
        try:
            bound = server.add_secure_port(address, credentials) if credentials else server.add_insecure_port(address)
        except RuntimeError:  # newer gRPC raises where older returned 0
            bound = 0
        if bound == 0:
            shared = " beside the first listener (a platform without SO_REUSEPORT needs --listeners 1)" if servers else ""
            raise BindError(f"could not bind {address}{shared}")
        port = bound  # port 0 asks for a free port once: the others share the one it got
        servers.append(server)
    return servers, port
