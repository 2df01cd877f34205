"""What every part of the HTTP API shares: its configuration, the request, errors and
their JSON bodies, query parsing, and the views the handlers answer with."""

from __future__ import annotations

import asyncio
import math
import re
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol, TypeVar
from urllib.parse import parse_qsl

import msgspec

from broker.api import api_models as m
from broker.api.edges import HttpEdgeConfig
from broker.artifacts.code_store import ArtifactLimits
from broker.core import (
    FINAL_STATES,
    ApiToken,
    Artifact,
    ErrorCode,
    Rejected,
    TaskState,
    TreeRecord,
    Worker,
    WorkerState,
    validate_idempotency_key,
)
from broker.core.admission import MAX_PARAMS_BYTES, Inadmissible, Refusal
from broker.security.auth import ANONYMOUS_ADMIN, AuthConfig, Principal

CHALLENGE: Final = ((b"www-authenticate", b'Bearer realm="steward"'),)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]
json_encoder: Final = msgspec.json.Encoder()

_STATUS_BY_CODE: Final = {
    ErrorCode.INVALID: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.SLOT_BUSY: 409,
    ErrorCode.CONFLICT: 409,
    ErrorCode.STALE: 409,
    ErrorCode.TENANT_QUEUE_FULL: 429,
}
TASK_STATES: Final = frozenset(s.value for s in TaskState)
FINAL: Final = frozenset(s.value for s in FINAL_STATES)
JSON_TYPE: Final = b"application/json"
MAX_TTL_S: Final = m.MAX_TRANSACTION_TTL_S
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
# For the schema: the artifact names code_store.check_artifact_name takes.
ARTIFACT_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"
# How long a follower waits to apply the assignment a worker downloads an artifact for.
ASSIGNMENT_WAIT_S: Final = 2.0


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_request_bytes: int = 8 * 1024 * 1024
    max_code_bytes: int = 64 * 1024 * 1024
    # A .py's size, a zip's entries, inflated size and ratio, the check process's limits.
    artifact_limits: ArtifactLimits = field(default_factory=ArtifactLimits)
    max_wait_s: float = 60.0
    # GET /api/v1/events: task ids per stream, open streams per broker, keep-alive period.
    max_event_tasks: int = 10_000
    max_event_streams: int = 1_000
    event_keepalive_s: float = 15.0
    # The feed (GET /api/v1/events without tasks): recent events held for resuming with
    # Last-Event-ID, about 100 bytes each (the final task an event refers to is the
    # state's own until its retention, 24 h by default, purges it; the ring keeps it
    # alive until the event leaves the ring), and the events a stream may fall behind
    # before it is ended (its client resumes).
    event_history: int = 100_000
    max_event_backlog: int = 10_000
    max_tasks_per_request: int = 10_000
    max_params_bytes: int = MAX_PARAMS_BYTES
    max_list_limit: int = 1_000
    # Brokers that must hold an uploaded artifact before tasks using it may run (docs/DESIGN.md
    # §7). Above 1 the upload is logged not ready; the leader's CodeReplicaMonitor readies it.
    min_code_replicas: int = 1
    # Tokens from the configuration; authentication is on when it holds an admin token.
    auth: AuthConfig = field(default_factory=AuthConfig)
    # Header size, header and body deadlines, connection cap (broker/api/edges.py).
    edges: HttpEdgeConfig = field(default_factory=HttpEdgeConfig)


class Binary(bytes):
    """A response body served as application/octet-stream instead of JSON."""

    # Extra response headers (lowercase names), set on an instance when needed.
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/octet-stream"


class Stream(Binary):
    """A response sent while it is produced (server-sent events): ``chunks`` are sent as
    they come, each as its own body message, until they end or the client disconnects;
    then ``close`` runs, whichever happened (see :func:`send_stream`)."""

    content_type = b"text/event-stream"
    chunks: AsyncIterator[bytes]
    close: Callable[[], None]

    @classmethod
    def of(cls, chunks: AsyncIterator[bytes], close: Callable[[], None]) -> Stream:
        stream = cls()
        stream.chunks = chunks
        stream.close = close
        return stream


