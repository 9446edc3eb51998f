"""TLS credentials of a client (an edge, a health check) from PEM files."""
from __future__ import annotations

from pathlib import Path

import grpc


def client_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """None for plaintext (no CA and no certificate given); else TLS trusting `ca` (the
    system's CAs where None), with this client's `cert` and `key` for mutual TLS. Raises
    ValueError, naming the option (--tls-ca, --tls-cert, --tls-key), for a certificate
    without its key or the reverse and for a file that cannot be read or is not PEM: gRPC
    would take such bytes and fail every call's handshake, which looks like a lost server."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (ca or cert):
        return None

    def read(flag: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path}: {exc.strerror or exc}") from None
        if b"-----BEGIN " not in data:
            raise ValueError(f"{flag} {path} is not a PEM file")
        return data

    return grpc.ssl_channel_credentials(read("--tls-ca", ca), read("--tls-key", key), read("--tls-cert", cert))
