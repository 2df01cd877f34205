"""Per-tenant webhooks, delivered by the leader (docs/API.md, Webhooks).

For each tenant with a webhook, the leader POSTs every completion event of the tenant, in
log order, one request per event: the body is the task's view (as the event feed's data),
``X-Steward-Event-Id`` its key and ``X-Steward-Signature`` ``sha256=`` and the hex
HMAC-SHA256 of the body under the webhook's secret. A 2xx answer is a delivery; anything
else, or no answer, is retried with exponential backoff (0.1 s doubling to 30 s) until it
is delivered: at least once. What was delivered is logged in batches (one
``WebhookProgress`` entry every ``FLUSH_S`` at most), so a new leader resumes after the
last logged key and redelivers at most what came after it.

The sender is a leader duty (broker/leader, docs/DESIGN.md §4): the server starts it when a
term opens for writes and stops it at step-down. It lives here, with the HTTP API, because
the API shows its delivery failures (``GET .../webhook``).

The events come from the state: applying an entry puts the tasks it made final into the
outbox of their tenant's webhook (broker/core/webhooks.py), and a logged delivery takes
them out. The outbox is replicated and in every snapshot, so a restarted broker or a new
leader delivers every event after the logged position, whatever it replayed or loaded (a
snapshot taken after the events, a follower that booted after them). An outbox holds at
most ``MAX_OUTBOX`` events (the oldest are dropped past it): the bound of "at least once".
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import time
from dataclasses import dataclass
from typing import Final

import httpx

from broker.api.common import json_encoder, task_view
from broker.api.event_feed import EventKey
from broker.core import entries as e
from broker.core.records import Webhook
from broker.replication.node import Node

logger = logging.getLogger(__name__)

FLUSH_S: Final = 0.5  # the delivered positions are logged at most this often
IDLE_S: Final = 0.05  # a tenant with nothing to deliver looks again after this
FIRST_BACKOFF_S: Final = 0.1
MAX_BACKOFF_S: Final = 30.0
POST_TIMEOUT_S: Final = 10.0
BATCH: Final = 256  # events taken from the outbox at a time
RETRY_S: Final = 1.0  # after the delivery loop itself failed (logged), it starts again


def signature(secret: str, body: bytes) -> str:
    """The ``X-Steward-Signature`` header's value for ``body``."""
    digest = hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
    return f"sha256={digest}"


def key_text(key: EventKey) -> str:
    return ":".join(map(str, key))


@dataclass(slots=True)
class DeliveryFailure:
    """The event a tenant's webhook is stuck on, as the leader retrying it knows it (not
    replicated: a follower, or a new leader before its first try, knows none)."""

    event: str  # its event id
    failures: int  # failed tries of this event so far
    last_error: str  # "HTTP 503", or the connection error
    last_failed_ms: int  # epoch ms of the last failed try
    next_retry_ms: int  # epoch ms of the next try


