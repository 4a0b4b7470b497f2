"""A throwaway certificate authority and one certificate it signed, as files, for TLS between test hosts.

``dask scheduler`` and ``dask worker`` take their TLS material as files
(``--tls-ca-file``, ``--tls-cert``, ``--tls-key``), unlike ``Security.temporary()``,
which keeps a self-signed pair in memory. :func:`throwaway_ca` writes a CA and a
certificate signed by it (for the given addresses; Dask verifies the chain, not the
host name) into a folder readable only by its owner; it is the folder's caller who
deletes it. Needs the ``cryptography`` package.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class TLSFiles:
    """Paths of a CA certificate, and of a certificate and its key that the CA signed."""

    ca: str
    cert: str
    key: str

    def cli_args(self) -> tuple[str, ...]:
        """The ``dask scheduler`` / ``dask worker`` options that use these files."""
        return ("--tls-ca-file", self.ca, "--tls-cert", self.cert, "--tls-key", self.key)

    def security(self):
        """A ``distributed.Security`` for a client of hosts that use these files (encryption required)."""
        from distributed import Security

        return Security(
            tls_ca_file=self.ca, tls_client_cert=self.cert, tls_client_key=self.key, require_encryption=True
        )


def throwaway_ca(folder: str, addresses: Sequence[str] = (), days: int = 1) -> TLSFiles:
    """Write ``ca.pem``, ``cert.pem`` and ``key.pem`` into ``folder`` (made 0700).

    The certificate names ``addresses`` (IP addresses) and ``dask-internal``, and is
    valid for ``days`` from an hour ago (clocks of test hosts agree, but a leeway costs
    nothing).

    >>> import tempfile
    >>> files = throwaway_ca(tempfile.mkdtemp(), ["198.18.0.2"])
    >>> open(files.cert).read().startswith("-----BEGIN CERTIFICATE-----")
    True
    """
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    os.makedirs(folder, mode=0o700, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(hours=1)
    later = now + datetime.timedelta(days=days)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (
        x509.CertificateBuilder()
        .subject_name(name("dask-kvstate test CA"))
        .issuer_name(name("dask-kvstate test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    key = ec.generate_private_key(ec.SECP256R1())
    alt = [x509.DNSName("dask-internal"), *(x509.IPAddress(ipaddress.ip_address(a)) for a in addresses)]
    cert = (
        x509.CertificateBuilder()
        .subject_name(name("dask-internal"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now)
        .not_valid_after(later)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.SubjectAlternativeName(alt), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    files = TLSFiles(*(os.path.join(folder, f) for f in ("ca.pem", "cert.pem", "key.pem")))
    pem = serialization.Encoding.PEM
    for path, data in (
        (files.ca, ca.public_bytes(pem)),
        (files.cert, cert.public_bytes(pem)),
        (
            files.key,
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        ),
    ):
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    return files
