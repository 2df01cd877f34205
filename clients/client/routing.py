"""Leader-following and retries shared by the sync and async clients: which broker gets
the next request, what to do after each answer or transport error (no IO here), and the
settings both clients' transports use."""

from __future__ import annotations

import os
import random
import ssl
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final, TypeVar

from broker.security.auth import bearer_headers
from broker.security.tls import certificate_error, client_context, describe_certificate_error
from clients.client.errors import (
    CertificateVerifyError,
    ConnectionFailedError,
    FailoverTimeoutError,
    StewardError,
    UnavailableError,
    _error_detail,
)
from clients.client.transport import InvalidURLError, Response, header_value

DEFAULT_FAILOVER_TIMEOUT_S: Final = 30.0
_BACKOFF_MIN_S: Final = 0.1
_BACKOFF_MAX_S: Final = 2.0


def parse_urls(url: str | Sequence[str]) -> list[str]:
    """Broker base URLs from one URL, a comma-separated list, or a sequence of either."""
    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in u.split(",")]
    urls = list(dict.fromkeys(p.strip().rstrip("/") for p in parts if p.strip()))
    if not urls:
        raise ValueError("no broker URL given")
    return urls


def _idempotency_header(key: str | None) -> str:
    # One key per call, sent on every try: the broker creates the tasks once. 128 random
    # bits (a uuid4 has 122), without building a UUID.
    if key is None:
        return f"Idempotency-Key: {os.urandom(16).hex()}\r\n"
    return f"Idempotency-Key: {header_value(key, 'idempotency_key')}\r\n"


def _verify(ca_file: str | Path | ssl.SSLContext | None) -> ssl.SSLContext:
    """https:// brokers are always verified (host name included): against ``ca_file``
    (a PEM bundle, or a ready context) or else the system trust store."""
    if isinstance(ca_file, ssl.SSLContext):
        return ca_file
    return client_context(ca_file)


def _client_headers(token: str | None) -> str:
    """The header lines every request of a client carries (the bearer token)."""
    return "".join(
        f"{name}: {header_value(value, 'token')}\r\n"
        for name, value in bearer_headers(token).items()
    )


C = TypeVar("C", bound="_ClientBase")


class _ClientBase:
    """What both clients hold: the brokers' URLs, the router, the default timeout."""

    def __init__(
        self,
        url: str | Sequence[str],
        timeout_s: float,
        failover_timeout_s: float,
        ca_file: str | Path | ssl.SSLContext | None,
        token: str | None,
    ) -> None:
        self.urls = parse_urls(url)
        self.url = self.urls[0]
        self._timeout_s = timeout_s
        self._router = _Router(self.urls, failover_timeout_s)
        # Built once (loading the trust store takes ~30 ms): clones share it.
        self._tls = _verify(ca_file)
        self._headers = _client_headers(token)
        self._options: dict[str, Any] = {
            "timeout_s": timeout_s,
            "ca_file": self._tls,
            "failover_timeout_s": failover_timeout_s,
            "token": token,
        }

    def _clone(self: C) -> C:
        """A new client (its own connections) to the same brokers, with the same settings."""
        clone = type(self)(self.urls, **self._options)
        clone._router.leader = self._router.leader
        return clone

    @property
    def leader_url(self) -> str | None:
        """The leader's base URL, once a follower named it."""
        return self._router.leader


class _Router:
    """Which broker gets the next request: the leader once known, else the URLs in
    turn. Shared by the sync and async clients (no IO here)."""

    def __init__(self, urls: list[str], failover_timeout_s: float) -> None:
        self.urls = urls
        self.failover_timeout_s = failover_timeout_s
        self.leader: str | None = None
        self._index = 0

    def target(self) -> str:
        return self.leader or self.urls[self._index]

    def failed(self, base: str) -> None:
        """``base`` could not take the request: forget it as leader, go on to the next URL."""
        if base == self.leader:
            self.leader = None
        if base == self.urls[self._index]:
            self._index = (self._index + 1) % len(self.urls)


class _Call:
    """The tries of one request: what to do after each answer or transport error.

    Writes try until ``failover_timeout_s`` is over; reads try each broker once.
    Both return the pause before the next try, or raise when giving up.
    """

    def __init__(self, router: _Router, write: bool) -> None:
        self.router = router
        self.write = write
        self.started = time.monotonic()
        self.deadline = self.started + router.failover_timeout_s
        self.attempts = 0
        self.tried: set[str] = set()
        self.since_pause: set[str] = set()  # brokers tried since the last backoff
        self.redirects = 0
        self.backoff_s = _BACKOFF_MIN_S

    def target(self) -> str:
        base = self.router.target()
        self.attempts += 1
        self.tried.add(base)
        self.since_pause.add(base)
        return base

    def failed(self, base: str, exc: Exception) -> float:
        error = ConnectionFailedError(base, str(exc) or type(exc).__name__)
        if isinstance(exc, InvalidURLError):
            raise error from exc  # a malformed URL does not get better
        cert_error = certificate_error(exc)
        if cert_error is not None:  # nor does a certificate we do not trust
            raise CertificateVerifyError(base, describe_certificate_error(cert_error)) from exc
        self.router.failed(base)
        if not self.write:
            if self.router.target() in self.tried:
                raise error from exc
            return 0.0
        return self._pause(error)

    def answered(self, base: str, response: Response) -> float | None:
        """None: this response is the answer (success or an error to raise). Redirects
        are followed here, by hand: only not_leader ones, and the leader is remembered."""
        status = response.status
        if not self.write or (status < 300 and status != 503):
            return None
        detail = _error_detail(response)
        code = str(detail.get("code", "http_error"))
        leader_url = detail.get("leader_url")
        if 300 <= status < 400 and code == "not_leader" and isinstance(leader_url, str):
            leader = leader_url.rstrip("/")
            # Brokers with stale views could send us back and forth: pause now and then.
            self.redirects += 1
            if leader != base and self.redirects <= len(self.router.urls) + 1:
                self.router.leader = leader
                if time.monotonic() < self.deadline:
                    return 0.0
        elif not (status == 503 or detail.get("retryable") is True or code == "not_leader"):
            return None
        error = UnavailableError(status, code, str(detail.get("message", response.reason)))
        self.router.failed(base)
        return self._pause(error)

    def _pause(self, error: StewardError) -> float:
        now = time.monotonic()
        if now >= self.deadline:
            raise FailoverTimeoutError(error, now - self.started, self.attempts) from error
        if self.router.target() not in self.since_pause:
            return 0.0  # a broker not tried yet this round: at once
        pause_s = min(random.uniform(self.backoff_s / 2, self.backoff_s), self.deadline - now)
        self.backoff_s = min(self.backoff_s * 2, _BACKOFF_MAX_S)
        self.since_pause.clear()
        self.redirects = 0
        return pause_s
