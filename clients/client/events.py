"""Waiting for many tasks on the broker's event stream (``GET /api/v1/events``), without IO:
a server-sent event parser and the state of one ``wait_many`` / ``iter_finished``.

The clients' ``_stream_lines(path, params, timeout_s)`` is the only IO: it opens the stream
(following the brokers like a write does, see clients/client/routing.py) and yields the
body's bytes as they arrive, lines with their ``\\n`` or any pieces of them;
:class:`SseParser` finds the lines (each bounded) and events. :class:`EventWait` says what
to ask for next (the ids not seen yet, a bounded number per stream) and turns events into
task records; a stream that ends or breaks early is simply opened again.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Final

from clients.client.errors import ConnectionFailedError, StewardError, TaskTimeoutError

EVENTS_PATH: Final = "/api/v1/events"
# Ids per stream: the broker takes 10,000, but its request line and headers are capped at
# 64 KiB; 2,000 ids of up to 19 characters each stay well under.
MAX_IDS_PER_STREAM: Final = 2_000
# One stream waits at most this long (the broker's wait_s; it caps it at 60 by default).
STREAM_SLICE_S: Final = 30.0
# The broker sends a keep-alive comment every 15 s: a stream silent for longer is dead.
READ_TIMEOUT_S: Final = 20.0
# A line longer than this (a task's result is in one line) is refused, not buffered.
MAX_LINE_BYTES: Final = 32 * 1024 * 1024
# After a stream broke, before opening the next one (opening retries with its own backoff).
BROKEN_PAUSE_S: Final = 0.1
# A tree wait reads its root again at each stream it opens: slices shorter than a task
# wait's bound how long a tree's end could go unseen if no event of the tree announced it
# (every end known today comes with one: the last task of the tree becoming final).
TREE_SLICE_S: Final = 10.0


class EventStreamError(StewardError):
    """The broker's event stream was malformed (a line over the bound, a bad event)."""

    def __init__(self, message: str) -> None:
        super().__init__(0, "bad_event_stream", message)


class StreamBrokenError(ConnectionFailedError):
    """An open event stream broke (the broker went away, or went silent): open another."""


class WaitTimeoutError(TaskTimeoutError):
    """Some tasks were not final at the timeout. ``task_ids``: those; ``finished``: the
    records of the others, by id (``task_id`` is the first not final)."""

    def __init__(self, task_ids: list[int], finished: dict[int, dict[str, Any]], timeout_s: float):
        super().__init__(task_ids[0], timeout_s)
        shown = ", ".join(str(i) for i in task_ids[:10]) + (", ..." if len(task_ids) > 10 else "")
        self.args = (
            f"{len(task_ids)} of {len(task_ids) + len(finished)} tasks not final after "
            f"{timeout_s} s: {shown}",
        )
        self.task_ids = task_ids
        self.finished = finished


@dataclass(frozen=True)
class ServerSentEvent:
    event: str = "message"
    data: str = ""
    id: str | None = None


