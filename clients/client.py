"""Python clients for a Steward broker's HTTP API: sync and asyncio.

    with StewardClient("http://127.0.0.1:8080") as steward:
        handle = steward.submit("spark.sql", {"query": "SELECT 1 AS x"}, tenant="acme")
        print(handle.result(timeout=60))          # the task's JSON result
        with steward.transaction(tenant="acme") as txn:
            txn.submit("noop")                    # all run, or none (rolled back on error)

Every error the API answers raises a :class:`StewardError` subclass.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any, Final

import httpx

FINAL_STATES: Final = frozenset({"finished", "error", "cancelled"})
_POLL_SLICE_S: Final = 30.0  # one long-poll request waits at most this long


class StewardError(Exception):
    """An error answered by the broker (``status`` 4xx/5xx, ``code``, ``message``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({code}, HTTP {status})" if status else message)
        self.status = status
        self.code = code
        self.message = message


class InvalidRequestError(StewardError):
    pass


class NotFoundError(StewardError):
    pass


class ConflictError(StewardError):
    """409: e.g. the slot is held by another live task, or the task is already final."""


class TenantQueueFullError(StewardError):
    pass


class UnavailableError(StewardError):
    """The broker cannot take the request now; retrying later may succeed."""


class ConnectionFailedError(StewardError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(0, "connection_failed", f"cannot reach {url}: {reason}")


class TaskFailedError(Exception):
    """The task ended in ``error`` or ``cancelled``; ``task`` holds its full record."""

    def __init__(self, task: dict[str, Any]) -> None:
        error = task.get("error") or task["state"]
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else task["state"]
        super().__init__(f"task {task['id']} {task['state']}: {first_line}")
        self.task = task


class TaskTimeoutError(TimeoutError):
    def __init__(self, task_id: int, timeout_s: float) -> None:
        super().__init__(f"task {task_id} not final after {timeout_s} s")
        self.task_id = task_id


def _error_for(status: int, code: str, message: str) -> StewardError:
    if status == 404:
        return NotFoundError(status, code, message)
    if status == 409:
        return ConflictError(status, code, message)
    if status == 429:
        return TenantQueueFullError(status, code, message)
    if status >= 500:
        return UnavailableError(status, code, message)
    return InvalidRequestError(status, code, message)


def _raise_for(response: httpx.Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = None
    if response.status_code >= 400:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            raise _error_for(
                response.status_code, str(detail.get("code")), str(detail.get("message"))
            )
        raise _error_for(response.status_code, "http_error", response.text[:200])
    return body


def _task_body(type: str, params: Any, tenant: str, options: dict[str, Any]) -> dict[str, Any]:
    body: dict[str, Any] = {"type": type, "tenant": tenant, "params": params}
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def _result_of(task: dict[str, Any]) -> Any:
    if task["state"] == "finished":
        return task.get("result")
    raise TaskFailedError(task)


def _list_query(
    state: str | None, tenant: str | None, type: str | None, limit: int, after: int
) -> dict[str, Any]:
    query: dict[str, Any] = {"limit": limit}
    for key, value in (("state", state), ("tenant", tenant), ("type", type)):
        if value is not None:
            query[key] = value
    if after:
        query["after"] = after
    return query


# --- synchronous -------------------------------------------------------------------------


class TaskHandle:
    """A submitted task. ``result()`` waits (long polling) and returns its JSON result."""

    def __init__(self, client: StewardClient, task_id: int, state: str) -> None:
        self.client = client
        self.id = task_id
        self.submitted_state = state

    def __repr__(self) -> str:
        return f"TaskHandle(id={self.id})"

    def info(self) -> dict[str, Any]:
        return self.client.task(self.id)

    def wait(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the task is final; return its record (whatever the outcome)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = _POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            task = self.client.task(self.id, wait_s=max(0.0, min(_POLL_SLICE_S, remaining)))
            if task["state"] in FINAL_STATES:
                return task
            if deadline is not None and time.monotonic() >= deadline:
                raise TaskTimeoutError(self.id, timeout or 0.0)

    def result(self, timeout: float | None = None) -> Any:
        """The task's result; raises TaskFailedError or TaskTimeoutError."""
        return _result_of(self.wait(timeout))

    def cancel(self) -> dict[str, Any]:
        return self.client.cancel(self.id)


class Transaction:
    def __init__(self, client: StewardClient, transaction_id: int, tenant: str) -> None:
        self.client = client
        self.id = transaction_id
        self.tenant = tenant
        self.handles: list[TaskHandle] = []

    def submit(self, type: str, params: Any = None, **options: Any) -> TaskHandle:
        handle = self.client.submit(
            type, params, tenant=self.tenant, transaction=self.id, **options
        )
        self.handles.append(handle)
        return handle


class StewardClient:
    def __init__(self, url: str = "http://127.0.0.1:8080", *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._http = httpx.Client(base_url=self.url, timeout=timeout_s)

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> StewardClient:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    def _call(
        self,
        method: str,
        path: str,
        *,
        json: Any = None,
        params: dict[str, Any] | None = None,
        content: bytes | None = None,
        timeout_s: float | None = None,
    ) -> Any:
        try:
            response = self._http.request(
                method,
                path,
                json=json,
                params=params,
                content=content,
                timeout=timeout_s or self._timeout_s,
            )
        except httpx.HTTPError as exc:
            raise ConnectionFailedError(self.url, str(exc) or type(exc).__name__) from exc
        return _raise_for(response)

    # tasks

    def submit(
        self, type: str, params: Any = None, *, tenant: str = "default", **options: Any
    ) -> TaskHandle:
        """Submit one task. Options: slot, max_attempts, deadline, start_after,
        resources, transaction, code."""
        answer = self._call("POST", "/api/v1/tasks", json=_task_body(type, params, tenant, options))
        return TaskHandle(self, int(answer["id"]), str(answer["state"]))

    def submit_many(self, tasks: list[dict[str, Any]]) -> list[TaskHandle | StewardError]:
        """Submit a batch in one log entry; a handle or the refusal for each task."""
        answers = self._call("POST", "/api/v1/tasks", json={"tasks": tasks})["tasks"]
        return [
            TaskHandle(self, int(a["id"]), str(a["state"]))
            if "error" not in a
            else _error_for(409, a["error"]["code"], a["error"]["message"])
            for a in answers
        ]

    def task(self, task_id: int, *, wait_s: float = 0.0) -> dict[str, Any]:
        params = {"wait_s": f"{wait_s:.3f}"} if wait_s > 0 else None
        result: dict[str, Any] = self._call(
            "GET", f"/api/v1/tasks/{task_id}", params=params, timeout_s=wait_s + self._timeout_s
        )
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
        query = _list_query(state, tenant, type, limit, after)
        result: dict[str, Any] = self._call("GET", "/api/v1/tasks", params=query)
        return result

    def cancel(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/api/v1/tasks/{task_id}/cancel")
        return result

    # transactions

    def begin(self, *, tenant: str = "default", ttl_s: float = 60.0) -> int:
        body = {"tenant": tenant, "ttl_s": ttl_s}
        return int(self._call("POST", "/api/v1/transactions", json=body)["id"])

    def commit(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/api/v1/transactions/{transaction_id}/commit")
        return result

    def rollback(self, transaction_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call(
            "POST", f"/api/v1/transactions/{transaction_id}/rollback"
        )
        return result

    @contextmanager
    def transaction(self, *, tenant: str = "default", ttl_s: float = 60.0) -> Iterator[Transaction]:
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
        answer = self._call(
            "POST",
            "/api/v1/code",
            params={"name": name or file.name},
            content=file.read_bytes(),
            timeout_s=max(self._timeout_s, 300.0),
        )
        return str(answer["sha256"])

    def code(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/api/v1/code")["artifacts"]
        return result

    # tenants and cluster

    def tenant(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/api/v1/tenants/{name}")
        return result

    def tenants(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/api/v1/tenants")["tenants"]
        return result

    def set_tenant(self, name: str, **limits: Any) -> dict[str, Any]:
        result: dict[str, Any] = self._call("PUT", f"/api/v1/tenants/{name}", json=limits)
        return result

    def cluster(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/api/v1/cluster")
        return result

    def digest(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/api/v1/state/digest")
        return result

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result


# --- asyncio -----------------------------------------------------------------------------


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

    async def cancel(self) -> dict[str, Any]:
        return await self.client.cancel(self.id)


class AsyncTransaction:
    def __init__(self, client: AsyncStewardClient, transaction_id: int, tenant: str) -> None:
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
    def __init__(self, url: str = "http://127.0.0.1:8080", *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
        self._timeout_s = timeout_s
        self._http = httpx.AsyncClient(base_url=self.url, timeout=timeout_s)

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
    ) -> Any:
        try:
            response = await self._http.request(
                method,
                path,
                json=json,
                params=params,
                content=content,
                timeout=timeout_s or self._timeout_s,
            )
        except httpx.HTTPError as exc:
            raise ConnectionFailedError(self.url, str(exc) or type(exc).__name__) from exc
        return _raise_for(response)

    async def submit(
        self, type: str, params: Any = None, *, tenant: str = "default", **options: Any
    ) -> AsyncTaskHandle:
        answer = await self._call(
            "POST", "/api/v1/tasks", json=_task_body(type, params, tenant, options)
        )
        return AsyncTaskHandle(self, int(answer["id"]), str(answer["state"]))

    async def submit_many(
        self, tasks: list[dict[str, Any]]
    ) -> list[AsyncTaskHandle | StewardError]:
        answers = (await self._call("POST", "/api/v1/tasks", json={"tasks": tasks}))["tasks"]
        return [
            AsyncTaskHandle(self, int(a["id"]), str(a["state"]))
            if "error" not in a
            else _error_for(409, a["error"]["code"], a["error"]["message"])
            for a in answers
        ]

    async def task(self, task_id: int, *, wait_s: float = 0.0) -> dict[str, Any]:
        params = {"wait_s": f"{wait_s:.3f}"} if wait_s > 0 else None
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

    async def begin(self, *, tenant: str = "default", ttl_s: float = 60.0) -> int:
        answer = await self._call(
            "POST", "/api/v1/transactions", json={"tenant": tenant, "ttl_s": ttl_s}
        )
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
        self, *, tenant: str = "default", ttl_s: float = 60.0
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