class WebhookSender:
    """A leader duty: from ``start`` (a term opened for writes) to ``stop`` (step-down) it
    delivers every tenant's pending events, picking up a webhook set meanwhile within
    ``FLUSH_S``; a new term resumes after the last logged key."""

    def __init__(self, node: Node) -> None:
        self._node = node
        self._task: asyncio.Task[None] | None = None
        # Delivered here, not yet logged: tenant -> key.
        self._delivered: dict[str, EventKey] = {}
        # The event each tenant's delivery fails on now (none once it is delivered).
        self.failing: dict[str, DeliveryFailure] = {}

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run_term(), name="webhook-sender")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run_term(self) -> None:
        while True:
            await self._run()
            await asyncio.sleep(RETRY_S)

    def _hooks(self) -> dict[str, Webhook]:
        return {
            t.name: t.webhook for t in self._node.state.tenants.values() if t.webhook is not None
        }

    async def _run(self) -> None:
        senders: dict[str, asyncio.Task[None]] = {}
        try:
            async with httpx.AsyncClient(timeout=POST_TIMEOUT_S) as http:
                while True:
                    hooks = self._hooks()
                    for tenant in hooks.keys() - senders.keys():
                        senders[tenant] = asyncio.create_task(self._deliver(http, tenant))
                    for tenant in [t for t, task in senders.items() if task.done()]:
                        del senders[tenant]
                    await asyncio.sleep(FLUSH_S)
                    await self._flush()
        except Exception:
            logger.exception("webhook delivery failed; starting again in %g s", RETRY_S)
        finally:
            for task in senders.values():
                task.cancel()
            self._delivered.clear()
            self.failing.clear()

    async def _flush(self) -> None:
        """Log what was delivered since the last flush, in one entry."""
        hooks = self._hooks()
        marks = tuple(
            e.WebhookMark(tenant, key)
            for tenant, key in self._delivered.items()
            if tenant in hooks and key > hooks[tenant].delivered
        )
        if marks and self._node.is_leader:
            try:
                await self._node.propose(
                    lambda stamp: e.WebhookProgress(time_ms=stamp.now_ms, marks=marks)
                )
            except Exception as exc:  # taking over, or deposed: the next flush retries
                logger.info("webhook progress not logged yet: %s", exc)

    def _pending(self, tenant: str, after: EventKey) -> list[tuple[EventKey, bytes]]:
        """Up to ``BATCH`` events of the tenant's outbox after ``after``, as (key, view)."""
        state = self._node.state
        outbox = state.webhook_outbox.get(tenant, ())
        found: list[tuple[EventKey, bytes]] = []
        for key, task_id in outbox:
            if key <= after:
                continue
            task = state.tasks.get(task_id)
            if task is None:  # purged since (finished-task retention): nothing to show
                continue
            found.append(
                (key, json_encoder.encode(task_view(task, state.tree(task_id), state.workers)))
            )
            if len(found) == BATCH:
                break
        return found

    async def _deliver(self, http: httpx.AsyncClient, tenant: str) -> None:
        """Deliver the tenant's events in order, each until it is acknowledged."""
        while True:
            hook = self._hooks().get(tenant)
            if hook is None:
                self._delivered.pop(tenant, None)
                return  # removed; a new PUT starts a new sender
            after = max(hook.delivered, self._delivered.get(tenant, hook.delivered))
            events = self._pending(tenant, after)
            if not events:
                await asyncio.sleep(IDLE_S)
                continue
            for key, body in events:
                await self._post_until_delivered(http, tenant, key, body)
                self._delivered[tenant] = key

    async def _post_until_delivered(
        self, http: httpx.AsyncClient, tenant: str, key: EventKey, body: bytes
    ) -> None:
        backoff_s = FIRST_BACKOFF_S
        while True:
            hook = self._hooks().get(tenant)
            if hook is None:
                self.failing.pop(tenant, None)
                return
            headers = {
                "content-type": "application/json",
                "x-steward-event-id": key_text(key),
                "x-steward-signature": signature(hook.secret, body),
            }
            try:
                answer = await http.post(hook.url, content=body, headers=headers)
                if 200 <= answer.status_code < 300:
                    self.failing.pop(tenant, None)
                    return
                problem = f"HTTP {answer.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            logger.warning(
                "webhook of tenant %s: event %s not delivered (%s); again in %.1f s",
                tenant,
                key_text(key),
                problem,
                backoff_s,
            )
            self._failed(tenant, key_text(key), problem, backoff_s)
            await asyncio.sleep(backoff_s)
            backoff_s = min(MAX_BACKOFF_S, backoff_s * 2)

    def _failed(self, tenant: str, event: str, problem: str, backoff_s: float) -> None:
        now_ms = int(time.time() * 1000)
        was = self.failing.get(tenant)
        failures = was.failures + 1 if was is not None and was.event == event else 1
        self.failing[tenant] = DeliveryFailure(
            event, failures, problem, now_ms, now_ms + int(backoff_s * 1000)
        )
