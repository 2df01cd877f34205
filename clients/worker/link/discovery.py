"""Where the worker connects, and what it says when it cannot.

With ``brokers`` (HTTP URLs of a broker or of any brokers of a cluster) set, each
connection attempt first asks them in turn for ``GET /api/v1/cluster`` and connects to the
leader's ``leader_worker_address``; no leader known yet counts as a failed attempt (see
``clients/worker/link/worker_link.py``). Without, it connects to the ``broker`` endpoint it was
given.

Failures are of two kinds: those retrying may heal (a broker down or restarting, an
election) and misconfigurations it cannot (an HTTP port given as the worker endpoint, a
worker port given as an HTTP URL, a wrong token, TLS on one side only). :class:`Problems`
logs a repeating failure once and then now and then, saying what the worker waits for,
and gives up on a misconfiguration after ``give_up_after_s`` (docs/OPERATIONS.md).
"""

from __future__ import annotations

import logging
import math
import ssl
import time
from collections.abc import Callable, Sequence
from typing import NamedTuple

import httpx
import msgspec

from broker.api.api_models import ClusterSummary
from broker.security.auth import bearer_headers
from clients.worker.artifacts import ArtifactCache
from clients.worker.config import WorkerConfig, parse_host_port
from wire.worker_protocol import ProtocolError

# One logger for all of the link's parts (operators and tests filter on this name).
logger = logging.getLogger("clients.worker.link")

_TOKEN_HINT = (
    "pass the worker credential (steward token create NAME --worker) or the shared worker "
    "token with --token-file PATH (or STEWARD_WORKER_TOKEN)"
)


class LeaderUnknownError(Exception):
    """No broker asked named a leader with a worker endpoint (none elected yet, or all
    unreachable)."""


class LinkMisconfiguredError(Exception):
    """What the worker was given cannot work however often it retries (wrong port or
    protocol, wrong token); the message names what was tried and what to pass instead."""


