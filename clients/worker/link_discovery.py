"""Where the worker connects: the broker it was given, or the leader its brokers name.

With ``brokers`` (HTTP URLs of a cluster) set, each connection attempt first asks them in
turn for ``GET /api/v1/cluster`` and connects to the leader's ``leader_worker_address``;
no leader known yet counts as a failed attempt (see ``clients/worker/link.py``).
"""

from __future__ import annotations

import logging
import ssl
from collections.abc import Sequence
from typing import NamedTuple

import httpx
import msgspec

from broker.api.api_models import ClusterSummary
from broker.security.auth import bearer_headers
from clients.worker.artifacts import ArtifactCache
from clients.worker.config import WorkerConfig, parse_host_port

# The link's logger: these lines were always logged under its name.
logger = logging.getLogger("clients.worker.link")


class LeaderUnknownError(Exception):
    """No broker asked named a leader with a worker endpoint (none elected yet, or all
    unreachable)."""


_summary_decoder: msgspec.json.Decoder[ClusterSummary] = msgspec.json.Decoder(ClusterSummary)


class Leader(NamedTuple):
    """Where the leader is, as a broker named it."""

    worker_address: str  # "host:port" of its worker endpoint
    url: str | None  # its HTTP base URL
    answered_by: int  # the index of the URL that answered
    worker_tls: bool = False  # the worker endpoint speaks TLS


async def find_leader(
    urls: Sequence[str],
    *,
    timeout_s: float,
    token: str | None = None,
    start: int = 0,
    ssl_context: ssl.SSLContext | None = None,
) -> Leader:
    """Ask the brokers in turn (from ``start``) who leads. https:// brokers are verified
    with ``ssl_context`` (default: httpx's). Raises LeaderUnknownError."""
    headers = bearer_headers(token)
    problems: list[str] = []
    verify: ssl.SSLContext | bool = ssl_context if ssl_context is not None else True
    async with httpx.AsyncClient(timeout=timeout_s, headers=headers, verify=verify) as http:
        for i in range(len(urls)):
            index = (start + i) % len(urls)
            url = urls[index]
            try:
                response = await http.get(f"{url}/api/v1/cluster")
                response.raise_for_status()
                summary = _summary_decoder.decode(response.content)
            except (httpx.HTTPError, msgspec.DecodeError) as exc:
                problems.append(f"{url}: {str(exc) or type(exc).__name__}")
                continue
            address = summary.leader_worker_address
            if not address:
                problems.append(f"{url}: no leader known")
                continue
            try:
                parse_host_port(address)
            except ValueError:
                problems.append(f"{url}: bad leader_worker_address {address!r}")
                continue
            return Leader(address, summary.leader_url, index, summary.leader_worker_tls)
    raise LeaderUnknownError("; ".join(problems))


class BrokerLocator:
    """Finds the broker for each connection attempt; ``broker_address`` is where the
    current/last connection goes (found anew each time with brokers)."""

    def __init__(self, config: WorkerConfig, artifacts: ArtifactCache) -> None:
        self._config = config
        self._artifacts = artifacts
        self.broker_address = config.broker if not config.brokers else ",".join(config.brokers)
        self._discovery_start = 0  # the broker that last named the leader is asked first

    async def find(self) -> tuple[str, int, bool]:
        """Where to connect (host, port, with TLS): ``broker``, or the leader the brokers
        name right now."""
        c = self._config
        if not c.brokers:
            return *c.broker_address(), c.tls
        address, leader_url, self._discovery_start, worker_tls = await find_leader(
            c.brokers,
            timeout_s=c.discovery_timeout_s,
            token=c.token,
            start=self._discovery_start,
            ssl_context=c.ssl_context(),
        )
        if address != self.broker_address:
            logger.info("the leader's worker endpoint is %s (%s)", address, leader_url or "?")
        self.broker_address = address
        if c.download_from_leader and leader_url:
            # The leader holds every artifact a live task references (docs/DESIGN.md §4).
            self._artifacts.http_url = leader_url.rstrip("/")
        # Never downgrade: --tls forces TLS even if a broker announced none.
        return *parse_host_port(address), c.tls or worker_tls
