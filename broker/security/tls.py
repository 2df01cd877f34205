"""TLS: the one place that builds SSL contexts, for servers and for clients.

A broker given a certificate and key (``--tls-cert``/``--tls-key``) serves its HTTP API
and its worker endpoint over TLS and advertises ``https://`` URLs. Everything that
connects to a broker (the Python client, the CLI, workers, other brokers fetching
snapshots and code artifacts) builds its context with :func:`client_context`: it always
verifies the server's certificate and host name, against the CA bundle given
(``--tls-ca`` / ``--ca-file`` / env ``STEWARD_TLS_CA``) or else the system trust store.
There is deliberately no switch to turn verification off.
"""

from __future__ import annotations

import functools
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Final

__all__ = [
    "CA_ENV",
    "TlsConfig",
    "TlsConfigError",
    "certificate_error",
    "client_context",
    "describe_certificate_error",
    "peer_ssl_context",
    "server_context",
]

#: Environment variable naming the CA bundle clients verify brokers against.
CA_ENV: Final = "STEWARD_TLS_CA"


class TlsConfigError(ValueError):
    """A certificate, key or CA file is missing or unusable (the message says which)."""


@dataclass(frozen=True)
class TlsConfig:
    """A broker's TLS settings: its certificate chain and key, and the CA bundle it
    verifies other brokers with (None: the system trust store)."""

    cert_path: Path
    key_path: Path
    ca_path: Path | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "cert_path", Path(self.cert_path))
        object.__setattr__(self, "key_path", Path(self.key_path))
        if self.ca_path is not None:
            object.__setattr__(self, "ca_path", Path(self.ca_path))

    @classmethod
    def from_options(
        cls, cert: str | Path | None, key: str | Path | None, ca: str | Path | None = None
    ) -> TlsConfig | None:
        """From ``--tls-cert``/``--tls-key``/``--tls-ca``: None when TLS is off; an error
        when only one of certificate and key is given."""
        if cert is None and key is None:
            return None
        if cert is None or key is None:
            raise TlsConfigError("TLS needs both --tls-cert and --tls-key")
        return cls(Path(cert), Path(key), Path(ca) if ca is not None else None)

    def server_context(self) -> ssl.SSLContext:
        return server_context(self)

    def client_context(self) -> ssl.SSLContext:
        """For this broker's calls to other brokers."""
        return client_context(self.ca_path)


def _check_file(path: Path, what: str) -> None:
    if not path.is_file():
        raise TlsConfigError(f"{what} {str(path)!r} does not exist or is not a file")
    if not os.access(path, os.R_OK):
        raise TlsConfigError(f"{what} {str(path)!r} is not readable")


def server_context(config: TlsConfig) -> ssl.SSLContext:
    """A server context with the broker's certificate chain and key (TLS >= 1.2)."""
    _check_file(config.cert_path, "TLS certificate")
    _check_file(config.key_path, "TLS key")
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        context.load_cert_chain(config.cert_path, config.key_path)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TlsConfigError(
            f"cannot use TLS certificate {str(config.cert_path)!r} with key "
            f"{str(config.key_path)!r}: {_reason(exc)}"
        ) from None
    return context


def client_context(ca_path: str | Path | None = None) -> ssl.SSLContext:
    """A client context that verifies the server's certificate and host name: against
    ``ca_path`` (a PEM bundle) when given, else the system trust store."""
    if ca_path is not None:
        _check_file(Path(ca_path), "CA bundle")
    try:
        # CERT_REQUIRED and check_hostname=True, TLS >= 1.2.
        context = ssl.create_default_context(cafile=str(ca_path) if ca_path is not None else None)
    except (ssl.SSLError, OSError, ValueError) as exc:
        raise TlsConfigError(f"cannot use CA bundle {str(ca_path)!r}: {_reason(exc)}") from None
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    return context


@functools.cache
def peer_ssl_context() -> ssl.SSLContext:
    """The system-trust client context a broker uses to call its peers (dashboard statuses,
    task output proxying) when it was given no CA bundle of its own."""
    # Once: building one loads the CA bundle (~50 ms), which would stall the event loop
    # on every dashboard refresh.
    return client_context()


def certificate_error(exc: BaseException) -> ssl.SSLCertVerificationError | None:
    """The certificate verification failure behind ``exc`` (httpx and asyncio wrap it),
    or None when ``exc`` is something else."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLCertVerificationError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def describe_certificate_error(error: ssl.SSLCertVerificationError) -> str:
    """``certificate verify failed: <why>`` without the ``(_ssl.c:NNNN)`` noise."""
    reason = error.verify_message or error.reason or "unknown reason"
    return f"certificate verify failed: {reason}"


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError) and exc.reason:
        return str(exc.reason)
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc) or type(exc).__name__
