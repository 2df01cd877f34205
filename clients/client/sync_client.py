"""The synchronous client: :class:`StewardClient`, its task handles and transactions."""

from __future__ import annotations

import ssl
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import Any

from clients.client import api_calls as calls
from clients.client.api_calls import Request
from clients.client.encoding import _Handle, _result_of, _Transaction, _tree_result_of, _Waiting
from clients.client.errors import ConnectionFailedError, StewardError, _raise_for
from clients.client.routing import (
    DEFAULT_FAILOVER_TIMEOUT_S,
    _Call,
    _client_headers,
    _ClientBase,
    _verify,
)
from clients.client.transport import (
    LineStream,
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
        """Wait until the task is final; return its record (whatever the outcome)."""
        return self._poll(timeout, tree=False)

    def result(self, timeout: float | None = None) -> Any:
        """The task's result; raises TaskFailedError or TaskTimeoutError."""
        return _result_of(self.wait(timeout))

    def wait_tree(self, timeout: float | None = None) -> dict[str, Any]:
        """Wait until the tree this tracked root grew has ended (``completed``, or
        ``failed`` with no replay left); return the root's record (``["tree"]``)."""
        return self._poll(timeout, tree=True)

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
        super().__init__(url, timeout_s, failover_timeout_s)
        self._headers = _client_headers(token)
        self._transport = SyncTransport(_verify(ca_file))

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

    def _stream_lines(
        self, path: str, params: dict[str, Any] | None = None, timeout_s: float | None = None
    ) -> Iterator[bytes]:
        """GET ``path`` and yield its body line by line (without line ends, blank lines
        included) as it arrives, on a connection of its own; for streams such as server-sent
        events. ``timeout_s`` (default: the client's) bounds each wait for more bytes. Goes
        to the known leader, else the URLs in turn, each tried once; an error answer raises
        as any call's does."""
        call = _Call(self._router, write=False)
        target = request_target(path, params)
        while True:
            base = call.target()
            try:
                stream: LineStream = self._transport.stream(
                    base, target, self._headers, timeout_s or self._timeout_s
                )
                head = stream.open()
            except TransportError as exc:
                call.failed(base, exc)  # raises once every broker was tried
                continue
            break
        try:
            if head.status >= 300:
                _raise_for(stream.rest())
            yield from stream.lines()
        except TransportError as exc:
            raise ConnectionFailedError(base, describe(exc)) from exc

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
        ``idempotency_key`` (default: 128 new random bits per call)."""
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

    def cancel(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.cancel(task_id))
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

    def whoami(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.whoami())
        return result

    def health(self) -> dict[str, Any]:
        result: dict[str, Any] = self._send(calls.health())
        return result