async def send_stream(status: int, stream: Stream, receive: Receive, send: Send) -> None:
    """Send ``stream`` as an ASGI response: chunked, one body message per chunk, ended
    cleanly when its chunks end, abandoned when the client disconnects first."""

    async def pump() -> None:
        headers = [
            (b"content-type", stream.content_type),
            (b"cache-control", b"no-cache"),
            (b"x-accel-buffering", b"no"),  # a proxy in front must not hold events back
            *stream.headers,
        ]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        async for chunk in stream.chunks:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pumping = asyncio.ensure_future(pump())
    watching = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait((pumping, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (pumping, watching):
            task.cancel()
        await asyncio.gather(pumping, watching, return_exceptions=True)
        aclose = getattr(stream.chunks, "aclose", None)
        if aclose is not None:
            await aclose()
        stream.close()
    error = None if pumping.cancelled() else pumping.exception()
    if error is not None:
        raise error  # mid-response: uvicorn logs it and cuts the connection


class HttpError(Exception):
    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        headers: tuple[tuple[bytes, bytes], ...] = (),
        *,
        leader_url: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers
        self.leader_url = leader_url
        self.retryable = retryable


class ClusterView(Protocol):
    """What the API needs to know about the cluster around its broker."""

    @property
    def url(self) -> str:
        """This broker's base URL."""

    @property
    def worker_address(self) -> str | None:
        """This broker's worker endpoint ("host:port"), when it has one."""

    @property
    def worker_tls(self) -> bool:
        """Whether workers connect to the worker endpoint with TLS."""

    @property
    def peer_ssl_context(self) -> ssl.SSLContext | None:
        """How to verify other brokers' HTTPS (None: the system's trust store)."""

    def leader(self) -> m.BrokerSummary | None:
        """The current leader (None: no leader known right now)."""

    def brokers(self) -> list[m.BrokerSummary]:
        """Every live broker but this one, as advertised in ZooKeeper."""

    def broker_summaries(self, own: m.BrokerSummary) -> list[m.BrokerSummary]:
        """``own`` then every other broker known, unreachable ones too, with each one's
        state as last polled (docs/DESIGN.md §4)."""

    def coordination_problem(self) -> str | None:
        """Why this broker cannot reach ZooKeeper now, in words (None: it can)."""


def error_code(code: ErrorCode) -> str:
    # The API says "invalid_request" for every invalid input, wherever it is caught.
    return "invalid_request" if code is ErrorCode.INVALID else code.value


_STATUS_BY_REFUSAL: Final = {
    Refusal.INVALID: (400, "invalid_request"),
    Refusal.TOO_LARGE: (413, "too_large"),
    Refusal.UNKNOWN_CODE: (404, "not_found"),
}


def admission_error(problem: Inadmissible, where: str) -> HttpError:
    """The answer to a new task the admission rule refuses (broker/core/admission.py);
    ``where`` names the task in the request ("tasks[2]: ")."""
    status, code = _STATUS_BY_REFUSAL[problem.refusal]
    return HttpError(status, code, where + problem.message)


def rejected_error(rejected: Rejected) -> HttpError:
    return HttpError(
        _STATUS_BY_CODE.get(rejected.code, 400), error_code(rejected.code), rejected.message
    )


# "YYYY-MM-DDTHH:MM:SS" of recent whole seconds: a task view shows several times, mostly
# within the same few seconds, and formatting a datetime is most of a view's cost.
_SECONDS_SHOWN: dict[int, str] = {}
_SECONDS_KEPT: Final = 4096


def iso_ms(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    # Integer arithmetic: fromtimestamp(ms / 1000) can show .999 as .998 (float seconds).
    seconds, ms = divmod(epoch_ms, 1000)
    shown = _SECONDS_SHOWN.get(seconds)
    if shown is None:
        if len(_SECONDS_SHOWN) >= _SECONDS_KEPT:
            _SECONDS_SHOWN.clear()
        moment = _EPOCH + timedelta(seconds=seconds)
        shown = _SECONDS_SHOWN[seconds] = moment.isoformat(timespec="seconds")[:-6]
    return f"{shown}.{ms:03d}Z"


def to_epoch_ms(value: datetime | float | None, field_name: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, datetime):
        if value.tzinfo is None:
            raise HttpError(400, "invalid_request", f"{field_name} must include a time zone")
        # Same range as Unix seconds: outside it the time cannot be shown back as RFC 3339.
        value = value.timestamp()
    if not math.isfinite(value) or not 0 <= value < 1e11:
        raise HttpError(
            400,
            "invalid_request",
            f"{field_name} must be Unix seconds or RFC 3339, from 1970 to 5138",
        )
    return round(value * 1000)  # round: int() would turn .999 into .998


_T = TypeVar("_T")


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    params: tuple[str, ...]
    headers: Sequence[tuple[bytes, bytes]] = ()  # ASGI: names lowercase
    principal: Principal = ANONYMOUS_ADMIN  # who is calling (authentication off: anyone)
    client: Sequence[Any] | None = None  # ASGI's (host, port) of the client

    @property
    def peer(self) -> str:
        """The client's "host:port", for logs (formatted only when logged)."""
        if not self.client:
            return "?"
        host, port = self.client[0], self.client[1]
        return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"

    def header(self, name: bytes) -> bytes | None:
        """The value of a header sent once (``name`` lowercase); 400 when repeated."""
        values = [v for n, v in self.headers if n == name]
        if len(values) > 1:
            raise HttpError(400, "invalid_request", f"header {name.decode()} sent twice")
        return values[0] if values else None


def token_view(token: ApiToken) -> m.TokenView:
    return m.TokenView(
        id=token.id,
        name=token.name,
        role=token.role,
        tenant=token.tenant,
        tenants=token.tenants,
        created_at=iso_ms(token.created_ms) or "",
    )


def artifact_view(artifact: Artifact, tenant: str | None = None) -> m.ArtifactView:
    """The artifact as ``tenant`` sees it (None: an admin): its own upload's name and time
    when it uploaded it, never another tenant's."""
    upload = artifact.upload_of(tenant) if tenant is not None else None
    name, created_ms = (
        (upload.name, upload.created_ms) if upload else (artifact.name, artifact.created_ms)
    )
    return m.ArtifactView(
        sha256=artifact.sha256,
        name=name,
        size_bytes=artifact.size_bytes,
        created_at=iso_ms(created_ms) or "",
        ready=artifact.ready,
    )


def tree_view(tree: TreeRecord | None) -> m.TreeView | None:
    if tree is None:
        return None
    return m.TreeView(
        state=tree.state, attempt=tree.attempt, timeout_s=tree.timeout_ms / 1000, reason=tree.reason
    )


def task_view(
    task: Any, tree: TreeRecord | None, workers: Mapping[str, Worker] | None = None
) -> m.TaskView:
    """The task as the API shows it; ``workers`` (the state's) tells whether the worker of a
    running task is still connected (docs/DESIGN.md §8, "Closed connections")."""
    worker = (
        workers.get(task.worker)
        if workers is not None and task.worker is not None and task.state == TaskState.RUNNING
        else None
    )
    disconnected_ms = (
        worker.updated_ms  # a disconnected worker's last change: its disconnection
        if worker is not None and worker.state == WorkerState.DISCONNECTED
        else None
    )
    return m.TaskView(
        id=task.id,
        type=task.type,
        tenant=task.tenant,
        state=task.state,
        params=msgspec.Raw(task.params),
        attempt=task.attempt,
        max_attempts=task.max_attempts,
        created_at=iso_ms(task.created_ms) or "",
        updated_at=iso_ms(task.updated_ms) or "",
        slot=task.slot,
        transaction=task.transaction,
        code=task.code,
        resources=task.resources,
        worker=task.worker,
        result=msgspec.Raw(task.result) if task.result is not None else None,
        error=task.error,
        deadline=iso_ms(task.deadline_ms),
        start_after=iso_ms(task.start_after_ms),
        finished_at=iso_ms(task.finished_ms),
        started_at=iso_ms(task.started_ms),
        queued_ms=task.queued_ms,
        tree=tree_view(tree),
        root=task.root,
        parent=task.parent,
        after=list(task.after),
        waiting_for=list(task.waiting_for),
        priority=task.priority,
        retry_backoff_s=task.retry_backoff_ms / 1000 if task.retry_backoff_ms else None,
        retry_backoff_max_s=task.retry_backoff_max_ms / 1000 if task.retry_backoff_ms else None,
        lost=task.lost,
        max_lost=task.max_lost,
        worker_state=worker.state if worker is not None else None,
        lost_suspected_at=iso_ms(disconnected_ms),
    )


def decode(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
    if not body.strip():
        raise HttpError(400, "invalid_request", "a JSON request body is required")
    try:
        return decoder.decode(body)
    except msgspec.ValidationError as exc:
        raise HttpError(400, "invalid_request", str(exc)) from None
    except msgspec.DecodeError as exc:
        raise HttpError(400, "invalid_json", f"malformed JSON: {exc}") from None
    except RecursionError:
        raise HttpError(400, "invalid_json", "JSON nested too deeply") from None


def error_bytes(
    code: str, message: str, leader_url: str | None = None, retryable: bool = False
) -> bytes:
    return json_encoder.encode(m.ErrorBody(m.ErrorDetail(code, message, leader_url, retryable)))


def idempotency_key(request: Request, in_body: str | None) -> str | None:
    """The submission's idempotency key, from the header or the body (both: equal)."""
    raw = request.header(b"idempotency-key")
    key = in_body
    if raw is not None:
        try:
            key = raw.decode("ascii")
        except UnicodeDecodeError:
            key = raw.decode("latin-1")  # refused just below, with the same message
        if in_body is not None and in_body != key:
            raise HttpError(
                400,
                "invalid_request",
                "the Idempotency-Key header and the idempotency_key field differ",
            )
    if key is not None:
        problem = validate_idempotency_key(key)
        if problem is not None:
            raise HttpError(400, "invalid_request", problem)
    return key


def parse_query(raw: bytes) -> dict[str, str]:
    if not raw:
        return {}
    try:
        pairs = parse_qsl(raw.decode("ascii"), keep_blank_values=True, strict_parsing=True)
    except (UnicodeDecodeError, ValueError):
        raise HttpError(400, "invalid_request", "malformed query string") from None
    query: dict[str, str] = {}
    for key, value in pairs:
        if key in query:
            raise HttpError(400, "invalid_request", f"query parameter {key!r} given twice")
        query[key] = value
    return query


def float_param(query: dict[str, str], name: str, default: float, low: float, high: float) -> float:
    raw = query.get(name)
    if raw is None:
        return default
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and low <= value <= high):
        raise HttpError(400, "invalid_request", f"{name} must be a number in [{low}, {high}]")
    return value


def bool_param(query: dict[str, str], name: str) -> bool:
    raw = query.get(name)
    if raw is None or raw in ("false", "0"):
        return False
    # Not "": the document says boolean, and a bare ?name is no boolean (issue 17).
    if raw in ("true", "1"):
        return True
    raise HttpError(400, "invalid_request", f"{name} must be true or false")


def no_query(request: Request) -> None:
    if request.query:
        raise HttpError(400, "invalid_request", "this endpoint takes no query parameters")


def int_param(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"\d{1,19}", raw) or not low <= int(raw) <= high:
        raise HttpError(400, "invalid_request", f"{name} must be an integer in [{low}, {high}]")
    return int(raw)
