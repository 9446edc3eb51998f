"""A server's address as the command lines take it."""
from __future__ import annotations


def check_host_port(address: str) -> None:
    """ValueError unless `address` is HOST:PORT with a real port (IPv6 hosts in brackets):
    gRPC takes a missing port as 443 and wraps one past 65535 around."""
    host, sep, port = address.rpartition(":")
    bare_ipv6 = ":" in host and not (host.startswith("[") and host.endswith("]"))
    if not sep or not host or bare_ipv6 or not (port.isascii() and port.isdigit()) or not 1 <= int(port) <= 65535:
        raise ValueError("give HOST:PORT ([IPV6]:PORT), with a port from 1 to 65535")


def bracketed(host: str) -> str:
    """`host` as it stands before :PORT: an IPv6 address in brackets (once), others as they are."""
    bare = host.strip("[]")
    return f"[{bare}]" if ":" in bare else bare
