"""The asyncio client: :class:`AsyncStewardClient`, its task handles and transactions."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

from clients.client import api_calls as calls
from clients.client.api_calls import Request
from clients.client.async_producer import AsyncProducer
from clients.client.async_transport import AsyncTransport
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
from clients.client.transport import TransportError, describe, request_target


class AsyncTaskHandle(_Handle["AsyncStewardClient"]):
    async def _poll(self, wait_s: float | None, tree: bool) -> dict[str, Any]:
        waiting = _Waiting(self.id, wait_s, tree, asyncio.get_running_loop().time)
        while True:
            task = await self.client.task(self.id, wait_s=waiting.poll_s(), wait_tree=tree)
            if waiting.ended(task):
                return task

    # Same signature as the sync handle (``result(timeout)``), hence the noqa.
    async def wait(self, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        """As TaskHandle.wait: on the event stream, not by polling."""
        return (await self.client.wait_many([self.id], timeout))[self.id]

    async def result(self, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        return _result_of(await self.wait(timeout))

    async def wait_tree(self, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        """As TaskHandle.wait_tree: on the tree's event feed, not by polling."""
        waiting = _Waiting(self.id, timeout, True, asyncio.get_running_loop().time)
        root: list[dict[str, Any]] = []

        async def ended() -> bool:
            record = await self.client.task(self.id)
            if record.get("tree") is None:  # not a tracked root: the broker's 400 says so
                record = await self.client.task(self.id, wait_tree=True)
            root[:] = [record]
            return waiting.ended(record)

        while True:
            query, read_timeout_s = tree_stream(self.id, waiting.remaining_s())
            parser = SseParser()
            try:
                lines = self.client._stream_lines(EVENTS_PATH, query, read_timeout_s, on_open=ended)
                async for piece in lines:
                    if any(event.event == "task" for event in parser.feed(piece)) and await ended():
                        return root[0]
            except StreamBrokenError:
                await asyncio.sleep(BROKEN_PAUSE_S)
            except NotFoundError:  # a broker older than the feed
                return await self._poll(waiting.remaining_s(), tree=True)
            if root and waiting.ended(root[0]):
                return root[0]

    async def tree_result(self, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        return _tree_result_of(await self.wait_tree(timeout))

    async def cancel(self) -> dict[str, Any]:
        return await self.client.cancel(self.id)


class AsyncTransaction(_Transaction["AsyncStewardClient", AsyncTaskHandle]):
    async def submit(self, type: str, params: Any = None, **options: Any) -> AsyncTaskHandle:
        handle = await self.client.submit(
            type, params, tenant=self.tenant, transaction=self.id, **options
        )
        self.handles.append(handle)
        return handle


class AsyncStewardClient(_ClientBase):
    """The asyncio twin of :class:`StewardClient` (same failover and retries). Coroutines
    may share one client: each request takes an idle kept-alive connection to its broker
    or opens one."""

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
        self._transport = AsyncTransport(self._tls)

    async def aclose(self) -> None:
        self._transport.close()

    async def __aenter__(self) -> AsyncStewardClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _send(self, request: Request) -> Any:
        call = _Call(self._router, write=request.write)
        timeout_s = request.timeout_s or self._timeout_s
        method = request.method
        target, body, headers = request.wire(self._headers)
        while True:
            base = call.target()
            try:
                response = await self._transport.request(
                    base, method, target, body, headers, timeout_s
                )
            except TransportError as exc:
                pause_s = call.failed(base, exc)
            else:
                answer_pause_s = call.answered(base, response)
                if answer_pause_s is None:
                    return request.decode(_raise_for(response))
                pause_s = answer_pause_s
            if pause_s > 0:
                await asyncio.sleep(pause_s)

    async def _stream_lines(
        self,
        path: str,
        params: dict[str, Any],
        timeout_s: float,
        extra_headers: str = "",
        on_open: Callable[[], Awaitable[bool]] | None = None,
    ) -> AsyncIterator[bytes]:
        """As ``_stream_lines`` of clients/client/sync_client.py."""
        call = _Call(self._router, write=True)
        target = request_target(path, params)
        while True:
            base = call.target()
            try:
                headers = self._headers + extra_headers
                stream = await self._transport.stream(base, target, headers, timeout_s)
            except TransportError as exc:
                pause_s = call.failed(base, exc)
            else:
                if stream.parser.status == 200:
                    try:
                        done = on_open is not None and await on_open()
                    except BaseException:
                        stream.close()
                        raise
                    if done:
                        stream.close()
                        return
                    try:
                        async for line in stream.lines():
                            yield line + b"\n"
                    except TransportError as exc:
                        raise StreamBrokenError(base, describe(exc)) from exc
                    return
                try:
                    response = await stream.rest()
                except TransportError as exc:
                    raise StreamBrokenError(base, describe(exc)) from exc
                answer_pause_s = call.answered(base, response)
                if answer_pause_s is None:
                    _raise_for(response)
                    raise StreamBrokenError(base, f"HTTP {response.status}")
                pause_s = answer_pause_s
            if pause_s > 0:
                await asyncio.sleep(pause_s)

    async def events(
        self,
        *,
        tenant: str | None = None,
        tree: int | None = None,
        states: Iterable[str] | None = None,
        last_event_id: str | None = None,
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AsyncIterator[TaskEvent]:
        """As :meth:`StewardClient.events`."""
        now = asyncio.get_running_loop().time
        wait = FeedWait(feed_filters(tenant, tree, states), last_event_id, timeout, now)
        while not wait.over:
            query, header, read_timeout_s = wait.next_stream()
            parser = SseParser()
            seen = wait.last_event_id
            try:
                async for piece in self._stream_lines(EVENTS_PATH, query, read_timeout_s, header):
                    for event in parser.feed(piece):
                        found = wait.on_event(event)
                        if found is not None:
                            yield found
            except StreamBrokenError:
                await asyncio.sleep(BROKEN_PAUSE_S)
            else:
                if wait.last_event_id == seen:  # an empty stream: no busy loop of them
                    await asyncio.sleep(BROKEN_PAUSE_S)

    async def iter_finished(
        self,
        tasks: Iterable[Any],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> AsyncIterator[dict[str, Any]]:
        """As :meth:`StewardClient.iter_finished`."""
        wait = EventWait(task_ids_of(tasks), timeout, asyncio.get_running_loop().time)
        while not wait.done:
            query, read_timeout_s = wait.next_stream()
            parser = SseParser()
            seen = len(wait.finished)
            try:
                async for piece in self._stream_lines(EVENTS_PATH, query, read_timeout_s):
                    for event in parser.feed(piece):
                        record = wait.on_event(event)
                        if record is not None:
                            yield record
            except StreamBrokenError:
                await asyncio.sleep(BROKEN_PAUSE_S)
            else:
                if len(wait.finished) == seen:  # an empty stream: no busy loop of them
                    await asyncio.sleep(BROKEN_PAUSE_S)

    async def wait_many(
        self,
        tasks: Iterable[Any],
        timeout: float | None = None,  # noqa: ASYNC109
    ) -> dict[int, dict[str, Any]]:
        """As :meth:`StewardClient.wait_many`."""
        ids = task_ids_of(tasks)
        found = {int(record["id"]): record async for record in self.iter_finished(ids, timeout)}
        return {task_id: found[task_id] for task_id in ids}

    async def submit(
        self,
        type: str,
        params: Any = None,
        *,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> AsyncTaskHandle:
        answer = await self._send(calls.submit(type, params, tenant, idempotency_key, options))
        return AsyncTaskHandle(self, int(answer["id"]), str(answer["state"]))

    async def submit_many(
        self, tasks: list[dict[str, Any]], *, idempotency_key: str | None = None
    ) -> list[AsyncTaskHandle | StewardError]:
        answers = await self._send(calls.submit_many(tasks, idempotency_key))
        return calls.handles_or_errors(
            answers, lambda task_id, state: AsyncTaskHandle(self, task_id, state)
        )

    def producer(
        self,
        *,
        linger_ms: float = DEFAULT_LINGER_MS,
        max_batch: int = DEFAULT_MAX_BATCH,
        max_buffered: int = DEFAULT_MAX_BUFFERED,
        max_block_s: float = DEFAULT_MAX_BLOCK_S,
    ) -> AsyncProducer[AsyncTaskHandle]:
        """As :meth:`StewardClient.producer`: ``async with client.producer() as p``, then
        ``future = await p.submit(...)`` and ``handle = await future``."""
        return AsyncProducer(
            self._clone,
            lambda task_id, state: AsyncTaskHandle(self, task_id, state),
            linger_ms=linger_ms,
            max_batch=max_batch,
            max_buffered=max_buffered,
            max_block_s=max_block_s,
        )

    async def task(
        self, task_id: int, *, wait_s: float = 0.0, wait_tree: bool = False
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(
            calls.task(task_id, wait_s, wait_tree, self._timeout_s)
        )
        return result

    async def tasks(
        self,
        *,
        state: str | None = None,
        tenant: str | None = None,
        type: str | None = None,
        limit: int = 100,
        after: int = 0,
    ) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.tasks(state, tenant, type, limit, after))
        return result

    async def tree(self, root: int) -> dict[str, Any]:
        """A tracked tree's view: state, age, timeout, its tasks by state, pending anchors."""
        result: dict[str, Any] = await self._send(calls.tree(root))
        return result

    async def trees(
        self,
        *,
        state: str | None = None,
        tenant: str | None = None,
        limit: int = 100,
        after: int = 0,
    ) -> dict[str, Any]:
        """Tracked trees (state: pending, completed, failed or timed_out), lowest roots first."""
        result: dict[str, Any] = await self._send(calls.trees(state, tenant, limit, after))
        return result

    async def cancel(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.cancel(task_id))
        return result

    async def cancel_matching(
        self,
        *,
        tenant: str | None = None,
        type: str | None = None,
        state: str | None = None,
        tree: int | None = None,
        submitted_before: str | float | None = None,
        reason: str | None = None,
    ) -> dict[str, Any]:
        """As :meth:`StewardClient.cancel_matching` (bulk cancel by filter)."""
        filters = {
            "tenant": tenant,
            "type": type,
            "state": state,
            "tree": tree,
            "submitted_before": submitted_before,
            "reason": reason,
        }
        result: dict[str, Any] = await self._send(calls.cancel_matching(filters))
        return result

    async def logs(
        self, task_id: int, attempt: int | None = None, offset: int = 0
    ) -> dict[str, Any]:
        """As :meth:`StewardClient.logs`."""
        result: dict[str, Any] = await self._send(calls.logs(task_id, attempt, offset))
        return result

    async def begin(self, *, tenant: str | None = None, ttl_s: float = 60.0) -> int:
        return int(await self._send(calls.begin(tenant, ttl_s)))

    async def commit(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.commit(transaction_id))
        return result

    async def rollback(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.rollback(transaction_id))
        return result

    @asynccontextmanager
    async def transaction(
        self, *, tenant: str | None = None, ttl_s: float = 60.0
    ) -> AsyncIterator[AsyncTransaction]:
        txn = AsyncTransaction(self, await self.begin(tenant=tenant, ttl_s=ttl_s), tenant)
        try:
            yield txn
        except BaseException:
            with suppress(StewardError):
                await self.rollback(txn.id)
            raise
        await self.commit(txn.id)

    async def upload_code(self, path: str | Path, *, name: str | None = None) -> str:
        file = Path(path)
        content = await asyncio.to_thread(file.read_bytes)
        return str(await self._send(calls.upload_code(name or file.name, content, self._timeout_s)))

    async def code(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._send(calls.code())
        return result

    async def delete_code(self, sha256: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.delete_code(sha256))
        return result

    async def tenant(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.tenant(name))
        return result

    async def tenants(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._send(calls.tenants())
        return result

    async def set_tenant(self, name: str, **limits: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.set_tenant(name, limits))
        return result

    async def cluster(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.cluster())
        return result

    async def digest(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.digest())
        return result

    async def create_token(
        self,
        name: str,
        *,
        tenant: str | None = None,
        admin: bool = False,
        worker: bool = False,
        tenants: list[str] | None = None,
    ) -> dict[str, Any]:
        """As :meth:`StewardClient.create_token` (admin)."""
        result: dict[str, Any] = await self._send(
            calls.create_token(name, tenant, admin, worker, tenants)
        )
        return result

    async def tokens(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._send(calls.tokens())
        return result

    async def revoke_token(self, token_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.revoke_token(token_id))
        return result

    async def create_schedule(
        self, name: str, task_type: str, params: Any = None, **options: Any
    ) -> dict[str, Any]:
        """As :meth:`StewardClient.create_schedule` (periodic tasks, docs/API.md)."""
        result: dict[str, Any] = await self._send(
            calls.create_schedule(name, task_type, params, **options)
        )
        return result

    async def schedules(self, tenant: str | None = None) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = await self._send(calls.schedules(tenant))
        return result

    async def delete_schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.delete_schedule(name, tenant))
        return result

    async def pause_schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        """As :meth:`StewardClient.pause_schedule`."""
        result: dict[str, Any] = await self._send(calls.pause_schedule(name, tenant, paused=True))
        return result

    async def resume_schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        """As :meth:`StewardClient.resume_schedule`."""
        call = calls.pause_schedule(name, tenant, paused=False)
        result: dict[str, Any] = await self._send(call)
        return result

    async def schedule(self, name: str, *, tenant: str | None = None) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.schedule(name, tenant))
        return result

    async def set_webhook(self, tenant: str, url: str, secret: str) -> dict[str, Any]:
        """As :meth:`StewardClient.set_webhook` (webhooks, docs/API.md)."""
        result: dict[str, Any] = await self._send(calls.set_webhook(tenant, url, secret))
        return result

    async def webhook(self, tenant: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.webhook(tenant))
        return result

    async def delete_webhook(self, tenant: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.delete_webhook(tenant))
        return result

    async def whoami(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.whoami())
        return result

    async def health(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._send(calls.health())
        return result
