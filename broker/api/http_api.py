"""The HTTP JSON API under ``/api/v1/``: a small ASGI app.

Deliberately frameworkless: the submission path is the hot path, and routing,
validation (msgspec) and encoding here cost a few microseconds per request.
Every client mistake gets a 4xx with ``{"error": {"code", "message"}}``;
nothing is logged for a request that is rejected before it is logged.

The routes, their permissions and the OpenAPI document come from one table
(broker/api/routes.py); this module is the app around it: dispatch, authentication,
the permission check, leader redirects and request bodies. The handlers live in
broker/api/handlers_*.py, grouped by resource.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Sequence
from typing import Final

from broker.api.common import (
    CHALLENGE,
    JSON_TYPE,
    ApiConfig,
    Binary,
    ClusterView,
    HttpError,
    Receive,
    Request,
    Scope,
    Send,
    Stream,
    artifact_view,
    error_bytes,
    iso_ms,
    json_encoder,
    parse_query,
    send_stream,
    task_view,
    token_view,
    tree_view,
)
from broker.api.context import ApiContext
from broker.api.openapi import openapi_document
from broker.api.output_store import OutputStore
from broker.api.routes import ROUTES, Route
from broker.api.webhooks import WebhookSender
from broker.artifacts.code_store import CodeStore
from broker.observability.metrics import OTHER, BrokerMetrics
from broker.replication.node import BrokerUnavailableError, Node, Role
from broker.security.auth import ANONYMOUS_ADMIN, AuthError, Principal, bearer_token, hash_token
from broker.security.auth import Role as CallerRole

# Names other modules import from here.
__all__ = [
    "ApiApp",
    "ApiConfig",
    "Binary",
    "ClusterView",
    "HttpError",
    "Request",
    "artifact_view",
    "iso_ms",
    "openapi_document",
    "task_view",
    "token_view",
    "tree_view",
]

logger = logging.getLogger(__name__)


class PathRoutes:
    """The routes of one path: dispatch matches the path, then picks by method."""

    __slots__ = ("handlers", "path", "pattern")

    def __init__(self, path: str, regex: str) -> None:
        self.path = path
        self.pattern = re.compile("^" + regex + "$")
        self.handlers: dict[str, Route] = {}


def compile_routes(routes: Sequence[Route]) -> list[PathRoutes]:
    """The route table grouped by path, in table order (first route of each path)."""
    by_regex: dict[str, PathRoutes] = {}
    for route in routes:
        group = by_regex.setdefault(route.regex, PathRoutes(route.path, route.regex))
        assert route.method not in group.handlers, f"{route.method} {route.path} twice"
        group.handlers[route.method] = route
    return list(by_regex.values())


_NO_GROUPS: Final[tuple[str, ...]] = ()
# The matched route's template in a request's scope (``other``: no route matched).
_ROUTE_KEY: Final = "steward.route"


def exact_routes(groups: Sequence[PathRoutes]) -> dict[str, PathRoutes]:
    """The paths without parameters, looked up before any regex is tried: the groups
    whose regex matches their own path and no earlier group's does (so the lookup
    finds what the ordered regex scan would)."""
    exact: dict[str, PathRoutes] = {}
    for index, group in enumerate(groups):
        if group.pattern.groups or group.pattern.match(group.path) is None:
            continue
        if not any(earlier.pattern.match(group.path) for earlier in groups[:index]):
            exact[group.path] = group
    return exact


class ApiApp:
    """ASGI application serving the broker's API."""

    def __init__(
        self,
        node: Node,
        config: ApiConfig,
        code_store: CodeStore | None = None,
        cluster: ClusterView | None = None,
        outputs: OutputStore | None = None,
        webhooks: WebhookSender | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.context = ApiContext(node, config, code_store, cluster, outputs, webhooks)
        self.context.describe = lambda: json_encoder.encode(openapi_document(config))
        self._routes = compile_routes(ROUTES)
        self._exact_routes = exact_routes(self._routes)

    @property
    def cluster_view(self) -> ClusterView | None:
        return self.context.cluster_view

    @property
    def outputs(self) -> OutputStore:
        return self.context.outputs

    @property
    def _tree_waiters(self) -> dict[int, list[asyncio.Future[None]]]:
        return self.context.waiters.trees

    # --- ASGI ---------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                await self._lifespan(receive, send)
            return
        extra_headers: tuple[tuple[bytes, bytes], ...] = ()
        started = time.perf_counter()
        try:
            status, body = await self._dispatch(scope, receive)
        except HttpError as exc:
            status = exc.status
            body = error_bytes(exc.code, exc.message, exc.leader_url, exc.retryable)
            extra_headers = exc.headers
        except BrokerUnavailableError as exc:
            status, body = 503, error_bytes("unavailable", str(exc), retryable=True)
        except Exception:
            logger.exception("internal error on %s %s", scope.get("method"), scope.get("path"))
            status, body = 500, error_bytes("internal", "internal error; see the broker log")
        content_type = JSON_TYPE
        if isinstance(body, Binary):
            if isinstance(body, Stream):
                await send_stream(status, body, receive, send)
                self._observe(scope, status, started)
                return
            content_type = body.content_type
            if body.headers:
                extra_headers = body.headers
        headers = [(b"content-type", content_type), (b"content-length", b"%d" % len(body))]
        if extra_headers:
            headers.extend(extra_headers)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
        self._observe(scope, status, started)

    def _observe(self, scope: Scope, status: int, started: float) -> None:
        """Count the request by its route template (bounded: not the raw path)."""
        metrics = self.node.metrics
        if isinstance(metrics, BrokerMetrics):
            route = scope.get(_ROUTE_KEY, OTHER)
            metrics.observe_request(scope["method"], route, status, time.perf_counter() - started)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _route(self, path: str) -> tuple[PathRoutes, tuple[str, ...]]:
        """The routes of ``path`` and its parameters (404 when no route matches)."""
        group = self._exact_routes.get(path)
        if group is not None:
            return group, _NO_GROUPS
        for group in self._routes:
            match = group.pattern.match(path)
            if match is not None:
                return group, match.groups()
        raise HttpError(404, "not_found", f"no such endpoint: {path}")

    async def _dispatch(self, scope: Scope, receive: Receive) -> tuple[int, bytes]:
        path: str = scope["path"]
        method: str = scope["method"]
        group, params = self._route(path)
        scope[_ROUTE_KEY] = group.path  # for the request metrics (an ASGI scope extension)
        route = group.handlers.get(method)
        if route is None:
            allowed = ", ".join(sorted(group.handlers))
            raise HttpError(
                405,
                "method_not_allowed",
                f"{method} {path}: use {allowed}",
                ((b"allow", allowed.encode()),),
            )
        headers = scope.get("headers", ())
        principal = ANONYMOUS_ADMIN
        permission = route.permission
        if self.config.auth.enabled and not permission.public:
            principal = self._authenticate(headers)
        if method != "GET" and self.cluster_view is not None and not self.node.writable:
            self._redirect_to_leader(scope)
        if method == "POST" or method == "PUT":
            limit = route.max_body(self.config) if route.max_body else None
            body = await self._read_body(headers, receive, limit or self.config.max_request_bytes)
        else:
            body = b""
        query_string: bytes = scope.get("query_string", b"")
        query = parse_query(query_string) if query_string else {}
        request = Request(
            method, path, query, body, params, headers, principal, scope.get("client")
        )
        if not (permission.public or permission.any_caller):
            ApiContext.require(request, *permission.roles, message=permission.message)
        return await route.handler(self.context, request)

    def _authenticate(self, headers: Sequence[tuple[bytes, bytes]]) -> Principal:
        """The caller a request's bearer token names: 401 for none or an unknown one."""
        values = [v for n, v in headers if n == b"authorization"]
        try:
            if len(values) > 1:
                raise AuthError("send one Authorization header")
            token_hash = hash_token(bearer_token(values[0] if values else None))
        except AuthError as exc:
            raise HttpError(401, "unauthorized", str(exc), CHALLENGE) from None
        found = self.config.auth.configured_principal(token_hash)
        if found is not None:
            return found
        token_id = self.node.state.token_ids_by_hash.get(token_hash)
        if token_id is None:
            raise HttpError(401, "unauthorized", "unknown or revoked API token", CHALLENGE)
        token = self.node.state.tokens[token_id]
        if token.role == CallerRole.ADMIN.value:
            return Principal(CallerRole.ADMIN, token_id=token.id)
        if token.role == CallerRole.WORKER.value:
            return Principal(CallerRole.WORKER, token_id=token.id)
        return Principal(CallerRole.TENANT, tenant=token.tenant, token_id=token.id)

    def _redirect_to_leader(self, scope: Scope) -> None:
        """A write reached a broker that cannot take it: name the leader (docs/DESIGN.md §4)."""
        view = self.cluster_view
        assert view is not None
        problem = view.coordination_problem()
        if problem is not None and not self.node.closing:
            # Its view of the leader is stale: name the cause, not a leader that may be gone.
            raise BrokerUnavailableError(problem)
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
        raise BrokerUnavailableError(self.node.unavailable_reason())

    async def _read_body(
        self, headers: Sequence[tuple[bytes, bytes]], receive: Receive, limit: int
    ) -> bytes:
        for name, value in headers:
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
