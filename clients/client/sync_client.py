"""The synchronous client: :class:`StewardClient`, its task handles and transactions."""

from __future__ import annotations

import ssl
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from clients.client import api_calls as calls
from clients.client.api_calls import Request
from clients.client.encoding import _Handle, _result_of, _Transaction, _tree_result_of, _Waiting
from clients.client.errors import NotFoundError, StewardError, _raise_for
from clients.client.events import (
    BROKEN_PAUSE_S,
    EVENTS_PATH,
    EventWait,
    FeedWait,
    SseParser,
    StreamBrokenError,
    TaskEvent,
    feed_filters,
    task_ids_of,
    tree_stream,
)
from clients.client.producer import Producer
from clients.client.producing import (
    DEFAULT_LINGER_MS,
    DEFAULT_MAX_BATCH,
    DEFAULT_MAX_BLOCK_S,
    DEFAULT_MAX_BUFFERED,
)
from clients.client.routing import (
    DEFAULT_FAILOVER_TIMEOUT_S,
    _Call,
    _ClientBase,
)
from clients.client.transport import (
    SyncTransport,
    TransportError,
    describe,
    request_target,
)


class TaskHandle(_Handle["StewardClient"]):
    """A submitted task. ``result()`` waits (long polling) and returns its JSON result."""

    def info(self) -> dict[str, Any]:
        return self.client.task(self.id)

    def _poll(self, timeout: float | None, tree: bool) -> dict[str, Any]:
        waiting = _Waiting(self.id, timeout, tree, time.monotonic)
        while True:
            task = self.client.task(self.id, wait_s=waiting.poll_s(), wait_tree=tree)
            if waiting.ended(task):
                return task

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the task is final; return its record (whatever the outcome). On the
        broker's event stream (one event when it is final), not by polling."""
        return self.client.wait_many([self.id], timeout)[self.id]

    def result(self, timeout: float | None = None) -> Any:
        """The task's result; raises TaskFailedError or TaskTimeoutError."""
        return _result_of(self.wait(timeout))

    def wait_tree(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the tree this tracked root grew has ended (``completed``, or
        ``failed`` with no replay left); return the root's record (``["tree"]``).

        On the broker's event feed of the tree (``GET /api/v1/events?tree=ROOT``), not
        by polling: the root is read when a stream opens (the feed is subscribed by
        then, so an end after that read comes as an event) and at each event of the
        tree. A broker without the feed (404: older than it, during a rolling upgrade)
        is long-polled instead."""
        waiting = _Waiting(self.id, timeout, True, time.monotonic)
        root: list[dict[str, Any]] = []

        def ended() -> bool:
            record = self.client.task(self.id)
            if record.get("tree") is None:  # not a tracked root: the broker's 400 says so
                record = self.client.task(self.id, wait_tree=True)
            root[:] = [record]
            return waiting.ended(record)

        while True:
            query, read_timeout_s = tree_stream(self.id, waiting.remaining_s())
            parser = SseParser()
            try:
                lines = _stream_lines(
                    self.client, EVENTS_PATH, query, read_timeout_s, on_open=ended
                )
                for piece in lines:
                    if any(event.event == "task" for event in parser.feed(piece)) and ended():
                        return root[0]
            except StreamBrokenError:
                time.sleep(BROKEN_PAUSE_S)
            except NotFoundError:
                return self._poll(waiting.remaining_s(), tree=True)
            if root and waiting.ended(root[0]):
                return root[0]

    def tree_result(self, timeout: float | None = None) -> Any:
        """The root's result once its whole tree completed; raises TreeFailedError,
        TaskTimeoutError, or InvalidRequestError for a task submitted without
        ``track_tree=True``."""
        return _tree_result_of(self.wait_tree(timeout))

    def cancel(self) -> dict[str, Any]:
        return self.client.cancel(self.id)


class Transaction(_Transaction["StewardClient", TaskHandle]):
    def submit(self, type: str, params: Any = None, **options: Any) -> TaskHandle:
        handle = self.client.submit(
            type, params, tenant=self.tenant, transaction=self.id, **options
        )
        self.handles.append(handle)
        return handle


class StewardClient(_ClientBase):
    """A broker's (or a cluster's) API; see the module docstring on failover and retries.

    ``url``: one base URL, several (a sequence or a comma-separated string).
    ``timeout_s``: per request; ``failover_timeout_s``: how long a write keeps
    trying other brokers (or waiting for a leader) before FailoverTimeoutError.
    ``token``: the API token sent as ``Authorization: Bearer`` (brokers with
    authentication on answer 401 without one).

    It keeps one connection alive per broker and is not thread-safe: give each thread
    its own client.
    """

    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8080",
        *,
        timeout_s: float = 30.0,
        ca_file: str | Path | ssl.SSLContext | None = None,
        failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S,
        token: str | None = None,
    ) -> None:
        super().__init__(url, timeout_s, failover_timeout_s, ca_file, token)
        self._transport = SyncTransport(self._tls)

    def close(self) -> None:
        self._transport.close()

    def __enter__(self) -> StewardClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _send(self, request: Request) -> Any:
        call = _Call(self._router, write=request.write)
        timeout_s = request.timeout_s or self._timeout_s
        method = request.method
        target, body, headers = request.wire(self._headers)
        while True:
            base = call.target()
            try:
                response = self._transport.request(base, method, target, body, headers, timeout_s)
            except TransportError as exc:
                pause_s = call.failed(base, exc)
            else:
                answer_pause_s = call.answered(base, response)
                if answer_pause_s is None:
                    return request.decode(_raise_for(response))
                pause_s = answer_pause_s
            if pause_s > 0:
                time.sleep(pause_s)

    # tasks

    def iter_finished(
        self, tasks: Iterable[Any], timeout: float | None = None
    ) -> Iterator[dict[str, Any]]:
        """Each task's record (``tasks``: handles or ids) as it becomes final, in that
        order, from the broker's event stream (``GET /api/v1/events``; reopened, on
        another broker if need be, for the tasks not seen yet when it ends or breaks).
        Raises WaitTimeoutError when ``timeout`` is over first."""
        wait = EventWait(task_ids_of(tasks), timeout, time.monotonic)
        while not wait.done:
            query, read_timeout_s = wait.next_stream()
            parser = SseParser()
            seen = len(wait.finished)
            try:
                for piece in _stream_lines(self, EVENTS_PATH, query, read_timeout_s):
                    for event in parser.feed(piece):
                        record = wait.on_event(event)
                        if record is not None:
                            yield record
            except StreamBrokenError:
                time.sleep(BROKEN_PAUSE_S)
            else:
                if len(wait.finished) == seen:  # an empty stream: no busy loop of them
                    time.sleep(BROKEN_PAUSE_S)

    def events(
        self,
        *,
        tenant: str | None = None,
        tree: int | None = None,
        states: Iterable[str] | None = None,
        last_event_id: str | None = None,
        timeout: float | None = None,
    ) -> Iterator[TaskEvent]:
        """Every task becoming final (filtered by ``tenant``, ``tree`` root, ``states``),
        in log order, from the broker's event feed: after ``last_event_id`` (an event's
        ``id``, replayed by the broker) or from now, until ``timeout`` (None: for ever).
        A stream that ends or breaks, also by a leader change, is reopened after the
        last event seen: no event is lost or repeated (docs/API.md, Task events). A
        broker that no longer holds the events after it answers 410 (a StewardError)."""
        wait = FeedWait(feed_filters(tenant, tree, states), last_event_id, timeout, time.monotonic)
        while not wait.over:
            query, header, read_timeout_s = wait.next_stream()
            parser = SseParser()
            seen = wait.last_event_id
            try:
                for piece in _stream_lines(self, EVENTS_PATH, query, read_timeout_s, header):
                    for event in parser.feed(piece):
                        found = wait.on_event(event)
                        if found is not None:
                            yield found
            except StreamBrokenError:
                time.sleep(BROKEN_PAUSE_S)
            else:
                if wait.last_event_id == seen:  # an empty stream: no busy loop of them
                    time.sleep(BROKEN_PAUSE_S)

    def wait_many(
        self, tasks: Iterable[Any], timeout: float | None = None
    ) -> dict[int, dict[str, Any]]:
        """Wait until every task (handles or ids) is final, on one event stream instead
        of a long poll each; their records by id, in the order given. Raises
        WaitTimeoutError (a TaskTimeoutError naming those not final, with the records of
        the others) when ``timeout`` is over first."""
        ids = task_ids_of(tasks)
        found = {int(record["id"]): record for record in self.iter_finished(ids, timeout)}
        return {task_id: found[task_id] for task_id in ids}

    def submit(
        self,
        type: str,
        params: Any = None,
        *,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> TaskHandle:
        """Submit one task. Options: slot, max_attempts, max_lost, deadline, start_after,
        resources, transaction, code, track_tree, tree_timeout_s, after, priority,
        retry_backoff_s, retry_backoff_max_s, allow_unknown_type (submit a type no worker
        serving the tenant registered yet instead of a 400: docs/API.md, "Task types").
        Retried safely under ``idempotency_key`` (default: 128 new random bits per call)."""
        answer = self._send(calls.submit(type, params, tenant, idempotency_key, options))
        return TaskHandle(self, int(answer["id"]), str(answer["state"]))

    def submit_many(
        self, tasks: list[dict[str, Any]], *, idempotency_key: str | None = None
    ) -> list[TaskHandle | StewardError]:
        """Submit a batch in one log entry; a handle or the refusal for each task."""
        answers = self._send(calls.submit_many(tasks, idempotency_key))
        return calls.handles_or_errors(
            answers, lambda task_id, state: TaskHandle(self, task_id, state)
        )

    def producer(
        self,
        *,
        linger_ms: float = DEFAULT_LINGER_MS,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_block_s: float = DEFAULT_MAX_BLOCK_S,
    ) -> Producer[TaskHandle]:
        """A pipelining producer: ``p.submit(...)`` returns a future at once; batches of up
        to ``max_batch`` go ``linger_ms`` after the first one waiting (docs/API.md,
        "Pipelining producer"). Use it in a ``with`` block (exit flushes)."""
        return Producer(
            self._clone,
            lambda task_id, state: TaskHandle(self, task_id, state),
            linger_ms=linger_ms,
            max_batch=max_batch,
            max_buffered=max_buffered,
            max_block_s=max_block_s,
        )

    def task(self, task_id: int, *, wait_s: float = 0.0, wait_tree: bool = False) -> dict[str, Any]:
        """A task's record; ``wait_s``: long poll until it is final (``wait_tree``: until
        the tree it roots has ended)."""
        result: dict[str, Any] = self._send(calls.task(task_id, wait_s, wait_tree, self._timeout_s))
        return result

    def tasks(
        self,
        *,
        state: str | None = None,
        tenant: str | None = None,
        type: str | None = None,
        limit: int = 100,
        after: int = 0,
    ) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.tasks(state, tenant, type, limit, after))
        return result

    def tree(self, root: int) -> dict[str, Any]:
        """A tracked tree's view: state, age, timeout, its tasks by state, pending anchors."""
        result: dict[str, Any] = self._send(calls.tree(root))
        return result

    def trees(
        self,
        *,
        state: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        after: int = 0,
    ) -> dict[str, Any]:
        """Tracked trees (state: pending, completed, failed or timed_out), lowest roots first."""
        result: dict[str, Any] = self._send(calls.trees(state, tenant, limit, after))
        return result

    def cancel(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.cancel(task_id))
        return result

    def cancel_matching(
        self,
        *,
        tenant: str | None = None,
        type: str | None = None,
        state: str | None = None,
        tree: int | None = None,
        submitted_before: str | float | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """Cancel the live tasks matching every filter given (at least one):
        ``{matched, cancelled, skipped, batches}``. Not idempotent as a whole, but a
        retry cancels only what still matches (nothing twice)."""
        filters = {
            "tenant": tenant,
            "type": type,
            "state": state,
            "tree": tree,
            "submitted_before": submitted_before,
            "reason": reason,
        }
        result: dict[str, Any] = self._send(calls.cancel_matching(filters))
        return result

    def logs(self, task_id: int, attempt: int | None = None, offset: int = 0) -> dict[str, Any]:
        """An attempt's captured output (default: the latest attempt) from byte ``offset``:
        ``{task_id, attempt, output, truncated, complete, next_offset, offset, available}``.
        Pass ``next_offset`` back as ``offset`` to get only newer output."""
        result: dict[str, Any] = self._send(calls.logs(task_id, attempt, offset))
        return result

    # transactions

    def begin(self, *, tenant: str | None = None, ttl_s: float = 60.0) -> int:
        return int(self._send(calls.begin(tenant, ttl_s)))

    def commit(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.commit(transaction_id))
        return result

    def rollback(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.rollback(transaction_id))
        return result

    @contextmanager
    def transaction(
        self, *, tenant: str | None = None, ttl_s: float = 60.0
    ) -> Iterator[Transaction]:
        """Commit on normal exit, roll back if the block raises."""
        txn = Transaction(self, self.begin(tenant=tenant, ttl_s=ttl_s), tenant)
        try:
            yield txn
        except BaseException:
            # It may have expired already; the original error is what matters.
            with suppress(StewardError):
                self.rollback(txn.id)
            raise
        self.commit(txn.id)

    # code artifacts

    def upload_code(self, path: str | Path, *, name: str | None = None) -> str:
        """Upload a .py, .zip or .whl; returns its sha256 (use it as a task's ``code``)."""
        file = Path(path)
        request = calls.upload_code(name or file.name, file.read_bytes(), self._timeout_s)
        return str(self._send(request))

    def code(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._send(calls.code())
        return result

    def delete_code(self, sha256: str) -> dict[str, Any]:
        """Delete an artifact (yours, or any as an admin): ConflictError naming the tasks
        that still need it. A retry after a lost answer may say NotFoundError."""
        result: dict[str, Any] = self._send(calls.delete_code(sha256))
        return result

    # tenants and cluster

    def tenant(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.tenant(name))
        return result

    def tenants(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._send(calls.tenants())
        return result

    def set_tenant(self, name: str, **limits: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.set_tenant(name, limits))
        return result

    def cluster(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.cluster())
        return result

    def digest(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.digest())
        return result

    # API tokens (admin)

    def create_token(
        self,
        name: str,
        *,
        tenant: str | None = None,
        admin: bool = False,
        worker: bool = False,
        tenants: list[str] | None = None,
    ) -> dict[str, Any]:
        """Issue a token for ``tenant``, an admin one, or a worker credential (serving
        ``tenants`` only, when given); its secret is in ``["token"]``."""
        result: dict[str, Any] = self._send(
            calls.create_token(name, tenant, admin, worker, tenants)
        )
        return result

    def tokens(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._send(calls.tokens())
        return result

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.revoke_token(token_id))
        return result

    # Periodic-task schedules (docs/API.md, Periodic tasks)

    def create_schedule(
        self, name: str, task_type: str, params: Any = None, **options: Any
    ) -> dict[str, Any]:
        """Create a schedule running ``task_type`` at each tick of ``cron`` (UTC) or every
        ``interval_s`` (options: tenant, cron, interval_s, missed, grace_s, max_attempts, max_lost;
        docs/API.md). A retry after a lost answer may see 409 (it exists), never two."""
        result: dict[str, Any] = self._send(
            calls.create_schedule(name, task_type, params, **options)
        )
        return result

    def schedules(self, tenant: str | None = None) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._send(calls.schedules(tenant))
        return result

    def delete_schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.delete_schedule(name, tenant))
        return result

    def pause_schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        """Stop it firing until resumed; the schedule, ``paused`` true (docs/API.md)."""
        result: dict[str, Any] = self._send(calls.pause_schedule(name, tenant, paused=True))
        return result

    def resume_schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        """Fire it again; its ``missed`` policy handles the ticks passed while paused."""
        result: dict[str, Any] = self._send(calls.pause_schedule(name, tenant, paused=False))
        return result

    def schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        """One schedule (NotFoundError when the tenant has none of that name)."""
        result: dict[str, Any] = self._send(calls.schedule(name, tenant))
        return result

    # Per-tenant webhooks (docs/API.md, Webhooks)

    def set_webhook(self, tenant: str, url: str, secret: str) -> dict[str, Any]:
        """POST the tenant's completion events to ``url`` from now on, signed with
        HMAC-SHA256 under ``secret``; answers ``{"tenant", "url", "delivered"}``."""
        result: dict[str, Any] = self._send(calls.set_webhook(tenant, url, secret))
        return result

    def webhook(self, tenant: str) -> dict[str, Any]:
        """The tenant's webhook (never its secret); NotFoundError when it has none."""
        result: dict[str, Any] = self._send(calls.webhook(tenant))
        return result

    def delete_webhook(self, tenant: str) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.delete_webhook(tenant))
        return result

    def whoami(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.whoami())
        return result

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.health())
        return result