class SseParser:
    """Server-sent events from bytes fed in any pieces (lines end in ``\\n`` or ``\\r\\n``).
    A line, or an event's data, over ``max_line_bytes`` raises EventStreamError."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.max_line_bytes = max_line_bytes
        self._buffer = bytearray()
        self._scanned = 0  # bytes of the buffer known to hold no newline
        self._event = "message"
        self._data: list[str] = []
        self._data_bytes = 0
        self._id: str | None = None

    def feed(self, data: bytes) -> list[ServerSentEvent]:
        buffer = self._buffer
        buffer += data
        events: list[ServerSentEvent] = []
        start = 0
        while True:
            end = buffer.find(b"\n", max(start, self._scanned))
            if end < 0:
                break
            line = bytes(buffer[start:end])
            start = end + 1
            self._check(len(line))
            event = self._line(line[:-1] if line.endswith(b"\r") else line)
            if event is not None:
                events.append(event)
        del buffer[:start]
        self._scanned = len(buffer)
        self._check(len(buffer))
        return events

    def _check(self, size: int) -> None:
        if size > self.max_line_bytes:
            raise EventStreamError(f"event stream line over {self.max_line_bytes} bytes")

    def _line(self, raw: bytes) -> ServerSentEvent | None:
        if not raw:
            return self._dispatch()
        line = raw.decode("utf-8", "replace")
        if line.startswith(":"):
            return None  # a comment: the broker's keep-alive
        name, colon, value = line.partition(":")
        if colon and value.startswith(" "):
            value = value[1:]
        if name == "data":
            self._data_bytes += len(raw)
            self._check(self._data_bytes)
            self._data.append(value)
        elif name == "event":
            self._event = value
        elif name == "id" and "\0" not in value:
            self._id = value
        return None  # retry and unknown fields: ignored, as the standard says

    def _dispatch(self) -> ServerSentEvent | None:
        event = None
        if self._data:
            event = ServerSentEvent(self._event, "\n".join(self._data), self._id)
        self._event, self._data, self._data_bytes = "message", [], 0
        return event


def task_ids_of(tasks: Iterable[Any]) -> list[int]:
    """Task ids from handles (anything with an ``id``) or ints, each once, in order."""
    ids = [int(getattr(task, "id", task)) for task in tasks]
    return list(dict.fromkeys(ids))


class EventWait:
    """One wait for many tasks: which ids the next stream asks for, for how long, and the
    records of the tasks reported so far."""

    def __init__(
        self, task_ids: list[int], timeout: float | None, now: Callable[[], float]
    ) -> None:
        self.pending: dict[int, None] = dict.fromkeys(task_ids)
        self.finished: dict[int, dict[str, Any]] = {}
        self.timeout = timeout
        self.now = now
        self.deadline = None if timeout is None else now() + timeout
        self.last_event_id: str | None = None  # for resuming by position (a later version)

    @property
    def done(self) -> bool:
        return not self.pending

    def next_stream(self) -> tuple[dict[str, str], float]:
        """The query of the next stream and its read timeout (the broker ends it after
        ``wait_s`` and is silent for 15 s at most); raises WaitTimeoutError once the time
        is over."""
        wait_s = STREAM_SLICE_S
        if self.deadline is not None:
            remaining = self.deadline - self.now()
            if remaining <= 0:
                raise WaitTimeoutError(list(self.pending), self.finished, self.timeout or 0.0)
            wait_s = min(wait_s, remaining)
        ids = list(self.pending)[:MAX_IDS_PER_STREAM]
        query = {"tasks": ",".join(map(str, ids)), "wait_s": f"{wait_s:.3f}"}
        return query, min(READ_TIMEOUT_S, wait_s + 5.0)

    def on_event(self, event: ServerSentEvent) -> dict[str, Any] | None:
        """The record a ``task`` event reports, if it is one this wait still waits for."""
        if event.event != "task":
            return None
        try:
            record: dict[str, Any] = json.loads(event.data)
            task_id = int(record["id"])
        except (ValueError, TypeError, KeyError) as exc:
            raise EventStreamError(f"malformed task event: {exc}") from None
        if task_id not in self.pending:
            return None
        del self.pending[task_id]
        self.finished[task_id] = record
        if event.id is not None:
            self.last_event_id = event.id
        return record


_EVENT_ID_CHARS: Final = frozenset("0123456789:-")


@dataclass(frozen=True)
class TaskEvent:
    """One event of the feed: its id (``LEDGER:ENTRY:INDEX``, what ``last_event_id``
    resumes after) and the task's record as the broker sent it."""

    id: str
    task: dict[str, Any]


class FeedWait:
    """One ``events()`` iteration of the feed (``GET /api/v1/events`` without ``tasks``):
    the next stream's query, its ``Last-Event-ID`` header line (the id of the last event
    seen, so a stream reopened after a break, an end or a leader change continues right
    after it: the broker replays what came in between, docs/API.md, Task events), and
    the events turned into :class:`TaskEvent`."""

    def __init__(
        self,
        filters: dict[str, str],
        last_event_id: str | None,
        timeout: float | None,
        now: Callable[[], float],
    ) -> None:
        if last_event_id is not None and not (
            last_event_id and set(last_event_id) <= _EVENT_ID_CHARS
        ):
            raise ValueError(f"not an event id: {last_event_id!r}")
        self.filters = filters
        self.last_event_id = last_event_id
        self.now = now
        self.deadline = None if timeout is None else now() + timeout

    @property
    def over(self) -> bool:
        return self.deadline is not None and self.now() >= self.deadline

    def next_stream(self) -> tuple[dict[str, str], str, float]:
        """The query, the extra header lines and the read timeout of the next stream."""
        wait_s = STREAM_SLICE_S
        if self.deadline is not None:
            wait_s = max(0.0, min(wait_s, self.deadline - self.now()))
        query = {**self.filters, "wait_s": f"{wait_s:.3f}"}
        header = "" if self.last_event_id is None else f"Last-Event-ID: {self.last_event_id}\r\n"
        return query, header, min(READ_TIMEOUT_S, wait_s + 5.0)

    def on_event(self, event: ServerSentEvent) -> TaskEvent | None:
        if event.event != "task":
            return None
        if event.id is None:
            raise EventStreamError("a feed event without an id")
        try:
            record: dict[str, Any] = json.loads(event.data)
        except ValueError as exc:
            raise EventStreamError(f"malformed task event: {exc}") from None
        self.last_event_id = event.id
        return TaskEvent(event.id, record)


def feed_filters(
    tenant: str | None, tree: int | None, states: Iterable[str] | None
) -> dict[str, str]:
    """The feed's query filters (None: not filtered on)."""
    filters: dict[str, str] = {}
    if tenant is not None:
        filters["tenant"] = tenant
    if tree is not None:
        filters["tree"] = str(int(tree))
    if states is not None:
        filters["states"] = ",".join(states)
    return filters


def tree_stream(root: int, remaining_s: float | None) -> tuple[dict[str, str], float]:
    """The query and read timeout of a tree wait's next stream: the feed's events of the
    tree ``root`` (each one a cue to read the root again) for at most ``TREE_SLICE_S``."""
    wait_s = TREE_SLICE_S if remaining_s is None else max(0.0, min(TREE_SLICE_S, remaining_s))
    return {"tree": str(int(root)), "wait_s": f"{wait_s:.3f}"}, min(READ_TIMEOUT_S, wait_s + 5.0)
