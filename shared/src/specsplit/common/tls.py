"""TLS files as the command lines take them: PEM, checked before any call or bind."""
from __future__ import annotations

import re
import ssl
from pathlib import Path

import grpc

_CERTIFICATE = re.compile(r"-----BEGIN CERTIFICATE-----.+?-----END CERTIFICATE-----", re.DOTALL)


def check_pem(cert: str | None = None, key: str | None = None, ca: str | None = None,
              ca_flag: str = "--tls-ca") -> None:
    """ValueError, naming the option, unless `cert` and `key` are a PEM certificate and its
    own unencrypted key, and `ca` holds a PEM certificate. gRPC takes any bytes and finds out
    only at the handshake (a client: every call fails as if the server were lost) or at the
    bind, after a server's model has loaded. Files that are not regular files (a pipe, say)
    are left to gRPC: they can be read only once."""
    if cert and key and Path(cert).is_file() and Path(key).is_file():
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.set_ciphers("DEFAULT:@SECLEVEL=0")  # judge the files, not OpenSSL's policy: gRPC takes old keys
        try:  # no password: OpenSSL would otherwise ask for one on the terminal
            ctx.load_cert_chain(cert, key, password=lambda: b"")
        except ssl.SSLError as exc:
            raise ValueError(f"--tls-cert {cert} and --tls-key {key} are not a PEM certificate and its own "
                             f"unencrypted key ({exc.reason or exc})") from None
        except OSError as exc:
            raise ValueError(f"--tls-cert {cert} or --tls-key {key} cannot be read ({exc.strerror})") from None
    if ca and Path(ca).is_file():
        try:
            text = Path(ca).read_text(encoding="ascii", errors="replace")
        except OSError as exc:
            raise ValueError(f"{ca_flag} {ca} cannot be read ({exc.strerror})") from None
        if not any(_loads(block) for block in _CERTIFICATE.findall(text)):  # gRPC takes a bundle's good ones
            raise ValueError(f"{ca_flag} {ca} holds no PEM certificate")


def _loads(certificate: str) -> bool:
    try:
        ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT).load_verify_locations(cadata=certificate)
    except (ssl.SSLError, TypeError, ValueError):  # (TypeError: a stray non-ASCII character in the block)
        return False
    return True


def check_given(*paths: tuple[str, str | None]) -> None:
    """ValueError for a (flag, path) given as an empty path: an unset shell variable
    ("--tls-ca $CA") reads as none given, and a client would talk plaintext without a word."""
    for flag, path in paths:
        if path is not None and not path.strip():
            raise ValueError(f"{flag} is empty (an unset variable?): give a file")


def client_credentials(ca: str | None, cert: str | None, key: str | None,
                       tls: bool = False) -> grpc.ChannelCredentials | None:
    """None for plaintext (no CA, no certificate and not `tls`); else TLS trusting `ca`
    (gRPC's default roots where None), with this client's `cert` and `key` for mutual TLS. Raises
    ValueError, naming the option (--tls-ca, --tls-cert, --tls-key), for a certificate
    without its key or the reverse and for files that cannot be read or are not PEM
    (`check_pem`)."""
    check_given(("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key))
    if bool(cert) != bool(key):
        raise ValueError("--tls-cert and --tls-key go together")
    if not (ca or cert or tls):
        return None
    for flag, path in (("--tls-ca", ca), ("--tls-cert", cert), ("--tls-key", key)):
        if path and (not Path(path).exists() or Path(path).is_dir()):
            raise ValueError(f"{flag} {path}: no such file")
    check_pem(cert, key, ca)

    def read(flag: str, path: str | None) -> bytes | None:
        if not path:
            return None
        try:
            return Path(path).read_bytes()
        except OSError as exc:
            raise ValueError(f"{flag} {path} cannot be read ({exc.strerror})") from None

    return grpc.ssl_channel_credentials(read("--tls-ca", ca), read("--tls-key", key), read("--tls-cert", cert))


def handshake_failed(details: str) -> bool:
    """Whether a failed call's details (gRPC's UNAVAILABLE) say the TLS handshake failed: a CA
    that did not sign the server's certificate, a name it does not hold, TLS to a plaintext
    port. Unlike a lost server, the same handshake fails the same way again."""
    return "handshake failed" in details.lower() or "Hostname Verification" in details


def tls_hint(details: str, tls: bool, client_cert: bool, address_flag: str) -> str:
    """Which TLS setting a failed connection's `details` point at, where the settings do not
    match the server's (gRPC reports them as a lost server); "" where they point at none. `tls`:
    whether any TLS was asked for; `client_cert`: a client certificate given; `address_flag`: the
    option that names the server."""
    if "Hostname Verification" in details:
        return (f"\n(the server's certificate does not name the host in {address_flag}: give the name it holds "
                "with --tls-server-name)")
    if handshake_failed(details):
        if "WRONG_VERSION_NUMBER" in details:
            return "\n(the server does not seem to speak TLS: leave out --tls, --tls-ca, --tls-cert and --tls-key)"
        if "certificate has expired" in details or "certificate is not yet valid" in details:
            return ("\n(the server's certificate is outside its dates by this machine's clock: the server needs a "
                    "current certificate, or this machine's clock is wrong)")
        return ("\n(the TLS handshake failed: --tls-ca must hold the CA that signed the server's certificate, "
                f"and the certificate must name the host in {address_flag}, or --tls-server-name)")
    if "Socket closed" in details:
        if not tls:
            return "\n(the server closed the connection at once: if it serves TLS, give --tls-ca or --tls)"
        if not client_cert:
            return ("\n(the server closed the connection at once: if it asks for client certificates, give "
                    "--tls-cert and --tls-key)")
    return ""