def _stream_lines(
    client: StewardClient,
    path: str,
    params: dict[str, Any],
    timeout_s: float,
    extra_headers: str = "",
    on_open: Callable[[], bool] | None = None,
) -> Iterator[bytes]:
    """The event streams' IO (``client``'s, kept out of its class for size): GET ``path``
    on a connection of its own, tried like a write (the leader once known, the next URL,
    backoff, for at most ``failover_timeout_s``); raise an error answer's error; yield the
    body line by line as it arrives (each ending in a newline). ``timeout_s`` bounds each wait for
    more bytes; ``extra_headers``: header lines (each ending in CRLF) besides the
    client's; ``on_open`` is called once the stream is open (and its events are
    subscribed), True ends it there. A stream that breaks raises StreamBrokenError."""
    call = _Call(client._router, write=True)
    target = request_target(path, params)
    while True:
        base = call.target()
        try:
            headers = client._headers + extra_headers
            stream = client._transport.stream(base, target, headers, timeout_s)
            head = stream.open()
        except TransportError as exc:
            pause_s = call.failed(base, exc)
        else:
            if head.status == 200:
                try:
                    done = on_open is not None and on_open()
                except BaseException:
                    stream.close()
                    raise
                if done:
                    stream.close()
                    return
                try:
                    for line in stream.lines():
                        yield line + b"\n"
                except TransportError as exc:
                    raise StreamBrokenError(base, describe(exc)) from exc
                return
            try:
                response = stream.rest()
            except TransportError as exc:
                raise StreamBrokenError(base, describe(exc)) from exc
            answer_pause_s = call.answered(base, response)
            if answer_pause_s is None:
                _raise_for(response)
                raise StreamBrokenError(base, f"HTTP {response.status}")
            pause_s = answer_pause_s
        if pause_s > 0:
            time.sleep(pause_s)
