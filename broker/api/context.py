"""What the handlers share: the node, the configuration, the stores, the cluster view and
the long-poll waiters. One ApiContext per ApiApp; every handler takes it first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from msgspec import UnsetType

from broker.api import api_models as m
from broker.api.common import ApiConfig, ClusterView, HttpError, Request
from broker.api.output_store import OutputStore
from broker.artifacts.code_store import CodeStore, UploadChecker
from broker.core import entries as e
from broker.core.effects import Applied
from broker.observability import dashboard
from broker.replication.node import Node
from broker.security.auth import Role as CallerRole


class TaskWaiters:
    """Requests waiting for a task to reach a final state (long polling), or for a tracked
    root's tree to end (wait_tree=true): the node's listeners wake them."""

    def __init__(self, node: Node) -> None:
        self.tasks: dict[int, list[asyncio.Future[None]]] = {}
        self.trees: dict[int, list[asyncio.Future[None]]] = {}
        node.listeners.append(self._on_applied)

    @staticmethod
    async def wait(
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
        if self.tasks:
            for task_id in applied.final_ids:
                for waiter in self.tasks.pop(task_id, ()):
                    if not waiter.done():
                        waiter.set_result(None)
        if self.trees:
            self._on_trees_ended(applied.trees_ended)

    def _on_trees_ended(self, roots: list[int]) -> None:
        for root in roots:
            for waiter in self.trees.pop(root, ()):
                if not waiter.done():
                    waiter.set_result(None)


class ApiContext:
    """The broker as the handlers see it."""

    def __init__(
        self,
        node: Node,
        config: ApiConfig,
        code_store: CodeStore | None,
        cluster: ClusterView | None,
        outputs: OutputStore | None,
    ) -> None:
        self.node = node
        self.config = config
        self.code_store = code_store
        # Task output the leader's worker link collects (None: GET .../logs finds none).
        self.outputs = outputs if outputs is not None else OutputStore()
        self.upload_checker = UploadChecker(config.artifact_limits)
        self.cluster_view = cluster
        self.waiters = TaskWaiters(node)
        # The dashboard's throughput series, counted from the entries this broker applies.
        self.throughput = dashboard.ThroughputRecorder(node)
        # The OpenAPI document (ApiApp sets it: it is generated from the route table).
        self.describe: Callable[[], bytes] = lambda: b"{}"
        self._openapi: bytes | None = None  # the served document, encoded once
        self._digest_cache: tuple[tuple[int, tuple[int, int]], str] | None = None

    @staticmethod
    def require(request: Request, *roles: CallerRole, message: str | None = None) -> None:
        """403 unless the caller has one of ``roles`` (admin always may)."""
        role = request.principal.role
        if role is not CallerRole.ADMIN and role not in roles:
            wanted = " or ".join(["admin", *(r.value for r in roles)])
            raise HttpError(403, "forbidden", message or f"this needs the {wanted} role")

    @staticmethod
    def tenant_of(request: Request, stated: str | UnsetType) -> str:
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

    def openapi_bytes(self) -> bytes:
        if self._openapi is None:
            self._openapi = self.describe()
        return self._openapi

    def code_store_or_404(self) -> CodeStore:
        if self.code_store is None:
            raise HttpError(404, "not_found", "this broker stores no code artifacts")
        return self.code_store

    def position(self) -> m.Position:
        ledger_id, entry_id = self.node.position
        return m.Position(ledger_id, entry_id)

    def state_digest(self) -> str:
        """The state's digest, computed once per applied position: it encodes the whole
        state, and dashboards and scripts poll /cluster many times a second."""
        state = self.node.state
        key = (id(state), self.node.position)
        cached = self._digest_cache
        if cached is None or cached[0] != key:
            cached = self._digest_cache = (key, state.digest())
        return cached[1]
