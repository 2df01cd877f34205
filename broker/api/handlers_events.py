"""Handlers of the event streams: ``GET /api/v1/events?tasks=1,2,3``, server-sent events.

A stream reports each task it names once, when the task is final: at once for a task
already final, else when the entry making it final is applied (the applied entries'
effects feed broker/api/context.py's TaskEvents; no polling). It ends cleanly once every
task was reported, or after ``wait_s``; a client then asks again for what it has not seen.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Final

from broker.api.common import HttpError, Request, Stream, float_param
from broker.api.context import ApiContext, EventSubscription

_TASK_IDS: Final = re.compile(r"\d{1,18}(?:,\d{1,18})*")
_KEEP_ALIVE: Final = b": keep-alive\n\n"


def task_ids_param(request: Request, limit: int) -> list[int]:
    """The ``tasks`` query parameter: 1 to ``limit`` distinct decimal ids, comma-separated."""
    raw = request.query.get("tasks")
    if raw is None or not raw:
        raise HttpError(400, "invalid_request", "tasks is required: task ids, comma-separated")
    if _TASK_IDS.fullmatch(raw) is None:
        raise HttpError(
            400,
            "invalid_request",
            "tasks must be task ids (decimal, up to 18 digits) separated by commas, without spaces",
        )
    ids = [int(part) for part in raw.split(",")]
    if len(ids) > limit:
        raise HttpError(400, "invalid_request", f"tasks names {len(ids)} tasks; at most {limit}")
    seen: set[int] = set()
    for task_id in ids:
        if task_id in seen:
            raise HttpError(400, "invalid_request", f"tasks names task {task_id} twice")
        seen.add(task_id)
    return ids


async def task_events(api: ApiContext, request: Request) -> tuple[int, bytes]:
    unknown = set(request.query) - {"tasks", "wait_s"}
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    config = api.config
    ids = task_ids_param(request, config.max_event_tasks)
    wait_s = float_param(
        request.query, "wait_s", min(60.0, config.max_wait_s), 0.0, config.max_wait_s
    )
    state = api.node.state
    principal = request.principal
    for task_id in ids:
        task = state.tasks.get(task_id)
        # As GET /api/v1/tasks/{id}: another tenant's task answers like a missing one.
        if task is None or not principal.may_see_tenant(task.tenant):
            raise HttpError(404, "not_found", f"task {task_id} does not exist")
    hub = api.events
    if hub.streams >= config.max_event_streams:
        raise HttpError(
            503,
            "unavailable",
            f"this broker serves {config.max_event_streams} event streams already; retry later",
            retryable=True,
        )
    subscription = hub.subscribe(ids)
    chunks = _events(subscription, wait_s, config.event_keepalive_s)
    return 200, Stream.of(chunks, lambda: hub.unsubscribe(subscription))


async def _events(
    subscription: EventSubscription, wait_s: float, keepalive_s: float
) -> AsyncIterator[bytes]:
    """The stream's chunks: events as they become ready, a comment line when nothing was
    sent for ``keepalive_s`` (so proxies and clients see a live connection), until every
    task was reported or ``wait_s`` is over."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    while True:
        # Cleared before looking: an event made ready while a chunk was sent sets it again.
        subscription.wake.clear()
        if subscription.ready:
            chunk = b"".join(subscription.ready)
            subscription.ready.clear()
            yield chunk
            continue
        remaining = deadline - loop.time()
        if not subscription.pending or remaining <= 0:
            return
        try:
            await asyncio.wait_for(subscription.wake.wait(), min(remaining, keepalive_s))
        except TimeoutError:
            if loop.time() < deadline:
                yield _KEEP_ALIVE
