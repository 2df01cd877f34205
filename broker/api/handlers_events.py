"""Handlers of the event streams, server-sent events (docs/API.md, Task events).

``GET /api/v1/events?tasks=1,2,3`` reports each task it names once, when the task is final:
at once for a task already final, else when the entry making it final is applied (the
applied entries' effects feed broker/api/context.py's TaskEvents; no polling). It ends
cleanly once every task was reported, or after ``wait_s``; a client then asks again for
what it has not seen.

Without ``tasks`` it is the feed (broker/api/event_feed.py): every task becoming final,
filtered by ``tenant``, ``tree`` and ``states``, in log order, from ``Last-Event-ID`` (a
key, replayed from the broker's ring of recent events) or from now, until ``wait_s``.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from typing import Final

from broker.api.common import HttpError, Request, Stream, float_param
from broker.api.context import ApiContext, EventSubscription
from broker.api.event_feed import (
    WHOLE_ENTRY,
    EventKey,
    FeedFilter,
    FeedSubscription,
    PositionGoneError,
)
from broker.core import FINAL_STATES
from broker.security.auth import Role as CallerRole

_TASK_IDS: Final = re.compile(r"\d{1,18}(?:,\d{1,18})*")
_EVENT_ID: Final = re.compile(r"(-?\d{1,18}):(-?\d{1,18})(?::(\d{1,10}))?")
_FEED_PARAMS: Final = frozenset({"tenant", "tree", "states", "wait_s"})
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
    if "tasks" not in request.query:
        return await _feed(api, request)
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
    _check_capacity(api)
    subscription = hub.subscribe(ids)
    chunks = _events(subscription, wait_s, config.event_keepalive_s)
    return 200, Stream.of(chunks, lambda: hub.unsubscribe(subscription))


def _check_capacity(api: ApiContext) -> None:
    limit = api.config.max_event_streams
    if api.events.streams + api.feed.streams >= limit:
        raise HttpError(
            503,
            "unavailable",
            f"this broker serves {limit} event streams already; retry later",
            retryable=True,
        )


def last_event_id(request: Request) -> EventKey | None:
    """The ``Last-Event-ID`` header: ``LEDGER:ENTRY:INDEX`` as the stream's ids, or
    ``LEDGER:ENTRY`` (after every event of that entry)."""
    raw = request.header(b"last-event-id")
    if raw is None:
        return None
    # Empty too is refused: a browser's EventSource leaves the header out when it has no id.
    found = _EVENT_ID.fullmatch(raw.decode("latin-1").strip())
    if found is None:
        raise HttpError(
            400,
            "invalid_request",
            "Last-Event-ID must be an event id of the stream, LEDGER:ENTRY:INDEX",
        )
    ledger, entry, index = found.groups()
    return int(ledger), int(entry), WHOLE_ENTRY if index is None else int(index)


def feed_filter(request: Request) -> FeedFilter:
    """The feed's filters; a tenant token sees its own tenant only."""
    query = request.query
    tenant = query.get("tenant")
    principal = request.principal
    if principal.role is CallerRole.TENANT:
        if tenant is not None and tenant != principal.tenant:
            raise HttpError(403, "forbidden", f"this token sees tenant {principal.tenant!r} only")
        tenant = principal.tenant
    root = None
    raw_root = query.get("tree")
    if raw_root is not None:
        if not raw_root.isdigit() or len(raw_root) > 18:
            raise HttpError(400, "invalid_request", "tree must be a task id (a tree's root)")
        root = int(raw_root)
    states = None
    raw_states = query.get("states")
    if raw_states is not None:
        states = frozenset(raw_states.split(","))
        wrong = states - FINAL_STATES
        if not raw_states or wrong:
            raise HttpError(
                400,
                "invalid_request",
                "states must be final states separated by commas: "
                + ",".join(sorted(FINAL_STATES)),
            )
    return FeedFilter(tenant, root, states)


async def _feed(api: ApiContext, request: Request) -> tuple[int, bytes]:
    unknown = set(request.query) - _FEED_PARAMS
    if unknown:
        raise HttpError(400, "invalid_request", f"unknown query parameters: {sorted(unknown)}")
    config = api.config
    wait_s = float_param(
        request.query, "wait_s", min(60.0, config.max_wait_s), 0.0, config.max_wait_s
    )
    wanted = feed_filter(request)
    after = last_event_id(request)
    _check_capacity(api)
    feed = api.feed
    try:
        subscription = feed.subscribe(wanted, after)
    except PositionGoneError as gone:
        oldest = ":".join(map(str, gone.oldest))
        raise HttpError(
            410,
            "event_id_gone",
            f"this broker no longer holds every event after that Last-Event-ID (it holds "
            f"those after {oldest}); read the tasks' state instead, or resume on another broker",
        ) from None
    chunks = _events(subscription, wait_s, config.event_keepalive_s)
    return 200, Stream.of(chunks, lambda: feed.unsubscribe(subscription))


async def _events(
    subscription: EventSubscription | FeedSubscription, wait_s: float, keepalive_s: float
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
