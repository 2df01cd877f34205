"""What the handlers share: the node, the configuration, the stores, the cluster view, the
long-poll waiters and the task-event streams' subscriptions. One ApiContext per ApiApp;
every handler takes it first."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable

from msgspec import UnsetType

from broker.api import api_models as m
from broker.api.common import ApiConfig, ClusterView, HttpError, Request, json_encoder, task_view
from broker.api.event_feed import EventFeed, task_event
from broker.api.output_store import OutputStore
from broker.api.rate_limit import SubmitRateLimiter
from broker.api.webhooks import WebhookSender
from broker.artifacts.code_store import CodeStore, UploadChecker
from broker.core import FINAL_STATES
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

    def end_all(self) -> None:
        """Answer every waiting request now (the broker is shutting down): each gets the
        task as it is, and its client asks again, elsewhere if it can."""
        for waiters in (self.tasks, self.trees):
            for futures in waiters.values():
                for waiter in futures:
                    if not waiter.done():
                        waiter.set_result(None)
            waiters.clear()

    def _on_trees_ended(self, roots: list[int]) -> None:
        for root in roots:
            for waiter in self.trees.pop(root, ()):
                if not waiter.done():
                    waiter.set_result(None)


class EventSubscription:
    """One event stream's tasks: the events ready to send, the tasks it still waits for,
    and the event set when more are ready."""

    __slots__ = ("closed", "pending", "ready", "wake")

    def __init__(self) -> None:
        self.ready: list[bytes] = []
        self.pending: set[int] = set()
        self.wake = asyncio.Event()
        self.closed = False


class TaskEvents:
    """The task-event streams' subscriptions, fed by the effects of every applied entry
    (one event source, on the leader and on followers alike: docs/DESIGN.md §1)."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self.watchers: dict[int, list[EventSubscription]] = {}
        self.streams = 0  # open subscriptions
        node.listeners.append(self._on_applied)

    def subscribe(self, task_ids: Iterable[int]) -> EventSubscription:
        """Watch ``task_ids`` (each must exist): an event is ready at once for each one
        already final (its position unknown), the others are watched. Synchronous, so no
        entry is applied between the look and the watch."""
        state = self._node.state
        subscription = EventSubscription()
        for task_id in task_ids:
            task = state.tasks[task_id]
            if task.state in FINAL_STATES:
                view = json_encoder.encode(task_view(task, state.tree(task_id), state.workers))
                subscription.ready.append(task_event(view, None))
            else:
                self.watchers.setdefault(task_id, []).append(subscription)
                subscription.pending.add(task_id)
        self.streams += 1
        return subscription

    def unsubscribe(self, subscription: EventSubscription) -> None:
        if subscription.closed:
            return
        subscription.closed = True
        self.streams -= 1
        for task_id in subscription.pending:
            watching = self.watchers.get(task_id)
            if watching is not None and subscription in watching:
                watching.remove(subscription)
                if not watching:
                    del self.watchers[task_id]
        subscription.pending.clear()

    def end_all(self) -> None:
        """End every open stream cleanly now (the broker is shutting down): a client that
        sees a stream end before every task was reported opens a new one for the rest,
        elsewhere if it can (docs/API.md, Task events)."""
        for watching in self.watchers.values():
            for subscription in watching:
                subscription.pending.clear()
                subscription.wake.set()
        self.watchers.clear()

    def _on_applied(self, entry: e.Entry, applied: Applied) -> None:
        if not self.watchers:
            return  # the apply path pays one test when nobody streams
        state = self._node.state
        # The applier sets the node's position to the entry's before it calls listeners.
        ledger_id, entry_id = self._node.position
        for index, task_id in enumerate(applied.final_ids):
            watching = self.watchers.pop(task_id, None)
            task = state.tasks.get(task_id) if watching else None
            if watching is None or task is None:
                continue
            view = json_encoder.encode(task_view(task, state.tree(task_id), state.workers))
            event = task_event(view, (ledger_id, entry_id, index))
            for subscription in watching:
                subscription.ready.append(event)
                subscription.pending.discard(task_id)
                subscription.wake.set()


class ApiContext:
    """The broker as the handlers see it."""

    def __init__(
        self,
        node: Node,
        config: ApiConfig,
        code_store: CodeStore | None,
        cluster: ClusterView | None,
        outputs: OutputStore | None,
        webhooks: WebhookSender | None = None,
    ) -> None:
        self.node = node
        self.config = config
        self.code_store = code_store
        # Task output the leader's worker link collects (None: GET .../logs finds none).
        self.outputs = outputs if outputs is not None else OutputStore()
        self.upload_checker = UploadChecker(config.artifact_limits)
        self.cluster_view = cluster
        self.waiters = TaskWaiters(node)
        self.events = TaskEvents(node)
        # Per-tenant submit rate limit, enforced while this broker leads (rate_limit.py).
        self.submit_limiter = SubmitRateLimiter()
        self.feed = EventFeed(node, config.event_history, config.max_event_backlog)
        # Delivers only while started: a leader duty the server runs (broker/leader).
        self.webhooks = webhooks if webhooks is not None else WebhookSender(node)
        # The dashboard's throughput series, counted from the entries this broker applies.
        self.throughput = dashboard.ThroughputRecorder(node)
        # The OpenAPI document (ApiApp sets it: it is generated from the route table).
        self.describe: Callable[[], bytes] = lambda: b"{}"
        self._openapi: bytes | None = None  # the served document, encoded once
        self._digest_cache: tuple[tuple[int, tuple[int, int]], str] | None = None

    def end_waits(self) -> None:
        """Shutting down: answer the long polls and end the event streams now, instead of
        holding the stop for up to their wait (their clients ask again, elsewhere)."""
        self.waiters.end_all()
        self.events.end_all()
        self.feed.end_all()

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
