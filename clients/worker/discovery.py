"""Finding the leader's worker endpoint: ask the brokers in turn (``GET /api/v1/cluster``).

Used by the worker's connection (:mod:`clients.worker.link`, which re-exports these names)
before each connection attempt when ``brokers`` is set.
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence
from typing import NamedTuple

import httpx
import msgspec

from broker.api.api_models import ClusterSummary
from broker.security.auth import bearer_headers
from clients.worker.config import parse_host_port

__all__ = ["Leader", "LeaderUnknownError", "find_leader"]


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
