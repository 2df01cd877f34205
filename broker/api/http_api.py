"""The HTTP JSON API under ``/api/v1/``: a small ASGI app.

Deliberately frameworkless: the submission path is the hot path, and routing,
validation (msgspec) and encoding here cost a few microseconds per request.
Every client mistake gets a 4xx with ``{"error": {"code", "message"}}``;
nothing is logged for a request that is rejected before it is logged.
"""

from __future__ import annotations

import asyncio
import heapq
import logging
import math
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final, Protocol, TypeVar
from urllib.parse import parse_qsl

import msgspec
from msgspec import UnsetType

from broker.api import api_models as m
from broker.api.edges import HttpEdgeConfig
from broker.api.output_store import (
    PROXIED_HEADER,
    LogsError,
    OutputStore,
    TaskLogs,
    logs_answer,
    logs_from_leader,
)
from broker.artifacts.code_store import (
    ArtifactLimits,
    ArtifactTooLargeError,
    CodeStore,
    InvalidArtifactError,
    UploadChecker,
)
from broker.core import entries as e
from broker.core.state import (
    FINAL_STATES,
    MAX_TREE_TIMEOUT_MS,
    NAME_RE,
    ApiToken,
    Applied,
    Artifact,
    ErrorCode,
    Rejected,
    ReplayedResults,
    TaskRef,
    TaskState,
    Tenant,
    TransactionDone,
    TransactionRef,
    TreeRecord,
    TreeState,
    WorkerState,
    validate_idempotency_key,
    validate_limits,
    validate_task_spec,
    validate_token_fields,
)
from broker.observability import dashboard
from broker.observability.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from broker.replication.node import VERSION, BrokerUnavailableError, Node, Role, Stamp
from broker.security.auth import (
    ANONYMOUS_ADMIN,
    AuthConfig,
    AuthError,
    Principal,
    bearer_token,
    hash_token,
    new_token,
    new_token_id,
)
from broker.security.auth import Role as CallerRole
from snapshot.peer import (
    LATEST_SNAPSHOT_PATH,
    POSITION_HEADER,
    format_position,
    read_latest_snapshot,
)

logger = logging.getLogger(__name__)

_CHALLENGE: Final = ((b"www-authenticate", b'Bearer realm="steward"'),)

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

_json_encoder: Final = msgspec.json.Encoder()
_submit_decoder: Final = msgspec.json.Decoder(m.SubmitBody)
_txn_decoder: Final = msgspec.json.Decoder(m.TransactionBegin)
_limits_decoder: Final = msgspec.json.Decoder(m.TenantLimits)
_config_decoder: Final = msgspec.json.Decoder(m.ClusterConfigPatch)
_token_decoder: Final = msgspec.json.Decoder(m.TokenCreate)

_STATUS_BY_CODE: Final = {
    ErrorCode.INVALID: 400,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.SLOT_BUSY: 409,
    ErrorCode.CONFLICT: 409,
    ErrorCode.STALE: 409,
    ErrorCode.TENANT_QUEUE_FULL: 429,
}
_TASK_STATES: Final = frozenset(s.value for s in TaskState)
_FINAL: Final = frozenset(s.value for s in FINAL_STATES)
JSON_TYPE: Final = b"application/json"
_MAX_TTL_S: Final = m.MAX_TRANSACTION_TTL_S
_EPOCH: Final = datetime(1970, 1, 1, tzinfo=UTC)
# For the schema: the artifact names code_store.check_artifact_name takes.
ARTIFACT_NAME_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"
# How long a follower waits to apply the assignment a worker downloads an artifact for.
_ASSIGNMENT_WAIT_S: Final = 2.0


@dataclass(frozen=True)
class ApiConfig:
    host: str = "127.0.0.1"
    port: int = 8080
    max_request_bytes: int = 8 * 1024 * 1024
    max_code_bytes: int = 64 * 1024 * 1024
    # A .py's size, a zip's entries, inflated size and ratio, the check process's limits.
    artifact_limits: ArtifactLimits = field(default_factory=ArtifactLimits)
    max_wait_s: float = 60.0
    max_tasks_per_request: int = 10_000
    max_params_bytes: int = 64 * 1024
    max_list_limit: int = 1_000
    # Replicas an uploaded artifact needs before tasks using it may run (docs/DESIGN.md §7). Above
    # 1 the upload is logged not ready; the leader's ReplicationMonitor readies it.
    min_replication: int = 1
    # Tokens from the configuration; authentication is on when it holds an admin token.
    auth: AuthConfig = field(default_factory=AuthConfig)
    # Header size, header and body deadlines, connection cap (broker/api/edges.py).
    edges: HttpEdgeConfig = field(default_factory=HttpEdgeConfig)


class Binary(bytes):
    """A response body served as application/octet-stream instead of JSON."""

    # Extra response headers (lowercase names), set on an instance when needed.
    headers: tuple[tuple[bytes, bytes], ...] = ()
    content_type: bytes = b"application/octet-stream"


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


def _error_code(code: ErrorCode) -> str:
    # The API says "invalid_request" for every invalid input, wherever it is caught.
    return "invalid_request" if code is ErrorCode.INVALID else code.value


def _rejected_error(rejected: Rejected) -> HttpError:
    return HttpError(
        _STATUS_BY_CODE.get(rejected.code, 400), _error_code(rejected.code), rejected.message
    )


def iso_ms(epoch_ms: int | None) -> str | None:
    if epoch_ms is None:
        return None
    # Integer arithmetic: fromtimestamp(ms / 1000) can show .999 as .998 (float seconds).
    moment = _EPOCH + timedelta(milliseconds=epoch_ms)
    return moment.isoformat(timespec="milliseconds")[:-6] + "Z"


def _to_epoch_ms(value: datetime | float | None, field_name: str) -> int | None:
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

Handler = Callable[["Request"], Awaitable[tuple[int, bytes]]]


