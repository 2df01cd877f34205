"""The asyncio client: :class:`AsyncStewardClient`, its task handles and transactions."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager, suppress
from pathlib import Path
from typing import Any

import httpx

from broker.security.auth import bearer_headers
from clients.client.encoding import (
    _POLL_SLICE_S,
    FINAL_STATES,
    _list_query,
    _logs_query,
    _result_of,
    _task_body,
    _task_query,
    _tree_ended,
    _tree_result_of,
)
from clients.client.errors import StewardError, TaskTimeoutError, _error_for, _raise_for
from clients.client.routing import (
    DEFAULT_FAILOVER_TIMEOUT_S,
    _Call,
    _idempotency_headers,
    _Router,
    _timeout,
    _verify,
    parse_urls,
)


class AsyncTaskHandle:
    def __init__(self, client: AsyncStewardClient, task_id: int, state: str) -> None:
        self.client = client
        self.id = task_id
        self.submitted_state = state

    def __repr__(self) -> str:
        return f"AsyncTaskHandle(id={self.id})"

    # Same signature as the sync handle (``result(timeout)``), hence the noqa.
    async def wait(self, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = _POLL_SLICE_S if deadline is None else deadline - loop.time()
            task = await self.client.task(self.id, wait_s=max(0.0, min(_POLL_SLICE_S, remaining)))
            if task["state"] in FINAL_STATES:
                return task
            if deadline is not None and loop.time() >= deadline:
                raise TaskTimeoutError(self.id, timeout or 0.0)

    async def result(self, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        return _result_of(await self.wait(timeout))

    async def wait_tree(self, timeout: float | None = None) -> dict[str, Any]:  # noqa: ASYNC109
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        while True:
            remaining = _POLL_SLICE_S if deadline is None else deadline - loop.time()
            task = await self.client.task(
                self.id, wait_s=max(0.0, min(_POLL_SLICE_S, remaining)), wait_tree=True
            )
            if _tree_ended(task):
                return task
            if deadline is not None and loop.time() >= deadline:
                raise TaskTimeoutError(self.id, timeout or 0.0)

    async def tree_result(self, timeout: float | None = None) -> Any:  # noqa: ASYNC109
        return _tree_result_of(await self.wait_tree(timeout))

    async def cancel(self) -> dict[str, Any]:
        return await self.client.cancel(self.id)


class AsyncTransaction:
    def __init__(self, client: AsyncStewardClient, transaction_id: int, tenant: str | None) -> None:
        self.client = client
        self.id = transaction_id
        self.tenant = tenant
        self.handles: list[AsyncTaskHandle] = []

    async def submit(self, type: str, params: Any = None, **options: Any) -> AsyncTaskHandle:
        handle = await self.client.submit(
            type, params, tenant=self.tenant, transaction=self.id, **options
        )
        self.handles.append(handle)
        return handle


class AsyncStewardClient:
    """The asyncio twin of :class:`StewardClient` (same failover and retries)."""

    def __init__(
        self,
        url: str | Sequence[str] = "http://127.0.0.1:8080",
        *,
        timeout_s: float = 30.0,
        ca_file: str | Path | ssl.SSLContext | None = None,
        failover_timeout_s: float = DEFAULT_FAILOVER_TIMEOUT_S,
        token: str | None = None,
    ) -> None:
        self.urls = parse_urls(url)
        self.url = self.urls[0]
        self._timeout_s = timeout_s
        self._router = _Router(self.urls, failover_timeout_s)
        self._http = httpx.AsyncClient(
            timeout=_timeout(timeout_s),
            follow_redirects=False,
            headers=bearer_headers(token),
            verify=_verify(ca_file),
        )

    @property
    def leader_url(self) -> str | None:
        """The leader's base URL, once a follower named it."""
        return self._router.leader

    async def aclose(self) -> None:
        await self._http.aclose()

    async def __aenter__(self) -> AsyncStewardClient:
        return self

    async def __aexit__(self, *_: object) -> None:
        await self.aclose()

    async def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
        timeout_s: float | None = None,
        headers: dict[str, str] | None = None,
        leader: bool = False,
    ) -> Any:
        # leader: a read only the leader can answer (a follower redirects it, like a write).
        call = _Call(self._router, write=method != "GET" or leader)
        timeout = _timeout(timeout_s or self._timeout_s)
        while True:
            base = call.target()
            try:
                response = await self._http.request(
                    method,
                    base + path,
                    json=json,
                    params=params,
                    content=content,
                    headers=headers,
                    timeout=timeout,
                )
            except (httpx.HTTPError, httpx.InvalidURL) as exc:
                pause_s = call.failed(base, exc)
            else:
                answer_pause_s = call.answered(base, response)
                if answer_pause_s is None:
                    return _raise_for(response)
                pause_s = answer_pause_s
            if pause_s > 0:
                await asyncio.sleep(pause_s)

    async def submit(
        self,
        type: str,
        params: Any = None,
        *,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> AsyncTaskHandle:
        answer = await self._call(
            "POST",
            "/api/v1/tasks",
            json=_task_body(type, params, tenant, options),
            headers=_idempotency_headers(idempotency_key),
        )
        return AsyncTaskHandle(self, int(answer["id"]), str(answer["state"]))

    async def submit_many(
        self, tasks: list[dict[str, Any]], *, idempotency_key: str | None = None
    ) -> list[AsyncTaskHandle | StewardError]:
        answers = (
            await self._call(
                "POST",
                "/api/v1/tasks",
                json={"tasks": tasks},
                headers=_idempotency_headers(idempotency_key),
            )
        )["tasks"]
        return [
            AsyncTaskHandle(self, int(a["id"]), str(a["state"]))
            if "error" not in a
            else _error_for(409, a["error"]["code"], a["error"]["message"])
            for a in answers
        ]

    async def task(
        self, task_id: int, *, wait_s: float = 0.0, wait_tree: bool = False
    ) -> dict[str, Any]:
        params = _task_query(wait_s, wait_tree)
        result: dict[str, Any] = await self._call(
            "GET", f"/api/v1/tasks/{task_id}", params=params, timeout_s=wait_s + self._timeout_s
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
        query = _list_query(state, tenant, type, limit, after)
        result: dict[str, Any] = await self._call("GET", "/api/v1/tasks", params=query)
        return result

    async def cancel(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", f"/api/v1/tasks/{task_id}/cancel")
        return result

    async def logs(
        self, task_id: int, attempt: int | None = None, offset: int = 0
    ) -> dict[str, Any]:
        """As :meth:`StewardClient.logs`."""
        result: dict[str, Any] = await self._call(
            "GET", f"/api/v1/tasks/{task_id}/logs", params=_logs_query(attempt, offset), leader=True
        )
        return result

    async def begin(self, *, tenant: str | None = None, ttl_s: float = 60.0) -> int:
        body: dict[str, Any] = {"ttl_s": ttl_s}
        if tenant is not None:
            body["tenant"] = tenant
        answer = await self._call("POST", "/api/v1/transactions", json=body)
        return int(answer["id"])

    async def commit(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST", f"/api/v1/transactions/{transaction_id}/commit"
        )
        return result

    async def rollback(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = await self._call(
            "POST", f"/api/v1/transactions/{transaction_id}/rollback"
        )
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
        answer = await self._call(
            "POST",
            "/api/v1/code",
            params={"name": name or file.name},
            content=await asyncio.to_thread(file.read_bytes),
            timeout_s=max(self._timeout_s, 300.0),
        )
        return str(answer["sha256"])

    async def tenant(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", f"/api/v1/tenants/{name}")
        return result

    async def set_tenant(self, name: str, **limits: Any) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("PUT", f"/api/v1/tenants/{name}", json=limits)
        return result

    async def cluster(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/api/v1/cluster")
        return result

    async def digest(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/api/v1/state/digest")
        return result
