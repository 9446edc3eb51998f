"""TLS credentials of a client (an edge, a health check) from PEM files."""
from __future__ import annotations

from pathlib import Path

import grpc


def client_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """None for plaintext (no CA and no certificate given); else TLS trusting `ca` (the
    system's CAs where None), with this client's `cert` and `key` for mutual TLS. Raises
    ValueError for a certificate without its key or the reverse, OSError for unreadable files."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (ca or cert):
        return None

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