class BrokerError(Exception):
    """The broker sent an Error frame (it closes the connection after it)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def refusal(address: str, error: BrokerError) -> Exception:
    """An Error frame answering the Hello, as the error the worker acts on: a refused
    token cannot heal by retrying, anything else may."""
    if error.code == "unauthorized":
        return LinkMisconfiguredError(
            f"the broker at {address} refused the worker's token ({error.message}): " + _TOKEN_HINT
        )
    if error.code == "forbidden":
        return LinkMisconfiguredError(
            f"the broker at {address} refused the worker ({error.message}): give it a "
            "credential allowed to serve its --tenant list, or change the list"
        )
    return error


def sniff_answer(data: bytes, address: str, *, tls: bool) -> LinkMisconfiguredError | None:
    """The first bytes a worker endpoint answered: a misconfiguration when they are not
    Steward frames but HTTP (an HTTP port) or a TLS alert (a TLS port spoken to plainly)."""
    if data.startswith(b"HTTP/"):
        scheme = "https" if tls else "http"
        return LinkMisconfiguredError(
            f"{address} answered in HTTP: it is a broker's HTTP port, not its worker port; "
            f"pass its URL, --broker {scheme}://{address}, and the worker finds the worker "
            "endpoint there"
        )
    if not tls and len(data) >= 2 and data[0] == 0x15 and data[1] == 0x03:  # a TLS alert
        return LinkMisconfiguredError(
            f"{address} speaks TLS: add --tls (or, if it is a broker's HTTPS port, pass "
            f"--broker https://{address})"
        )
    return None


def _http_problem(url: str, exc: Exception, *, token: bool) -> tuple[str, bool]:
    """What asking ``url`` for the cluster went wrong with, and whether it is a
    misconfiguration (True) rather than something retrying may heal."""
    if isinstance(exc, httpx.HTTPStatusError):
        status = exc.response.status_code
        if status == 401:
            refused = "refused the worker's token" if token else "wants a token, none given"
            return f"{url} {refused} (HTTP 401 Unauthorized): {_TOKEN_HINT}", True
        if status == 404:
            return (
                f"{url} is not a Steward broker (HTTP 404 for /api/v1/cluster): pass a "
                "broker's HTTP URL (steward standalone/broker --http)",
                True,
            )
        return f"{url}: HTTP {status}", status < 500 and status != 429
    if isinstance(exc, msgspec.DecodeError):
        return f"{url} is not a Steward broker (its /api/v1/cluster is not a cluster summary)", True
    if isinstance(exc, httpx.RemoteProtocolError) and "without sending" not in str(exc):
        return (
            f"{url} does not answer HTTP (a worker port?): pass the broker's HTTP URL "
            "(steward standalone/broker --http, 8080 by default), or its worker endpoint as "
            "HOST:PORT without http:// to connect there directly",
            True,
        )
    causes = _causes(exc)
    tls_error = next((c for c in causes if isinstance(c, ssl.SSLError)), None)
    if tls_error is not None:
        if "WRONG_VERSION" in str(tls_error):
            return f"{url} does not speak HTTPS: write http:// for a broker without TLS", True
        return f"{url}: TLS failed ({tls_error.reason or tls_error}): check --tls-ca", True
    if any(isinstance(c, ConnectionRefusedError) for c in causes):
        return f"{url}: connection refused (is the broker running?)", False
    return f"{url}: {str(exc) or type(exc).__name__}", False


def _causes(exc: BaseException) -> list[BaseException]:
    """``exc`` and the exceptions it was raised from (httpx wraps httpcore's, which wrap
    the socket's)."""
    chain: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in chain:
        chain.append(current)
        current = current.__cause__ or current.__context__
    return chain


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
    misconfigured = 0  # of the problems, those retrying cannot heal
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
                problem, fatal = _http_problem(url, exc, token=token is not None)
                problems.append(problem)
                misconfigured += fatal
                continue
            address = summary.leader_worker_address
            if not address:
                problems.append(f"{url}: no leader known yet (an election under way?)")
                continue
            try:
                address = _reachable(address, summary.leader_url, url)
            except ValueError:
                problems.append(f"{url}: bad leader_worker_address {address!r}")
                continue
            return Leader(address, summary.leader_url, index, summary.leader_worker_tls)
    if problems and misconfigured == len(problems):
        raise LinkMisconfiguredError("; ".join(problems))
    raise LeaderUnknownError("; ".join(problems))


_WILDCARDS = ("0.0.0.0", "::", "")


def _reachable(address: str, leader_url: str | None, asked_url: str) -> str:
    """``address`` with a wildcard host (a broker listening on every interface, 0.0.0.0)
    replaced by the leader's HTTP host, else (that is a wildcard too: a standalone broker
    on --http 0.0.0.0:8080) the host the worker asked: an endpoint it can reach."""
    host, port = parse_host_port(address)
    if host not in _WILDCARDS:
        return address
    for url in (leader_url, asked_url):
        found = httpx.URL(url).host if url else ""
        if found not in _WILDCARDS:
            host = found
            break
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class Problems:
    """Failed connection attempts: logs each problem once, then (while it repeats) at most
    every ``problem_log_interval_s``, saying what the worker waits for; raises the
    :class:`LinkMisconfiguredError` once misconfigurations alone have failed it for
    ``give_up_after_s``."""

    def __init__(self, config: WorkerConfig, clock: Callable[[], float] = time.monotonic) -> None:
        self._config = config
        self._clock = clock
        self._last: str | None = None
        self._last_logged = -math.inf
        self._failures = 0  # since the last Welcome
        self._failing_since = 0.0
        self._misconfigured_since: float | None = None

    def connected(self) -> None:
        self._last, self._failures, self._misconfigured_since = None, 0, None
        self._last_logged = -math.inf

    def failed(self, address: str, exc: BaseException) -> None:
        c = self._config
        now = self._clock()
        if self._failures == 0:
            self._failing_since = now
        self._failures += 1
        misconfigured = isinstance(exc, LinkMisconfiguredError)
        if not misconfigured:
            self._misconfigured_since = None
        elif self._misconfigured_since is None:
            self._misconfigured_since = now
        text = describe(address, exc)
        if text != self._last or now - self._last_logged >= c.problem_log_interval_s:
            if misconfigured:
                then = f"exiting if it persists for {c.give_up_after_s:g} s"
            else:
                then = f"retrying every {c.reconnect_backoff_max_s:g} s at most"
            repeats = ""
            if self._failures > 1:
                repeats = f"; {self._failures} attempts in {now - self._failing_since:.0f} s"
            logger.warning("%s (%s%s)", text, then, repeats)
            self._last, self._last_logged = text, now
        if self._misconfigured_since is not None and (
            now - self._misconfigured_since >= c.give_up_after_s
        ):
            assert isinstance(exc, LinkMisconfiguredError)
            raise exc


def describe(address: str, exc: BaseException) -> str:
    """One line on a failed connection attempt to ``address``: what went wrong and, for
    what may heal, what the worker waits for."""
    if isinstance(exc, LinkMisconfiguredError):
        return str(exc)
    if isinstance(exc, LeaderUnknownError):
        return f"waiting for a leader's worker endpoint: {exc}"
    if isinstance(exc, ConnectionRefusedError):
        return f"waiting for the worker endpoint {address}: connection refused (broker down?)"
    if isinstance(exc, OSError | TimeoutError):
        return (
            f"waiting for the worker endpoint {address}: {exc.strerror or str(exc) or 'timed out'}"
        )
    if isinstance(exc, ProtocolError | BrokerError | EOFError):
        return f"connection to broker {address} failed: {exc}"
    return f"connection to broker {address} failed: {type(exc).__name__}: {exc}"


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
