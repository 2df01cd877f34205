"""The completion-event feed behind ``GET /api/v1/events`` without ``tasks``: every task
that becomes final, in log order, filtered by tenant, tree root and state, resumable with
``Last-Event-ID``.

Each event's id is its key: the log position of the entry that made the task final and
the task's index among the tasks that entry made final (``LEDGER:ENTRY:INDEX``). Every
broker applies the same entries in the same order (docs/DESIGN.md §1, §4), so keys name
the same events on the leader, on followers and on a new leader after a fail-over: a
client resumes anywhere from the last key it saw.

Resuming replays from a bounded ring of this broker's recent events (fed by the effects
of the entries it applies; no log reads on the request path). A key older than the ring
holds, or one from before the snapshot this broker's state was loaded from, answers 410
(docs/API.md, Task events): the broker cannot prove it still has every later event, and a
stream with a silent gap would break the exactly-once promise. Replaying from the log
instead would serve older keys but costs log reads per reconnect and cannot reach
entries a snapshot already trimmed either.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass
from typing import Final

from broker.api.common import json_encoder, task_view
from broker.core import entries as e
from broker.core.effects import Applied
from broker.core.records import Task
from broker.replication.node import Node

EventKey = tuple[int, int, int]  # (ledger id, entry id, index among the entry's final tasks)
# Above any index: "after every event of that entry".
WHOLE_ENTRY: Final = 2**31 - 1


def task_event(view: bytes, key: EventKey | None) -> bytes:
    """One server-sent event: a task's view, with its key as the id when known."""
    event_id = b"" if key is None else b"id: %d:%d:%d\n" % key
    return b"event: task\n" + event_id + b"data: " + view + b"\n\n"


@dataclass(frozen=True, slots=True)
class FeedFilter:
    """Which events a feed stream wants: None matches everything."""

    tenant: str | None = None
    root: int | None = None
    states: frozenset[str] | None = None

    def matches(self, task: Task) -> bool:
        return (
            (self.tenant is None or task.tenant == self.tenant)
            and (self.root is None or task.root == self.root)
            and (self.states is None or task.state in self.states)
        )


class _Event:
    """One event of the ring: the task (final, so it no longer changes but for its tree
    view) and its encoded chunk, made when first needed (the apply path does not encode
    events nobody streams)."""

    __slots__ = ("chunk", "key", "task", "view")

    def __init__(self, key: EventKey, task: Task) -> None:
        self.key = key
        self.task = task
        self.view: bytes | None = None
        self.chunk: bytes | None = None


class FeedSubscription:
    """One feed stream: its filter, the last key it sent or skips up to, the chunks ready to
    send, and the event set when more are ready. ``pending`` turns False when the stream
    must end (the broker stops, or the client fell ``max_backlog`` events behind: it
    resumes from its last id)."""

    __slots__ = ("after", "closed", "filter", "pending", "ready", "wake")

    def __init__(self, feed_filter: FeedFilter, after: EventKey | None) -> None:
        self.filter = feed_filter
        self.after = after
        self.ready: list[bytes] = []
        self.wake = asyncio.Event()
        self.pending = True
        self.closed = False


class PositionGoneError(Exception):
    """The resume key is older than the events this broker holds."""

    def __init__(self, oldest: EventKey) -> None:
        super().__init__(oldest)
        self.oldest = oldest


class EventFeed:
    """The ring of recent events and the feed streams' subscriptions."""

    def __init__(self, node: Node, capacity: int, max_backlog: int) -> None:
        self._node = node
        self.capacity = capacity
        self.max_backlog = max_backlog
        self._ring: deque[_Event] = deque()
        # The ring holds every event with a key above ``base``.
        self.base: EventKey = (*node.position, WHOLE_ENTRY)
        self._state = node.state
        self.subscriptions: list[FeedSubscription] = []
        node.listeners.append(self._on_applied)

    @property
    def streams(self) -> int:
        return len(self.subscriptions)

    def _restart_if_state_replaced(self, base: EventKey) -> None:
        # A snapshot replaced the state: the entries it covers were never applied here,
        # so the ring cannot vouch for keys before it.
        if self._node.state is not self._state:
            self._state = self._node.state
            self._ring.clear()
            self.base = base

    def subscribe(self, feed_filter: FeedFilter, after: EventKey | None) -> FeedSubscription:
        """A feed stream from ``after`` (the held events after it, then the live ones) or
        from now. Synchronous, so no entry is applied between the replay and the watch.
        Raises PositionGoneError when the ring may lack events after ``after``."""
        self._restart_if_state_replaced((*self._node.position, WHOLE_ENTRY))
        if after is not None and after < self.base:
            raise PositionGoneError(self.base)
        subscription = FeedSubscription(feed_filter, after)
        if after is not None:
            held = [event for event in reversed(self._ring) if event.key > after]
            for event in reversed(held):
                if feed_filter.matches(event.task):
                    subscription.ready.append(self._chunk(event))
        self.subscriptions.append(subscription)
        return subscription

    def unsubscribe(self, subscription: FeedSubscription) -> None:
        if not subscription.closed:
            subscription.closed = True
            self.subscriptions.remove(subscription)

    def end_all(self) -> None:
        for subscription in self.subscriptions:
            subscription.pending = False
            subscription.wake.set()

    def _view(self, event: _Event) -> bytes:
        if event.view is None:
            state = self._node.state
            event.view = json_encoder.encode(
                task_view(event.task, state.tree(event.task.id), state.workers)
            )
        return event.view

    def _chunk(self, event: _Event) -> bytes:
        if event.chunk is None:
            event.chunk = task_event(self._view(event), event.key)
        return event.chunk

    def held_after(
        self, after: EventKey, feed_filter: FeedFilter, limit: int
    ) -> tuple[list[tuple[EventKey, bytes]], bool]:
        """Up to ``limit`` held events after ``after`` that match, oldest first, as (key,
        task view); and whether the ring may lack some after ``after`` (it is too old)."""
        self._restart_if_state_replaced((*self._node.position, WHOLE_ENTRY))
        found: list[_Event] = []
        for event in reversed(self._ring):
            if event.key <= after:
                break
            if feed_filter.matches(event.task):
                found.append(event)
        oldest_first = found[::-1][:limit]
        return [(event.key, self._view(event)) for event in oldest_first], after < self.base

    def _on_applied(self, entry: e.Entry, applied: Applied) -> None:
        final_ids = applied.final_ids
        if not final_ids:
            return
        ledger_id, entry_id = self._node.position  # the applier set it to this entry's
        self._restart_if_state_replaced((ledger_id, entry_id - 1, WHOLE_ENTRY))
        tasks = self._node.state.tasks
        ring = self._ring
        for index, task_id in enumerate(final_ids):
            task = tasks.get(task_id)
            if task is None:
                continue
            event = _Event((ledger_id, entry_id, index), task)
            ring.append(event)
            if len(ring) > self.capacity:
                self.base = ring.popleft().key
            for subscription in self.subscriptions:
                self._offer(subscription, event)

    def _offer(self, subscription: FeedSubscription, event: _Event) -> None:
        after = subscription.after
        # A follower behind the broker the client last read from: skip what it saw.
        if after is not None and event.key <= after:
            return
        if not subscription.pending or not subscription.filter.matches(event.task):
            return
        if len(subscription.ready) >= self.max_backlog:
            subscription.pending = False  # it sends what it has and ends; the client resumes
        else:
            subscription.ready.append(self._chunk(event))
        subscription.wake.set()
