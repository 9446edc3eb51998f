"""A server's address as the command lines take it."""
from __future__ import annotations

import ipaddress


def check_host_port(address: str) -> None:
    """ValueError unless `address` is HOST:PORT with a real port (IPv6 hosts in brackets):
    gRPC takes a missing port as 443 and wraps one past 65535 around, and fails a call to a
    host it cannot parse ([127.0.0.1], say) as if the server were lost, which an edge retries."""
    host, sep, port = address.rpartition(":")
    if not sep or not _host(host) or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError("give HOST:PORT ([IPV6]:PORT), with a port from 1 to 65535")


def _host(host: str) -> bool:
    """A host name (ASCII: an international one in its xn-- form) or IPv4 address, or an IPv6
    address (with its zone, if any) in brackets."""
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    # gRPC's resolver takes nothing else: a space, say, fails each call as a lost server would.
    return bool(host) and all(c.isascii() and (c.isalnum() or c in "-._") for c in host)


def check_unix(address: str) -> None:
    """ValueError unless `address` (unix:PATH or unix-abstract:NAME) names a socket."""
    if not address.partition(":")[2]:
        raise ValueError("give unix:PATH (or unix-abstract:NAME) with the socket's path")


def bracketed(host: str) -> str:
    """`host` as it stands before :PORT: an IPv6 address in brackets (once), others as they are."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare


def is_loopback(host: str) -> bool:
    """Whether `host` (a name, or an address bare or in brackets) is this machine's loopback:
    what is sent to or served on it does not cross a network."""
    bare = host.strip("[]")
    if bare == "localhost":
        return True
    try:
        return ipaddress.ip_address(bare.partition("%")[0]).is_loopback
    except ValueError:
        return False