@dataclass(slots=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    body: bytes
    params: tuple[str, ...]
    headers: Sequence[tuple[bytes, bytes]] = ()  # ASGI: names lowercase
    principal: Principal = ANONYMOUS_ADMIN  # who is calling (authentication off: anyone)
    peer: str = "?"  # the client's "host:port", for logs

    def header(self, name: bytes) -> bytes | None:
        """The value of a header sent once (``name`` lowercase); 400 when repeated."""
        values = [v for n, v in self.headers if n == name]
        if len(values) > 1:
            raise HttpError(400, "invalid_request", f"header {name.decode()} sent twice")
        return values[0] if values else None


class Route:
    __slots__ = ("handlers", "max_body_bytes", "pattern", "public")

    def __init__(self, pattern: str, max_body_bytes: int, public: bool = False) -> None:
        self.pattern = re.compile("^" + pattern + "$")
        self.handlers: dict[str, Handler] = {}
        self.max_body_bytes = max_body_bytes
        self.public = public  # served without credentials even when authentication is on


class ApiApp:
    """ASGI application serving the broker's API."""

    def __init__(
        self,
        node: Node,
        config: ApiConfig,
        code_store: CodeStore | None = None,
        cluster: ClusterView | None = None,
        outputs: OutputStore | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.code_store = code_store
        # Task output the leader's worker link collects (None: GET .../logs finds none).
        self.outputs = outputs if outputs is not None else OutputStore()
        self._upload_checker = UploadChecker(config.artifact_limits)
        self.cluster_view = cluster
        # Requests waiting for a task to reach a final state (long polling).
        self._waiters: dict[int, list[asyncio.Future[None]]] = {}
        # Requests waiting for a tracked root's tree to end (wait_tree=true).
        self._tree_waiters: dict[int, list[asyncio.Future[None]]] = {}
        node.listeners.append(self._on_applied)
        node.tree_listeners.append(self._on_trees_ended)
        self._routes: list[Route] = []
        self._openapi: bytes | None = None
        self._digest_cache: tuple[tuple[int, tuple[int, int]], str] | None = None
        self._add("/healthz", public=True, GET=self.health)
        self._add("/api/v1/openapi.json", public=True, GET=self.openapi)
        self._add("/api/v1/tasks", POST=self.submit, GET=self.list_tasks)
        self._add(r"/api/v1/tasks/(\d{1,18})", GET=self.get_task)
        self._add(r"/api/v1/tasks/(\d{1,18})/cancel", POST=self.cancel_task)
        self._add(r"/api/v1/tasks/(\d{1,18})/logs", GET=self.task_logs)
        self._add("/api/v1/transactions", POST=self.begin_transaction)
        self._add(r"/api/v1/transactions/(\d{1,18})/commit", POST=self.commit_transaction)
        self._add(r"/api/v1/transactions/(\d{1,18})/rollback", POST=self.rollback_transaction)
        self._add("/api/v1/tenants", GET=self.list_tenants)
        self._add(r"/api/v1/tenants/([^/]+)", GET=self.get_tenant, PUT=self.put_tenant)
        self._add(
            "/api/v1/code",
            max_body_bytes=self.config.max_code_bytes,
            POST=self.upload_code,
            GET=self.list_code,
        )
        self._add(r"/api/v1/code/([0-9a-f]{64})", GET=self.download_code)
        self._add("/api/v1/cluster", GET=self.cluster)
        self._add("/api/v1/config", GET=self.get_config, PUT=self.put_config)
        # The web dashboard (static page, no auth: it holds no data) and its read-only data.
        self.throughput = dashboard.ThroughputRecorder(node)
        self._add("/", public=True, GET=self.dashboard_page)
        self._add(r"/dashboard/([A-Za-z0-9_.-]{1,64})", public=True, GET=self.dashboard_asset)
        self._add("/api/v1/cluster/brokers", GET=self.broker_statuses)
        self._add("/api/v1/workers", GET=self.list_workers)
        self._add("/api/v1/stats/throughput", GET=self.throughput_stats)
        self._add("/api/v1/tasks/recent", GET=self.recent_tasks)
        self._add("/api/v1/state/digest", GET=self.digest)
        self._add("/metrics", GET=self.metrics)
        # GET only: a body is never read, and the answer may be tens of MB (one response).
        self._add(LATEST_SNAPSHOT_PATH, GET=self.latest_snapshot)
        self._add("/api/v1/tokens", POST=self.create_token, GET=self.list_tokens)
        self._add(r"/api/v1/tokens/([0-9a-f]{1,64})", DELETE=self.revoke_token)
        self._add("/api/v1/whoami", GET=self.whoami)

    def _add(
        self,
        pattern: str,
        max_body_bytes: int | None = None,
        public: bool = False,
        **handlers: Handler,
    ) -> None:
        route = Route(pattern, max_body_bytes or self.config.max_request_bytes, public)
        route.handlers.update(handlers)
        self._routes.append(route)

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        extra_headers: tuple[tuple[bytes, bytes], ...] = ()
        try:
            status, body = await self._dispatch(scope, receive)
        except HttpError as exc:
            status = exc.status
            body = _error_bytes(exc.code, exc.message, exc.leader_url, exc.retryable)
            extra_headers = exc.headers
        except BrokerUnavailableError as exc:
            status, body = 503, _error_bytes("unavailable", str(exc), retryable=True)
        except Exception:
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            status, body = 500, _error_bytes("internal", "internal error; see the broker log")
        content_type = body.content_type if isinstance(body, Binary) else JSON_TYPE
        if isinstance(body, Binary) and body.headers:
            extra_headers = body.headers
        await send(
            {
                "type": "http.response.start",
                "status": status,
                "headers": [
                    (b"content-type", content_type),
                    (b"content-length", str(len(body)).encode()),
                    *extra_headers,
                ],
            }
        )
        await send({"type": "http.response.body", "body": body})

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    async def _dispatch(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        path: str = scope["path"]
        method: str = scope["method"]
        for route in self._routes:
            match = route.pattern.match(path)
            if match is None:
                continue
            handler = route.handlers.get(method)
            if handler is None:
                allowed = ", ".join(sorted(route.handlers))
                raise HttpError(
                    405,
                    "method_not_allowed",
                    f"{method} {path}: use {allowed}",
                    ((b"allow", allowed.encode()),),
                )
            headers = scope.get("headers", ())
            principal = ANONYMOUS_ADMIN
            if self.config.auth.enabled and not route.public:
                principal = self._authenticate(headers)
            if method != "GET" and self.cluster_view is not None and not self.node.writable:
                self._redirect_to_leader(scope)
            body = (
                await self._read_body(scope, receive, route.max_body_bytes)
                if method in ("POST", "PUT")
                else b""
            )
            query = _parse_query(scope.get("query_string", b""))
            request = Request(
                method, path, query, body, match.groups(), headers, principal, _peer(scope)
            )
            return await handler(request)
        raise HttpError(404, "not_found", f"no such endpoint: {path}")

    def _authenticate(self, headers: Sequence[tuple[bytes, bytes]]) -> Principal:
        """The caller a request's bearer token names: 401 for none or an unknown one."""
        values = [v for n, v in headers if n == b"authorization"]
        try:
            if len(values) > 1:
                raise AuthError("send one Authorization header")
            token_hash = hash_token(bearer_token(values[0] if values else None))
        except AuthError as exc:
            raise HttpError(401, "unauthorized", str(exc), _CHALLENGE) from None
        found = self.config.auth.configured_principal(token_hash)
        if found is not None:
            return found
        token_id = self.node.state.token_ids_by_hash.get(token_hash)
        if token_id is None:
            raise HttpError(401, "unauthorized", "unknown or revoked API token", _CHALLENGE)
        token = self.node.state.tokens[token_id]
        if token.role == CallerRole.ADMIN.value:
            return Principal(CallerRole.ADMIN, token_id=token.id)
        if token.role == CallerRole.WORKER.value:
            return Principal(CallerRole.WORKER, token_id=token.id)
        return Principal(CallerRole.TENANT, tenant=token.tenant, token_id=token.id)

    @staticmethod
    def _require(request: Request, *roles: CallerRole) -> None:
        """403 unless the caller has one of ``roles`` (admin always may)."""
        role = request.principal.role
        if role is not CallerRole.ADMIN and role not in roles:
            wanted = " or ".join(["admin", *(r.value for r in roles)])
            raise HttpError(403, "forbidden", f"this needs the {wanted} role")

    @staticmethod
    def _tenant_of(request: Request, stated: str | UnsetType) -> str:
        """The tenant a write acts for: a tenant token acts for its own tenant only."""
        principal = request.principal
        if principal.role is CallerRole.TENANT:
            assert principal.tenant is not None
            if not isinstance(stated, UnsetType) and stated != principal.tenant:
                raise HttpError(
                    403, "forbidden", f"this token acts for tenant {principal.tenant!r} only"
                )
            return principal.tenant
        if principal.role is not CallerRole.ADMIN:
            raise HttpError(403, "forbidden", "this needs a tenant or admin token")
        return "default" if isinstance(stated, UnsetType) else stated

    def _redirect_to_leader(self, scope: Scope) -> None:
        """A write reached a broker that cannot take it: name the leader (docs/DESIGN.md §4)."""
        view = self.cluster_view
        assert view is not None
        leader = view.leader()
        leader_url = leader.url if leader is not None else None
        if self.node.role == Role.FOLLOWER and leader_url and leader_url != view.url:
            location = leader_url + scope["path"]
            query: bytes = scope.get("query_string", b"")
            if query:
                location += "?" + query.decode("latin-1")
            raise HttpError(
                307,
                "not_leader",
                f"this broker is a follower; send writes to the leader at {leader_url}",
                ((b"location", location.encode("latin-1")),),
                leader_url=leader_url,
                retryable=True,
            )
        raise BrokerUnavailableError(self.node._unavailable_reason())

    async def _read_body(self, scope: Scope, receive: Receive, limit: int) -> bytes:
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                try:
                    declared = int(value)
                except ValueError:
                    raise HttpError(400, "invalid_request", "bad Content-Length") from None
                if declared > limit:
                    raise HttpError(413, "too_large", f"request body over {limit} bytes")
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                raise HttpError(400, "invalid_request", "client disconnected")
            chunk: bytes = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                raise HttpError(413, "too_large", f"request body over {limit} bytes")
            chunks.append(chunk)
            if not message.get("more_body", False):
                return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    # --- tasks ---------------------------------------------------------------------------

    def _spec_fields(
        self, request: Request, item: m.TaskSubmission | m.SubmitBody, index: int | None
    ) -> e.TaskSpec:
        where = "" if index is None else f"tasks[{index}]: "
        tenant = self._tenant_of(request, item.tenant)
        if item.type is None:
            raise HttpError(400, "invalid_request", f"{where}type is required")
        params = b"null" if isinstance(item.params, UnsetType) else bytes(item.params)
        if len(params) > self.config.max_params_bytes:
            raise HttpError(
                413, "too_large", f"{where}params over {self.config.max_params_bytes} bytes"
            )
        try:
            deadline_ms = _to_epoch_ms(item.deadline, "deadline")
            start_after_ms = _to_epoch_ms(item.start_after, "start_after")
        except HttpError as exc:
            raise HttpError(exc.status, exc.code, where + exc.message) from None
        # id 0 is a placeholder: the leader assigns ids when it logs the entry.
        spec = e.TaskSpec(
            id=0,
            type=item.type,
            tenant=tenant,
            params=params,
            slot=item.slot,
            max_attempts=item.max_attempts,
            deadline_ms=deadline_ms,
            start_after_ms=start_after_ms,
            resources=item.resources,
            transaction=item.transaction,
            code=item.code,
            track_tree=item.track_tree,
            tree_timeout_ms=self._tree_timeout_ms(item, where),
        )
        problem = validate_task_spec(spec)
        if problem is not None:
            raise HttpError(400, "invalid_request", where + problem)
        if spec.code is not None and not self._may_use_code(request, spec.code, tenant):
            raise HttpError(
                404, "not_found", f"{where}code artifact {spec.code} was never uploaded"
            )
        if spec.transaction is not None and not self._owns_transaction(request, spec.transaction):
            raise HttpError(404, "not_found", f"{where}transaction {spec.transaction} is not open")
        return spec

    def _may_use_code(self, request: Request, sha256: str, tenant: str) -> bool:
        """Whether tasks of ``tenant`` may run this artifact (a tenant's own or a shared
        one). Unknown artifacts pass: the state machine's answer names them."""
        if not self.config.auth.enabled:
            return True
        artifact = self.node.state.artifacts.get(sha256)
        if artifact is None or not artifact.owners:
            return True
        return tenant in artifact.owners

    def _owns_transaction(self, request: Request, txn_id: int) -> bool:
        principal = request.principal
        if principal.role is not CallerRole.TENANT:
            return True
        txn = self.node.state.transactions.get(txn_id)
        return txn is None or txn.tenant == principal.tenant

    @staticmethod
    def _tree_timeout_ms(item: m.TaskSubmission | m.SubmitBody, where: str) -> int:
        if item.tree_timeout_s is None:
            return e.DEFAULT_TREE_TIMEOUT_MS
        if not item.track_tree:
            raise HttpError(400, "invalid_request", f"{where}tree_timeout_s needs track_tree")
        limit_s = MAX_TREE_TIMEOUT_MS / 1000
        if not (math.isfinite(item.tree_timeout_s) and 0.001 <= item.tree_timeout_s <= limit_s):
            raise HttpError(
                400,
                "invalid_request",
                f"{where}tree_timeout_s must be between 0.001 and {limit_s:g} seconds",
            )
        return round(item.tree_timeout_s * 1000)

    async def submit(self, request: Request) -> tuple[int, bytes]:
        body = _decode(_submit_decoder, request.body)
        key = _idempotency_key(request, body.idempotency_key)
        if body.tasks is not None:
            if body.type is not None:
                raise HttpError(
                    400, "invalid_request", "send either {'tasks': [...]} or one task, not both"
                )
            if not 0 < len(body.tasks) <= self.config.max_tasks_per_request:
                raise HttpError(
                    400,
                    "invalid_request",
                    f"tasks must hold 1 to {self.config.max_tasks_per_request} tasks",
                )
            specs = [self._spec_fields(request, item, i) for i, item in enumerate(body.tasks)]
        else:
            specs = [self._spec_fields(request, body, None)]

        def build(stamp: Stamp) -> e.Entry:
            ids = stamp.task_ids(len(specs))
            return e.SubmitTasks(
                time_ms=stamp.now_ms,
                tasks=tuple(
                    msgspec.structs.replace(spec, id=task_id)
                    for spec, task_id in zip(specs, ids, strict=True)
                ),
                idempotency_key=key,
            )

        results = await self.node.propose(build)
        assert isinstance(results, list)
        # A replay answers as the first submission did (same status, same ids).
        replayed = isinstance(results, ReplayedResults)
        if replayed and len(results) != len(specs):
            raise HttpError(
                409,
                "conflict",
                f"idempotency key {key!r} was used for a submission of {len(results)} "
                f"tasks, not {len(specs)}; use a new key for a new submission",
            )
        if body.tasks is None:
            result = results[0]
            if isinstance(result, Rejected):
                raise _rejected_error(result)
            return 201, _json_encoder.encode(m.TaskRefBody(result.id, result.state, replayed))
        out = [
            m.SubmittedTask(error=m.ErrorDetail(_error_code(r.code), r.message))
            if isinstance(r, Rejected)
            else m.SubmittedTask(id=r.id, state=r.state)
            for r in results
        ]
        return 200, _json_encoder.encode(m.SubmitBatchResponse(out, replayed))

    def _task_view(self, task_id: int, principal: Principal = ANONYMOUS_ADMIN) -> m.TaskView:
        task = self.node.state.tasks.get(task_id)
        # Another tenant's task answers like a missing one: its existence is not shown.
        if task is None or not principal.may_see_tenant(task.tenant):
            raise HttpError(404, "not_found", f"task {task_id} does not exist")
        return task_view(task, self.node.state.tree(task_id))

    async def get_task(self, request: Request) -> tuple[int, bytes]:
        task_id = int(request.params[0])
        unknown = set(request.query) - {"wait_s", "wait_tree"}
        if unknown:
            raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
        self._require(request, CallerRole.TENANT)
        wait_tree = _bool_param(request.query, "wait_tree")
        view = self._task_view(task_id, request.principal)
        wait_s = _float_param(request.query, "wait_s", 0.0, 0.0, self.config.max_wait_s)
        if wait_tree and view.tree is None:
            raise HttpError(
                400, "invalid_request", f"task {task_id} does not root a tracked tree (wait_tree)"
            )
        if wait_tree:
            done = view.tree is not None and view.tree.state != TreeState.PENDING
            waiters = self._tree_waiters
        else:
            done = view.state in _FINAL
            waiters = self._waiters
        if wait_s > 0 and not done:
            # Long poll: answer as soon as the task reaches a final state (its tree ends).
            await self._wait(waiters, task_id, wait_s)
            view = self._task_view(task_id, request.principal)
        return 200, _json_encoder.encode(view)

    async def task_logs(self, request: Request) -> tuple[int, bytes]:
        """An attempt's captured output: broker/api/output_store.py (only the leader holds it;
        a follower asks the leader, so the dashboard works on any broker)."""
        self._require(request, CallerRole.TENANT)
        view = self.cluster_view
        try:
            if view is not None and not self.node.writable:
                leader = view.leader()
                return await logs_from_leader(
                    leader.url if leader is not None and leader.url != view.url else None,
                    request.path,
                    request.query,
                    request.header(b"authorization"),
                    proxied=request.header(PROXIED_HEADER) is not None,
                    ssl_context=view.peer_ssl_context,
                )
            answer = await logs_answer(
                self.outputs,
                self.node.state,
                request.principal,
                int(request.params[0]),
                request.query,
            )
        except LogsError as exc:
            raise HttpError(exc.status, exc.code, exc.message, retryable=exc.retryable) from None
        return 200, answer

    @staticmethod
    async def _wait(
        waiters: dict[int, list[asyncio.Future[None]]], task_id: int, wait_s: float
    ) -> None:
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        waiters.setdefault(task_id, []).append(waiter)
        try:
            await asyncio.wait_for(waiter, timeout=wait_s)
        except TimeoutError:
            pass
        finally:
            mine = waiters.get(task_id)
            if mine is not None and waiter in mine:
                mine.remove(waiter)
                if not mine:
                    del waiters[task_id]

    def _on_applied(self, entry: e.Entry, applied: Applied) -> None:
        if not self._waiters:
            return
        for task_id in applied.final_ids:
            for waiter in self._waiters.pop(task_id, ()):
                if not waiter.done():
                    waiter.set_result(None)

    def _on_trees_ended(self, roots: list[int]) -> None:
        if not self._tree_waiters:
            return
        for root in roots:
            for waiter in self._tree_waiters.pop(root, ()):
                if not waiter.done():
                    waiter.set_result(None)

    @staticmethod
    def _state_filter(request: Request, cursor: str) -> str | None:
        """The state filter of a task list, its query parameters checked."""
        query = request.query
        unknown = set(query) - {"state", "tenant", "type", "limit", cursor}
        if unknown:
            raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
        state = query.get("state")
        if state is not None and state not in _TASK_STATES:
            raise HttpError(400, "invalid_request", f"state must be one of {sorted(_TASK_STATES)}")
        return state

    def _listed_tenant(self, request: Request) -> str | None:
        """The tenant filter of a task list: a tenant token lists its own tenant only."""
        self._require(request, CallerRole.TENANT)
        tenant = request.query.get("tenant")
        if request.principal.role is CallerRole.TENANT:
            if tenant is not None and tenant != request.principal.tenant:
                raise HttpError(
                    403, "forbidden", "a tenant token lists its own tenant's tasks only"
                )
            tenant = request.principal.tenant
        return tenant

    async def list_tasks(self, request: Request) -> tuple[int, bytes]:
        state = self._state_filter(request, "after")
        limit = _int_param(request.query, "limit", 100, 1, self.config.max_list_limit)
        after = _int_param(request.query, "after", 0, 0, 2**62)
        tasks = self.node.state.list_tasks(
            state=state,
            tenant=self._listed_tenant(request),
            task_type=request.query.get("type"),
            after_id=after,
            limit=limit,
        )
        next_after = tasks[-1].id if len(tasks) == limit else None
        return 200, _json_encoder.encode(
            m.TaskList([task_view(t, self.node.state.tree(t.id)) for t in tasks], next_after)
        )

    async def cancel_task(self, request: Request) -> tuple[int, bytes]:
        task_id = int(request.params[0])
        if request.body.strip():
            raise HttpError(400, "invalid_request", "cancel takes no body")
        self._require(request, CallerRole.TENANT)
        self._task_view(task_id, request.principal)  # 404 before logging anything
        result = await self.node.propose(
            lambda stamp: e.CancelTask(time_ms=stamp.now_ms, task_id=task_id)
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, TaskRef)
        return 200, _json_encoder.encode(m.TaskRefBody(result.id, result.state))

    # --- transactions -------------------------------------------------------------------------

    async def begin_transaction(self, request: Request) -> tuple[int, bytes]:
        body = _decode(_txn_decoder, request.body or b"{}")
        tenant = self._tenant_of(request, body.tenant)
        if not NAME_RE.match(tenant):
            raise HttpError(400, "invalid_request", "tenant name is not valid")
        if not (math.isfinite(body.ttl_s) and 0 < body.ttl_s <= _MAX_TTL_S):
            raise HttpError(400, "invalid_request", f"ttl_s must be in (0, {_MAX_TTL_S:.0f}]")
        ttl_ms = max(1, int(body.ttl_s * 1000))
        result = await self.node.propose(
            lambda stamp: e.BeginTransaction(
                time_ms=stamp.now_ms,
                transaction_id=stamp.transaction_id(),
                tenant=tenant,
                ttl_ms=ttl_ms,
            )
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, TransactionRef)
        view = m.TransactionView(result.id, result.tenant, iso_ms(result.expires_ms) or "")
        return 201, _json_encoder.encode(view)

    async def _end_transaction(self, request: Request, commit: bool) -> tuple[int, bytes]:
        txn_id = int(request.params[0])
        if request.body.strip():
            raise HttpError(400, "invalid_request", "commit and rollback take no body")
        self._require(request, CallerRole.TENANT)
        txn = self.node.state.transactions.get(txn_id)
        if txn is None or not request.principal.may_see_tenant(txn.tenant):
            raise HttpError(404, "not_found", f"transaction {txn_id} is not open")

        # The state machine checks the tenant again when it applies the entry.
        tenant = request.principal.tenant if request.principal.role is CallerRole.TENANT else None

        def build(stamp: Stamp) -> e.Entry:
            if commit:
                return e.CommitTransaction(
                    time_ms=stamp.now_ms, transaction_id=txn_id, tenant=tenant
                )
            return e.RollbackTransaction(time_ms=stamp.now_ms, transaction_id=txn_id, tenant=tenant)

        result = await self.node.propose(build)
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, TransactionDone)
        outcome = m.TransactionOutcome(result.id, result.outcome, list(result.task_ids))
        return 200, _json_encoder.encode(outcome)

    async def commit_transaction(self, request: Request) -> tuple[int, bytes]:
        return await self._end_transaction(request, commit=True)

    async def rollback_transaction(self, request: Request) -> tuple[int, bytes]:
        return await self._end_transaction(request, commit=False)

    # --- tenants ------------------------------------------------------------------------------

    def _tenant_view(self, tenant: Tenant) -> m.TenantView:
        return m.TenantView(
            name=tenant.name,
            max_waiting=tenant.max_waiting,
            max_running=tenant.max_running,
            weight=tenant.weight,
            counts=self.node.state.tenant_counts_view(tenant.name),
        )

    def _tenant_name(self, request: Request) -> str:
        name = request.params[0]
        if not NAME_RE.match(name):
            raise HttpError(400, "invalid_request", f"tenant name {name!r} is not valid")
        return name

    async def list_tenants(self, request: Request) -> tuple[int, bytes]:
        self._require(request, CallerRole.TENANT)
        views = [
            self._tenant_view(t)
            for t in self.node.state.tenants.values()
            if request.principal.may_see_tenant(t.name)
        ]
        return 200, _json_encoder.encode({"tenants": views})

    async def get_tenant(self, request: Request) -> tuple[int, bytes]:
        name = self._tenant_name(request)
        self._require(request, CallerRole.TENANT)
        if not request.principal.may_see_tenant(name):
            # Whatever the name: existence of other tenants is not shown.
            raise HttpError(403, "forbidden", "a tenant token reads its own tenant only")
        tenant = self.node.state.tenants.get(name)
        if tenant is None:
            raise HttpError(
                404, "not_found", f"tenant {name!r} is unknown (PUT creates it with limits)"
            )
        return 200, _json_encoder.encode(self._tenant_view(tenant))

    async def put_tenant(self, request: Request) -> tuple[int, bytes]:
        name = self._tenant_name(request)
        self._require(request)  # service levels are the admin's
        limits = _decode(_limits_decoder, request.body)
        patch = e.TenantLimitsPatch(
            max_waiting=limits.max_waiting, max_running=limits.max_running, weight=limits.weight
        )
        problem = validate_limits(patch)
        if problem is not None:
            raise HttpError(400, "invalid_request", problem)
        result = await self.node.propose(
            lambda stamp: e.SetTenant(time_ms=stamp.now_ms, tenant=name, limits=patch)
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, Tenant)
        return 200, _json_encoder.encode(self._tenant_view(result))

    # --- code artifacts ---------------------------------------------------------------------------

    def _code_store(self) -> CodeStore:
        if self.code_store is None:
            raise HttpError(404, "not_found", "this broker stores no code artifacts")
        return self.code_store

    async def upload_code(self, request: Request) -> tuple[int, bytes]:
        self._require(request, CallerRole.TENANT)
        store = self._code_store()
        # A tenant's upload is its own; an admin's (or any without authentication) shared.
        owner = request.principal.tenant if self.config.auth.enabled else None
        unknown = set(request.query) - {"name"}
        if unknown:
            raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
        name = request.query.get("name")
        if name is None:
            raise HttpError(400, "invalid_request", "the name query parameter is required")
        data = request.body
        try:
            # Never parsed here: a hostile .py or zip must not grow or stall the broker.
            await self._upload_checker.check(name, data)
        except InvalidArtifactError as exc:
            too_large = isinstance(exc, ArtifactTooLargeError)
            logger.warning(
                "code upload %r (%d bytes) from %s refused: %s", name, len(data), request.peer, exc
            )
            if too_large:
                raise HttpError(413, "too_large", str(exc)) from None
            raise HttpError(400, "invalid_artifact", str(exc)) from None
        sha256 = await asyncio.to_thread(store.put, data)
        ready = self.config.min_replication <= 1
        result = await self.node.propose(
            lambda stamp: e.AddCode(
                time_ms=stamp.now_ms,
                sha256=sha256,
                name=name,
                size_bytes=len(data),
                ready=ready,
                tenant=owner,
            )
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, Artifact)
        # Always 201 and the uploader's own name and time: the same answer whether or not
        # another tenant sent these bytes before.
        return 201, _json_encoder.encode(artifact_view(result, owner))

    def _may_read_code(self, request: Request, artifact: Artifact) -> bool:
        principal = request.principal
        if principal.role is CallerRole.WORKER:
            return self._assigned_to_credential(principal, artifact.sha256)
        if principal.role is not CallerRole.TENANT:
            return True  # admin and peer brokers
        return not artifact.owners or principal.tenant in artifact.owners

    def _assigned_to_credential(self, principal: Principal, sha256: str) -> bool:
        """Whether a task running on a connected worker of this credential uses the
        artifact: a worker credential (or the shared worker token, ``token_id`` None)
        reads only the code of tasks currently assigned to its own workers."""
        state = self.node.state
        for worker in state.workers.values():
            if worker.state != WorkerState.CONNECTED or worker.credential != principal.token_id:
                continue
            for task_id in state.running_by_worker.get(worker.id, ()):
                task = state.tasks.get(task_id)
                if task is not None and task.code == sha256:
                    return True
        return False

    async def list_code(self, request: Request) -> tuple[int, bytes]:
        self._require(request, CallerRole.TENANT, CallerRole.WORKER, CallerRole.PEER)
        tenant = request.principal.tenant if request.principal.role is CallerRole.TENANT else None
        views = [
            artifact_view(a, tenant)
            for a in self.node.state.artifacts.values()
            if self._may_read_code(request, a)
        ]
        if tenant is not None:
            # In the order the tenant uploaded them, not that of the bytes' first upload
            # (which would tell that another tenant sent some of them earlier). ISO times
            # of one width sort as strings.
            views.sort(key=lambda view: (view.created_at, view.sha256))
        return 200, _json_encoder.encode({"artifacts": views})

    async def download_code(self, request: Request) -> tuple[int, bytes]:
        self._require(request, CallerRole.TENANT, CallerRole.WORKER, CallerRole.PEER)
        store = self._code_store()
        sha256 = request.params[0]
        artifact = self.node.state.artifacts.get(sha256)
        allowed = artifact is not None and self._may_read_code(request, artifact)
        if artifact is not None and not allowed and request.principal.role is CallerRole.WORKER:
            allowed = await self._await_assignment(request.principal, sha256)
        if artifact is None or not allowed or not store.has(sha256):
            # One answer for a missing artifact and one the caller may not read.
            if artifact is not None and not allowed:
                logger.warning(
                    "refused code artifact %s to %s credential %s: no task of its workers "
                    "uses it (client %s)",
                    sha256[:12],
                    request.principal.role.value,
                    request.principal.token_id or "(shared worker token)",
                    request.peer,
                )
            raise HttpError(404, "not_found", f"code artifact {sha256} is not on this broker")
        try:
            # Hashed on every read: a damaged copy is dropped (and fetched again), not served.
            data = await asyncio.to_thread(store.read, sha256)
        except FileNotFoundError:
            raise HttpError(
                404, "not_found", f"code artifact {sha256} is not on this broker"
            ) from None
        return 200, Binary(data)

    async def _await_assignment(self, principal: Principal, sha256: str) -> bool:
        """A follower may not have applied the assignment its leader already pushed to
        the worker: wait a little for it there (bounded) before refusing."""
        if self.node.writable:
            return False  # the leader applied the assignment before the worker heard of it
        deadline = time.monotonic() + _ASSIGNMENT_WAIT_S
        while time.monotonic() < deadline:
            await asyncio.sleep(0.02)
            if self._assigned_to_credential(principal, sha256):
                return True
        return False

    # --- cluster --------------------------------------------------------------------------------

    def _position(self) -> m.Position:
        ledger_id, entry_id = self.node.position
        return m.Position(ledger_id, entry_id)

    def _state_digest(self) -> str:
        """The state's digest, computed once per applied position: it encodes the whole
        state, and dashboards and scripts poll /cluster many times a second."""
        state = self.node.state
        key = (id(state), self.node.position)
        cached = self._digest_cache
        if cached is None or cached[0] != key:
            cached = self._digest_cache = (key, state.digest())
        return cached[1]

    async def cluster(self, request: Request) -> tuple[int, bytes]:
        # Workers find the leader here; tenants follow redirects and need not see it.
        self._require(request, CallerRole.WORKER, CallerRole.PEER)
        node = self.node
        state = node.state
        view = self.cluster_view
        broker = m.BrokerSummary(
            id=node.config.broker_id,
            host=self.config.host,
            port=self.config.port,
            uptime_secs=round((node.clock_ms() - node.stats.started_ms) / 1000, 3),
            is_leader=node.role in (Role.STANDALONE, Role.LEADER),
            version=VERSION,
            position=self._position(),
            role=str(node.role),
            url=view.url if view is not None else None,
            worker_address=view.worker_address if view is not None else None,
            worker_tls=view.worker_tls if view is not None else False,
            digest=self._state_digest(),
        )
        leader = view.leader() if view is not None else broker
        if leader is not None and leader.id == broker.id:
            leader = broker
        workers = [
            m.WorkerSummary(
                id=w.id,
                state=w.state,
                address=w.address,
                running_tasks=len(state.running_by_worker.get(w.id, ())),
                resources=w.resources,
            )
            for w in state.workers.values()
        ]
        others = view.brokers() if view is not None else []
        summary = m.ClusterSummary(
            cluster_id=node.config.cluster_id,
            leader=leader.id if leader is not None else None,
            brokers=[broker, *(b for b in others if b.id != broker.id)],
            workers=workers,
            tasks=state.count_by_state(),
            tenants=len(state.tenants),
            leader_url=leader.url if leader is not None else None,
            leader_worker_address=leader.worker_address if leader is not None else None,
            leader_worker_tls=leader.worker_tls if leader is not None else False,
        )
        return 200, _json_encoder.encode(summary)

    def _config_view(self) -> m.ClusterConfigView:
        config = self.node.state.config
        return m.ClusterConfigView(
            global_limits=dict(config.global_limits),
            finished_task_retention_s=config.finished_task_retention_ms / 1000,
        )

    async def get_config(self, request: Request) -> tuple[int, bytes]:
        self._require(request)
        return 200, _json_encoder.encode(self._config_view())

    async def put_config(self, request: Request) -> tuple[int, bytes]:
        self._require(request)
        patch = _decode(_config_decoder, request.body)
        retention_ms: int | None = None
        if patch.finished_task_retention_s is not None:
            seconds = patch.finished_task_retention_s
            if not (math.isfinite(seconds) and 1 <= seconds <= m.MAX_RETENTION_S):
                raise HttpError(
                    400, "invalid_request", "finished_task_retention_s must be in [1, 10 years]"
                )
            retention_ms = int(seconds * 1000)
        if patch.global_limits is not None:
            for name, amount in patch.global_limits.items():
                if not NAME_RE.match(name) or not (math.isfinite(amount) and amount >= 0):
                    raise HttpError(
                        400, "invalid_request", f"global limit {name!r} must be a number >= 0"
                    )
        result = await self.node.propose(
            lambda stamp: e.SetConfig(
                time_ms=stamp.now_ms,
                finished_task_retention_ms=retention_ms,
                global_limits=patch.global_limits,
            )
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        return 200, _json_encoder.encode(self._config_view())

    async def latest_snapshot(self, request: Request) -> tuple[int, bytes]:
        """The newest intact local snapshot file, for a peer that has none (docs/DESIGN.md §5)."""
        self._require(request, CallerRole.PEER)
        _no_query(request)
        found = await asyncio.to_thread(read_latest_snapshot, self.node.snapshots)
        if found is None:
            raise HttpError(404, "not_found", "this broker has no snapshot yet")
        header, data = found
        body = Binary(data)
        body.headers = (
            (POSITION_HEADER.lower().encode(), format_position(header.position).encode()),
        )
        return 200, body

    async def digest(self, request: Request) -> tuple[int, bytes]:
        self._require(request, CallerRole.PEER)
        body = m.DigestBody(position=self._position(), digest=self._state_digest())
        return 200, _json_encoder.encode(body)

    # --- dashboard ----------------------------------------------------------------------------

    @staticmethod
    def _asset(name: str) -> Binary:
        data = dashboard.read_asset(name)
        if data is None:
            raise HttpError(404, "not_found", f"no such dashboard file: {name}")
        body = Binary(data)
        body.content_type = dashboard.ASSET_TYPES[name]
        body.headers = dashboard.SECURITY_HEADERS
        return body

    async def dashboard_page(self, request: Request) -> tuple[int, bytes]:
        return 200, self._asset("index.html")

    async def dashboard_asset(self, request: Request) -> tuple[int, bytes]:
        return 200, self._asset(request.params[0])

    async def broker_statuses(self, request: Request) -> tuple[int, bytes]:
        """Every live broker's own role and log position (peers answer at /healthz), and
        how far each is behind the leader."""
        _no_query(request)
        self._require(request)  # the operator's views: admin only
        node = self.node
        view = self.cluster_view
        own = m.BrokerStatus(
            id=node.config.broker_id,
            url=view.url if view is not None else None,
            role=str(node.role),
            is_leader=node.role in (Role.STANDALONE, Role.LEADER),
            reachable=True,
            writable=node.writable,
            position=self._position(),
            uptime_secs=round((node.clock_ms() - node.stats.started_ms) / 1000, 3),
        )
        leader_id: str | None = own.id
        peers: list[m.BrokerSummary] = []
        if view is not None:
            leader = view.leader()
            leader_id = leader.id if leader is not None else None
            peers = [b for b in view.brokers() if b.id != own.id]
        statuses = await dashboard.broker_statuses(
            own, peers, leader_id, view.peer_ssl_context if view is not None else None
        )
        body = m.BrokerStatusList(
            cluster_id=node.config.cluster_id,
            answered_by=own.id,
            leader=leader_id,
            brokers=statuses,
        )
        return 200, _json_encoder.encode(body)

    async def list_workers(self, request: Request) -> tuple[int, bytes]:
        _no_query(request)
        self._require(request)
        state = self.node.state
        views = []
        for worker in sorted(state.workers.values(), key=lambda w: w.id):
            running = state.running_by_worker.get(worker.id, set())
            views.append(
                m.WorkerView(
                    id=worker.id,
                    state=worker.state,
                    address=worker.address,
                    task_types=worker.task_types,
                    resources=worker.resources,
                    tenants=worker.tenants,
                    running_tasks=len(running),
                    running=heapq.nsmallest(dashboard.RUNNING_SHOWN, running),
                    connected_at=iso_ms(worker.connected_ms) or "",
                    updated_at=iso_ms(worker.updated_ms) or "",
                    reason=worker.reason,
                )
            )
        return 200, _json_encoder.encode(m.WorkerList(views))

    async def throughput_stats(self, request: Request) -> tuple[int, bytes]:
        _no_query(request)
        self._require(request)
        recorder = self.throughput
        end_ms, series = recorder.series()
        body = m.ThroughputView(
            bucket_s=recorder.bucket_ms / 1000,
            end_ms=end_ms,
            submitted=series["submitted"],
            finished=series["finished"],
            failed=series["failed"],
            cancelled=series["cancelled"],
            max_task_id=self.node.state.max_task_id,
        )
        return 200, _json_encoder.encode(body)

    async def recent_tasks(self, request: Request) -> tuple[int, bytes]:
        """Matching tasks, newest first (the dashboard's task search)."""
        state_filter = self._state_filter(request, "before")
        limit = _int_param(request.query, "limit", 50, 1, self.config.max_list_limit)
        before = _int_param(request.query, "before", 2**62, 1, 2**62)
        state = self.node.state
        tasks = state.list_tasks(
            state=state_filter,
            tenant=self._listed_tenant(request),
            task_type=request.query.get("type"),
            before_id=before,
            limit=limit,
            newest_first=True,
        )
        found = [task_view(task, state.tree(task.id)) for task in tasks]
        next_before = found[-1].id if len(found) == limit else None
        return 200, _json_encoder.encode(m.RecentTaskList(found, next_before))

    async def metrics(self, request: Request) -> tuple[int, bytes]:
        """Prometheus text exposition of this broker's metrics
        (broker/observability/metrics.py): tenants' names and counts, so admins (and peer
        brokers) only when authentication is on."""
        self._require(request, CallerRole.PEER)
        body = Binary(self.node.metrics.render())
        body.content_type = METRICS_CONTENT_TYPE
        return 200, body

    async def health(self, request: Request) -> tuple[int, bytes]:
        node = self.node
        writable = node.writable
        reason = None if writable else node._unavailable_reason()
        # A cluster broker is healthy while it serves reads (any role but idle); whether
        # it takes writes is the "writable" field. A standalone one must take writes.
        serving = writable or (
            self.cluster_view is not None and node.role in (Role.FOLLOWER, Role.CANDIDATE)
        )
        body = m.Health(
            status="ok" if serving else "unavailable",
            writable=writable,
            position=self._position(),
            reason=reason,
            role=str(node.role),
        )
        return (200 if serving else 503), _json_encoder.encode(body)

    # --- API tokens (admin) --------------------------------------------------------------------

    async def create_token(self, request: Request) -> tuple[int, bytes]:
        self._require(request)
        body = _decode(_token_decoder, request.body)
        tenants = tuple(body.tenants or ())
        problem = validate_token_fields(body.name, body.role, body.tenant, tenants)
        if problem is not None:
            raise HttpError(400, "invalid_request", problem)
        # The secret is made here and shown once; only its hash goes to the log.
        secret = new_token()
        token_id = new_token_id()
        result = await self.node.propose(
            lambda stamp: e.CreateToken(
                time_ms=stamp.now_ms,
                token_id=token_id,
                name=body.name,
                role=body.role,
                tenant=body.tenant,
                sha256=hash_token(secret),
                tenants=tenants,
            )
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, ApiToken)
        view = token_view(result)
        return 201, _json_encoder.encode(
            m.TokenCreated(token=secret, **msgspec.structs.asdict(view))
        )

    async def list_tokens(self, request: Request) -> tuple[int, bytes]:
        self._require(request)
        views = [token_view(t) for t in self.node.state.tokens.values()]
        return 200, _json_encoder.encode(m.TokenList(views))

    async def revoke_token(self, request: Request) -> tuple[int, bytes]:
        self._require(request)
        if request.body.strip():
            raise HttpError(400, "invalid_request", "revoke takes no body")
        token_id = request.params[0]
        if token_id not in self.node.state.tokens:
            raise HttpError(404, "not_found", f"token {token_id} does not exist")
        result = await self.node.propose(
            lambda stamp: e.RevokeToken(time_ms=stamp.now_ms, token_id=token_id)
        )
        if isinstance(result, Rejected):
            raise _rejected_error(result)
        assert isinstance(result, ApiToken)
        return 200, _json_encoder.encode(token_view(result))

    async def whoami(self, request: Request) -> tuple[int, bytes]:
        principal = request.principal
        body = m.WhoAmI(
            role=principal.role.value,
            tenant=principal.tenant,
            token_id=principal.token_id,
            auth=self.config.auth.enabled,
        )
        return 200, _json_encoder.encode(body)

    async def openapi(self, request: Request) -> tuple[int, bytes]:
        if self._openapi is None:
            self._openapi = _json_encoder.encode(openapi_document(self.config))
        return 200, self._openapi


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


def task_view(task: Any, tree: TreeRecord | None = None) -> m.TaskView:
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
        tree=tree_view(tree),
        root=task.root,
        parent=task.parent,
    )


def _peer(scope: Scope) -> str:
    client = scope.get("client")
    if not client:
        return "?"
    host, port = client[0], client[1]
    return f"[{host}]:{port}" if ":" in str(host) else f"{host}:{port}"


def _decode(decoder: msgspec.json.Decoder[_T], body: bytes) -> _T:
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


def _error_bytes(
    code: str, message: str, leader_url: str | None = None, retryable: bool = False
) -> bytes:
    return _json_encoder.encode(m.ErrorBody(m.ErrorDetail(code, message, leader_url, retryable)))


def _idempotency_key(request: Request, in_body: str | None) -> str | None:
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


def _parse_query(raw: bytes) -> dict[str, str]:
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


def _float_param(
    query: dict[str, str], name: str, default: float, low: float, high: float
) -> float:
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


def _bool_param(query: dict[str, str], name: str) -> bool:
    raw = query.get(name)
    if raw is None or raw in ("false", "0"):
        return False
    if raw in ("true", "1", ""):
        return True
    raise HttpError(400, "invalid_request", f"{name} must be true or false")


def _no_query(request: Request) -> None:
    if request.query:
        raise HttpError(400, "invalid_request", "this endpoint takes no query parameters")


def _int_param(query: dict[str, str], name: str, default: int, low: int, high: int) -> int:
    raw = query.get(name)
    if raw is None:
        return default
    if not re.fullmatch(r"\d{1,19}", raw) or not low <= int(raw) <= high:
        raise HttpError(400, "invalid_request", f"{name} must be an integer in [{low}, {high}]")
    return int(raw)


def openapi_document(config: ApiConfig | None = None) -> dict[str, Any]:
    """The OpenAPI 3.1 document; its bounds are those of ``config`` (default: ApiConfig())."""
    config = config or ApiConfig()
    types: list[Any] = [
        m.SubmitBody,
        m.SubmitBatchResponse,
        m.TaskRefBody,
        m.TaskView,
        TaskLogs,
        m.TaskList,
        m.BrokerStatusList,  # the dashboard's views
        m.WorkerList,
        m.ThroughputView,
        m.RecentTaskList,
        m.TransactionBegin,
        m.TransactionView,
        m.TransactionOutcome,
        m.TenantLimits,
        m.TenantView,
        m.ArtifactView,
        m.ClusterSummary,
        m.DigestBody,
        m.ClusterConfigPatch,
        m.ClusterConfigView,
        m.Health,
        m.ErrorBody,
        m.TokenCreate,
        m.TokenCreated,
        m.TokenView,
        m.TokenList,
        m.WhoAmI,
    ]
    refs, components = m.schema_components(types)
    ref = {t.__name__: r for t, r in zip(types, refs, strict=True)}

    def response(name: str, description: str = "OK") -> dict[str, Any]:
        return {"description": description, "content": {"application/json": {"schema": ref[name]}}}

    error = response("ErrorBody", "Error")
    errors = {"4XX": error, "503": response("ErrorBody", "Retry later")}
    id_param = {"name": "id", "in": "path", "required": True, "schema": {"type": "integer"}}
    name_param = {
        "name": "name",
        "in": "path",
        "required": True,
        "schema": {"type": "string", "pattern": m.NAME_PATTERN},
    }

    def body(name: str, required: bool = True) -> dict[str, Any]:
        return {"required": required, "content": {"application/json": {"schema": ref[name]}}}

    def query(name: str, schema: dict[str, Any]) -> dict[str, Any]:
        return {"name": name, "in": "query", "required": False, "schema": schema}

    # The filters GET /api/v1/tasks and GET /api/v1/tasks/recent share (_state_filter).
    task_filters = [
        query("state", {"type": "string", "enum": sorted(_TASK_STATES)}),
        query("tenant", {"type": "string"}),
        query("type", {"type": "string"}),
        query("limit", {"type": "integer", "minimum": 1, "maximum": config.max_list_limit}),
    ]
    paths: dict[str, Any] = {
        "/healthz": {"get": {"summary": "Liveness", "responses": {"200": response("Health")}}},
        "/api/v1/tasks": {
            "post": {
                "summary": "Submit one task or a batch ({'tasks': [...]})",
                "description": (
                    "Send an idempotency key (the Idempotency-Key header or the "
                    "idempotency_key field, 1-128 printable ASCII characters) to retry "
                    "safely: a submission repeating a key that created tasks in the last "
                    "24 hours (or the finished-task retention, if longer) creates nothing "
                    "and gets the same status and ids again, with replayed: true. A key "
                    "reused for a different number of tasks is refused (409). Keys, like "
                    "slot names, are the tenant's own: another tenant's equal key is "
                    "another key."
                ),
                "parameters": [
                    {
                        "name": "Idempotency-Key",
                        "in": "header",
                        "required": False,
                        "schema": {
                            "type": "string",
                            "minLength": 1,
                            "maxLength": 128,
                            "pattern": "^[\\x20-\\x7e]+$",
                        },
                    }
                ],
                "requestBody": body("SubmitBody"),
                "responses": {
                    "200": response("SubmitBatchResponse", "Batch results"),
                    "201": response("TaskRefBody", "Single task accepted"),
                    **errors,
                },
            },
            "get": {
                "summary": "List tasks (ascending id, paginate with after)",
                "parameters": [
                    *task_filters,
                    query("after", {"type": "integer", "minimum": 0, "maximum": 2**62}),
                ],
                "responses": {"200": response("TaskList"), **errors},
            },
        },
        "/api/v1/tasks/{id}": {
            "get": {
                "summary": "One task (with its tree's status when it roots a tracked tree)",
                "parameters": [
                    id_param,
                    query("wait_s", {"type": "number", "minimum": 0, "maximum": config.max_wait_s}),
                    query("wait_tree", {"type": "boolean"}),
                ],
                "responses": {"200": response("TaskView"), **errors},
            }
        },
        "/api/v1/tasks/{id}/logs": {
            "get": {
                "summary": "An attempt's captured stdout, stderr and ctx.logger output",
                "description": (
                    "The last 1 MiB of each attempt run in a task process, as the worker "
                    "ships it (about once a second while it runs). Tenant-scoped like "
                    "GET /api/v1/tasks/{id}. Pass next_offset back as offset to get only "
                    "newer output; complete: the attempt writes no more. Kept by the "
                    "leader (a follower asks it)."
                ),
                "parameters": [
                    id_param,
                    query("attempt", {"type": "integer", "minimum": 1, "maximum": 2**62}),
                    query("offset", {"type": "integer", "minimum": 0, "maximum": 2**62}),
                ],
                "responses": {"200": response("TaskLogs"), **errors},
            }
        },
        "/api/v1/tasks/{id}/cancel": {
            "post": {
                "summary": "Cancel a live task",
                "parameters": [id_param],
                "responses": {"200": response("TaskRefBody"), **errors},
            }
        },
        "/api/v1/transactions": {
            "post": {
                "summary": "Begin a transaction",
                "requestBody": body("TransactionBegin", required=False),
                "responses": {"201": response("TransactionView"), **errors},
            }
        },
        "/api/v1/transactions/{id}/commit": {
            "post": {
                "summary": "Commit: all its tasks become waiting at once",
                "parameters": [id_param],
                "responses": {"200": response("TransactionOutcome"), **errors},
            }
        },
        "/api/v1/transactions/{id}/rollback": {
            "post": {
                "summary": "Roll back: its tasks are dropped",
                "parameters": [id_param],
                "responses": {"200": response("TransactionOutcome"), **errors},
            }
        },
        "/api/v1/tenants": {
            "get": {
                "summary": "Every tenant's service level and task counts",
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "tenants": {"type": "array", "items": ref["TenantView"]}
                                    },
                                    "required": ["tenants"],
                                }
                            }
                        },
                    }
                },
            }
        },
        "/api/v1/tenants/{name}": {
            "get": {
                "summary": "A tenant's service level and task counts",
                "parameters": [name_param],
                "responses": {"200": response("TenantView"), **errors},
            },
            "put": {
                "summary": "Change a tenant's service level (effective at once)",
                "parameters": [name_param],
                "requestBody": body("TenantLimits"),
                "responses": {"200": response("TenantView"), **errors},
            },
        },
        "/api/v1/code": {
            "post": {
                "summary": "Upload a code artifact (.py, .zip or wheel; the raw bytes as body)",
                "description": (
                    "Checked in a separate, memory- and time-limited process: a .py must"
                    " compile (nothing runs); a zip is inflated in chunks and counted. 413"
                    " past a bound (.py size, zip entries, inflated size, compression ratio),"
                    " 400 invalid_artifact otherwise."
                ),
                "parameters": [
                    {
                        **query("name", {"type": "string", "pattern": ARTIFACT_NAME_PATTERN}),
                        "required": True,
                    }
                ],
                "requestBody": {
                    "required": True,
                    "content": {"application/octet-stream": {"schema": {"type": "string"}}},
                },
                "responses": {"201": response("ArtifactView"), **errors},
            },
            "get": {
                "summary": "Every code artifact",
                "responses": {
                    "200": {
                        "description": "OK",
                        "content": {
                            "application/json": {
                                "schema": {
                                    "type": "object",
                                    "properties": {
                                        "artifacts": {
                                            "type": "array",
                                            "items": ref["ArtifactView"],
                                        }
                                    },
                                    "required": ["artifacts"],
                                }
                            }
                        },
                    }
                },
            },
        },
        "/api/v1/code/{sha256}": {
            "get": {
                "summary": "Download a code artifact by its sha256",
                "parameters": [
                    {"name": "sha256", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {
                        "description": "The artifact's bytes",
                        "content": {"application/octet-stream": {"schema": {"type": "string"}}},
                    },
                    **errors,
                },
            }
        },
        "/api/v1/cluster": {
            "get": {"summary": "Cluster summary", "responses": {"200": response("ClusterSummary")}}
        },
        # The web dashboard: its page (no authentication: it holds no data; it reads the API
        # below with the user's token) and read-only views for it.
        "/": {
            "get": {
                "summary": "The web dashboard (an HTML page)",
                "responses": {
                    "200": {
                        "description": "The page",
                        "content": {"text/html": {"schema": {"type": "string"}}},
                    }
                },
            }
        },
        "/dashboard/{name}": {
            "get": {
                "summary": "The dashboard's script, style sheet and icon",
                "parameters": [
                    {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
                ],
                "responses": {
                    "200": {
                        "description": "The file",
                        "content": {
                            "text/javascript": {"schema": {"type": "string"}},
                            "text/css": {"schema": {"type": "string"}},
                            "image/svg+xml": {"schema": {"type": "string"}},
                        },
                    },
                    **errors,
                },
            }
        },
        "/api/v1/cluster/brokers": {
            "get": {
                "summary": "Every live broker's own role and log position, and its lag",
                "description": (
                    "The answering broker asks each peer's /healthz (1 s timeout); a peer that "
                    "does not answer is listed as unreachable. lag_entries: entries behind "
                    "the leader's position when both are in the same ledger (an idle "
                    "leader's last entry is a Confirm marker that followers apply only "
                    "with the next entry, so 1 means in sync)."
                ),
                "responses": {"200": response("BrokerStatusList"), **errors},
            }
        },
        "/api/v1/workers": {
            "get": {
                "summary": "Every worker with its capacities and the tasks running on it",
                "responses": {"200": response("WorkerList"), **errors},
            }
        },
        "/api/v1/stats/throughput": {
            "get": {
                "summary": "Tasks submitted, finished, failed, cancelled per recent time bucket",
                "responses": {"200": response("ThroughputView"), **errors},
            }
        },
        "/api/v1/tasks/recent": {
            "get": {
                "summary": "Search tasks, newest first (paginate with before)",
                "parameters": [
                    *task_filters,
                    query("before", {"type": "integer", "minimum": 1, "maximum": 2**62}),
                ],
                "responses": {"200": response("RecentTaskList"), **errors},
            }
        },
        "/api/v1/config": {
            "get": {
                "summary": "Replicated cluster settings",
                "responses": {"200": response("ClusterConfigView"), **errors},
            },
            "put": {
                "summary": "Change global resource limits or the finished-task retention",
                "requestBody": body("ClusterConfigPatch"),
                "responses": {"200": response("ClusterConfigView"), **errors},
            },
        },
        "/api/v1/state/digest": {
            "get": {
                "summary": "Digest of the replicated state at the applied position",
                "responses": {"200": response("DigestBody")},
            }
        },
        "/metrics": {
            "get": {
                "summary": "Prometheus metrics of this broker (text exposition format 0.0.4)",
                "responses": {
                    "200": {
                        "description": "Metric families (see docs/API.md, Metrics)",
                        "content": {"text/plain": {"schema": {"type": "string"}}},
                    },
                },
            }
        },
        LATEST_SNAPSHOT_PATH: {
            "get": {
                "summary": "This broker's newest snapshot file (for a peer that has none)",
                "responses": {
                    "200": {
                        "description": "The snapshot file's bytes, verified by the reader",
                        "headers": {
                            POSITION_HEADER: {
                                "description": "Log position it reflects: ledger_id:entry_id",
                                "schema": {"type": "string", "pattern": r"^\d+:\d+$"},
                            }
                        },
                        "content": {"application/octet-stream": {"schema": {"type": "string"}}},
                    },
                    **errors,
                },
            }
        },
        "/api/v1/tokens": {
            "post": {
                "summary": "Issue an API token (admin); the secret is in this answer only",
                "requestBody": body("TokenCreate"),
                "responses": {"201": response("TokenCreated"), **errors},
            },
            "get": {
                "summary": "Every API token, without secrets (admin)",
                "responses": {"200": response("TokenList"), **errors},
            },
        },
        "/api/v1/tokens/{token_id}": {
            "delete": {
                "summary": "Revoke an API token (admin)",
                "parameters": [
                    {
                        "name": "token_id",
                        "in": "path",
                        "required": True,
                        "schema": {"type": "string", "pattern": "^[0-9a-f]{1,64}$"},
                    }
                ],
                "responses": {"200": response("TokenView"), **errors},
            }
        },
        "/api/v1/whoami": {
            "get": {
                "summary": "The caller's role and tenant",
                "responses": {"200": response("WhoAmI"), **errors},
            }
        },
    }
    public = {"/healthz", "/api/v1/openapi.json", "/", "/dashboard/{name}"}
    for path, operations in paths.items():
        if path in public:
            operations["get"]["security"] = []
            continue
        # With authentication on, any other operation may answer 401 or 403.
        for operation in operations.values():
            responses = operation["responses"]
            if not any(str(code).startswith("4") for code in responses):
                responses["4XX"] = error
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "Steward",
            "version": VERSION,
            "description": (
                "When the broker has an admin token configured, every operation but "
                "/healthz and this document needs Authorization: Bearer <token> (401 "
                "without a valid one; 403 when the token's role may not do it). Every "
                "connection: request line and headers at most 64 KiB (431), sent within "
                "the header timeout, a body at a minimum rate (408); beyond the broker's "
                "connection cap a connection is answered 503 too_many_connections."
            ),
        },
        "paths": paths,
        "components": {
            "schemas": components,
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}},
        },
        "security": [{"bearer": []}, {}],
    }
