"""A certificate authority and a broker certificate generated at test time (trustme).

The certificate covers 127.0.0.1 and localhost, where test brokers listen; the CA's
PEM file is what clients, workers and brokers verify it with. ``for_java=True`` makes RSA
keys and writes the private key as PKCS#8, the one PEM key form Java servers (the Pulsar
standalone, tests/support/pulsar_security.py) read.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme
from cryptography.hazmat.primitives.serialization import (
    Encoding,
    NoEncryption,
    PrivateFormat,
    load_pem_private_key,
)

from broker.security.tls import client_context


@dataclass(frozen=True)
class TlsFiles:
    ca_path: Path  # PEM: the CA certificate
    cert_path: Path  # PEM: the broker's certificate chain
    key_path: Path  # PEM: its private key

    def broker_args(self) -> tuple[str, ...]:
        """``steward standalone`` / ``steward broker`` options serving with this certificate."""
        return (
            "--tls-cert",
            str(self.cert_path),
            "--tls-key",
            str(self.key_path),
            "--tls-ca",
            str(self.ca_path),
        )

    def client_context(self) -> ssl.SSLContext:
        """A verifying client context that trusts this CA."""
        return client_context(self.ca_path)


def make_tls_files(
    directory: Path,
    hosts: tuple[str, ...] = ("127.0.0.1", "localhost"),
    *,
    for_java: bool = False,
) -> TlsFiles:
    """A fresh CA and a certificate for ``hosts`` it signed, as PEM files in ``directory``
    (``for_java``: RSA keys, the private key as PKCS#8)."""
    directory.mkdir(parents=True, exist_ok=True)
    key_type = trustme.KeyType.RSA if for_java else trustme.KeyType.ECDSA
    ca = trustme.CA(key_type=key_type)
    cert = ca.issue_cert(*hosts, key_type=key_type)
    files = TlsFiles(
        ca_path=directory / "ca.pem",
        cert_path=directory / "broker-cert.pem",
        key_path=directory / "broker-key.pem",
    )
    ca.cert_pem.write_to_path(str(files.ca_path))
    cert.cert_chain_pems[0].write_to_path(str(files.cert_path))
    for extra in cert.cert_chain_pems[1:]:
        extra.write_to_path(str(files.cert_path), append=True)
    if for_java:
        key = load_pem_private_key(cert.private_key_pem.bytes(), password=None)
        pkcs8 = key.private_bytes(Encoding.PEM, PrivateFormat.PKCS8, NoEncryption())
        files.key_path.write_bytes(pkcs8)
    else:
        cert.private_key_pem.write_to_path(str(files.key_path))
    return files
