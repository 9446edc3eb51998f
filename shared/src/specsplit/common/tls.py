"""TLS files as the command lines take them: PEM, checked before any call or bind."""
from __future__ import annotations

import ssl
from pathlib import Path

import grpc


def check_pem(cert: str | None = None, key: str | None = None, ca: str | None = None,
              ca_flag: str = "--tls-ca") -> None:
    """ValueError, naming the option, unless `cert` and `key` are a PEM certificate and its
    own unencrypted key, and `ca` holds a PEM certificate. gRPC takes any bytes and finds out
    only at the handshake (a client: every call fails as if the server were lost) or at the
    bind, after a server's model has loaded."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    if cert and key:
        try:  # no password: OpenSSL would otherwise ask for one on the terminal
            ctx.load_cert_chain(cert, key, password=lambda: b"")
        except OSError as exc:  # ssl.SSLError is one too
            raise ValueError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its own "
                             f"unencrypted key ({_reason(exc)})") from None
    if ca:
        try:
            ctx.load_verify_locations(ca)
        except OSError as exc:
            raise ValueError(f"{ca_flag} {ca} holds no PEM certificate ({_reason(exc)})") from None


def _reason(exc: OSError) -> str:
    return getattr(exc, "reason", None) or exc.strerror or str(exc)


def client_credentials(ca: str | None, cert: str | None, key: str | None) -> grpc.ChannelCredentials | None:
    """None for plaintext (no CA and no certificate given); else TLS trusting `ca` (the
    system's CAs where None), with this client's `cert` and `key` for mutual TLS. Raises
    ValueError, naming the option (--tls-ca, --tls-cert, --tls-key), for a certificate
    without its key or the reverse and for files that cannot be read or are not PEM
    (`check_pem`)."""
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (ca or cert):
        return None
    for flag, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if path and not Path(path).is_file():
            raise ValueError(f"{flag} {path}: no such file")
    check_pem(cert, key, ca)

    def read(path: str | None) -> bytes | None:
        return Path(path).read_bytes() if path else None

    return grpc.ssl_channel_credentials(read(ca), read(key), read(cert))
