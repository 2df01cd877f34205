"""The synchronous client: :class:`StewardClient`, its task handles and transactions."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
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

    def wait_tree(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the tree this tracked root grew has ended (``completed``, or
        ``failed`` with no replay left); return the root's record (``["tree"]``)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            remaining = _POLL_SLICE_S if deadline is None else deadline - time.monotonic()
            task = self.client.task(
                self.id, wait_s=max(0.0, min(_POLL_SLICE_S, remaining)), wait_tree=True
            )
            if _tree_ended(task):
                return task
            if deadline is not None and time.monotonic() >= deadline:
                raise TaskTimeoutError(self.id, timeout or 0.0)

    def tree_result(self, timeout: float | None = None) -> Any:
        """The root's result once its whole tree completed; raises TreeFailedError,
        TaskTimeoutError, or InvalidRequestError for a task submitted without
        ``track_tree=True``."""
        return _tree_result_of(self.wait_tree(timeout))

    def cancel(self) -> dict[str, Any]:
        return self.client.cancel(self.id)


class Transaction:
    def __init__(self, client: StewardClient, transaction_id: int, tenant: str | None) -> None:
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
    """A broker's (or a cluster's) API; see the module docstring on failover and retries.

    ``url``: one base URL, several (a sequence or a comma-separated string).
    ``timeout_s``: per request; ``failover_timeout_s``: how long a write keeps
    trying other brokers (or waiting for a leader) before FailoverTimeoutError.
    ``token``: the API token sent as ``Authorization: Bearer`` (brokers with
    authentication on answer 401 without one).
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
        self.urls = parse_urls(url)
        self.url = self.urls[0]
        self._timeout_s = timeout_s
        self._router = _Router(self.urls, failover_timeout_s)
        # Redirects are followed by hand: only not_leader ones, and the leader is remembered.
        self._http = httpx.Client(
            timeout=_timeout(timeout_s),
            follow_redirects=False,
            headers=bearer_headers(token),
            verify=_verify(ca_file),
        )

    @property
    def leader_url(self) -> str | None:
        """The leader's base URL, once a follower named it."""
        return self._router.leader

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
        headers: dict[str, str] | None = None,
        leader: bool = False,
    ) -> Any:
        # leader: a read only the leader can answer (a follower redirects it, like a write).
        call = _Call(self._router, write=method != "GET" or leader)
        timeout = _timeout(timeout_s or self._timeout_s)
        while True:
            base = call.target()
            try:
                response = self._http.request(
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
                time.sleep(pause_s)

    # tasks

    def submit(
        self,
        type: str,
        params: Any = None,
        *,
        tenant: str | None = None,
        idempotency_key: str | None = None,
        **options: Any,
    ) -> TaskHandle:
        """Submit one task. Options: slot, max_attempts, deadline, start_after,
        resources, transaction, code, track_tree, tree_timeout_s. Retried safely under
        ``idempotency_key`` (default: a new uuid4 per call)."""
        answer = self._call(
            "POST",
            "/api/v1/tasks",
            json=_task_body(type, params, tenant, options),
            headers=_idempotency_headers(idempotency_key),
        )
        return TaskHandle(self, int(answer["id"]), str(answer["state"]))

    def submit_many(
        self, tasks: list[dict[str, Any]], *, idempotency_key: str | None = None
    ) -> list[TaskHandle | StewardError]:
        """Submit a batch in one log entry; a handle or the refusal for each task."""
        answers = self._call(
            "POST",
            "/api/v1/tasks",
            json={"tasks": tasks},
            headers=_idempotency_headers(idempotency_key),
        )["tasks"]
        return [
            TaskHandle(self, int(a["id"]), str(a["state"]))
            if "error" not in a
            else _error_for(409, a["error"]["code"], a["error"]["message"])
            for a in answers
        ]

    def task(self, task_id: int, *, wait_s: float = 0.0, wait_tree: bool = False) -> dict[str, Any]:
        """A task's record; ``wait_s``: long poll until it is final (``wait_tree``: until
        the tree it roots has ended)."""
        params = _task_query(wait_s, wait_tree)
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

    def logs(self, task_id: int, attempt: int | None = None, offset: int = 0) -> dict[str, Any]:
        """An attempt's captured output (default: the latest attempt) from byte ``offset``:
        ``{task_id, attempt, output, truncated, complete, next_offset, offset, available}``.
        Pass ``next_offset`` back as ``offset`` to get only newer output."""
        result: dict[str, Any] = self._call(
            "GET", f"/api/v1/tasks/{task_id}/logs", params=_logs_query(attempt, offset), leader=True
        )
        return result

    # transactions

    def begin(self, *, tenant: str | None = None, ttl_s: float = 60.0) -> int:
        body: dict[str, Any] = {"ttl_s": ttl_s}
        if tenant is not None:
            body["tenant"] = tenant
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
        if (tenant is not None) + admin + worker != 1:
            raise ValueError("give one of a tenant, admin=True or worker=True")
        if tenants is not None and not worker:
            raise ValueError("tenants= goes with worker=True only")
        role = "admin" if admin else "worker" if worker else "tenant"
        body: dict[str, Any] = {"name": name, "role": role, "tenant": tenant}
        if tenants:
            body["tenants"] = tenants
        result: dict[str, Any] = self._call("POST", "/api/v1/tokens", json=body)
        return result

    def tokens(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self._call("GET", "/api/v1/tokens")["tokens"]
        return result

    def revoke_token(self, token_id: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("DELETE", f"/api/v1/tokens/{token_id}")
        return result

    def whoami(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/api/v1/whoami")
        return result

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", "/healthz")
        return result
