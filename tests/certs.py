"""A throwaway CA with a server and a client certificate, for the TLS tests."""
from __future__ import annotations

import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _write(path: Path, key, cert) -> None:  # type: ignore[no-untyped-def]
    path.with_suffix(".key").write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    path.with_suffix(".crt").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_pki(directory: Path, server_from: datetime.timedelta = datetime.timedelta(minutes=-5),
             server_until: datetime.timedelta = datetime.timedelta(days=1)) -> dict[str, Path]:
    """The CA, a server and a client certificate; the server's valid from now + `server_from`
    until now + `server_until`."""
    now = datetime.datetime.now(datetime.timezone.utc)
    valid = dict(not_valid_before=now - datetime.timedelta(minutes=5), not_valid_after=now + datetime.timedelta(days=1))
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder(subject_name=_name("specsplit test CA"), issuer_name=_name("specsplit test CA"),
                                public_key=ca_key.public_key(), serial_number=x509.random_serial_number(), **valid)
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    _write(directory / "ca", ca_key, ca)
    for role, usage in (("server", ExtendedKeyUsageOID.SERVER_AUTH), ("client", ExtendedKeyUsageOID.CLIENT_AUTH)):
        key = ec.generate_private_key(ec.SECP256R1())
        dates = valid if role == "client" else dict(not_valid_before=now + server_from, not_valid_after=now + server_until)
        builder = (
            x509.CertificateBuilder(subject_name=_name(f"specsplit {role}"), issuer_name=ca.subject,
                                    public_key=key.public_key(), serial_number=x509.random_serial_number(), **dates)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
        )
        if role == "server":
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            )
        _write(directory / role, key, builder.sign(ca_key, hashes.SHA256()))
    return {n: directory / n for n in ("ca", "server", "client")}
