"""Python clients for a Steward broker's HTTP API: sync and asyncio.

    with StewardClient("http://b1:8080,http://b2:8080,http://b3:8080") as steward:
        handle = steward.submit("spark.sql", {"query": "SELECT 1 AS x"}, tenant="acme")
        print(handle.result(timeout=60))          # the task's JSON result
        with steward.transaction(tenant="acme") as txn:
            txn.submit("noop")                    # all run, or none (rolled back on error)

Every error the API answers raises a :class:`StewardError` subclass.

TLS. ``https://`` URLs are always verified, host name included: against
``ca_file`` (a PEM CA bundle, or an ``ssl.SSLContext``) or else the system trust
store; a certificate that does not verify raises :class:`CertificateVerifyError`
at once (no failover retries).

Failover. Give one broker URL or several (a sequence, or one comma-separated
string). Writes (POST, PUT, DELETE) go to the leader: a follower's ``307
not_leader`` answer is followed to the leader it names, which is remembered for
later calls. On a retryable 503 (no leader yet, taking over, deposed), a
connection error or a timeout, a write is sent again, to the known leader or the
next URL, with backoff, for at most ``failover_timeout_s`` (default 30 s); then
:class:`FailoverTimeoutError`. Reads go to the known leader (so a task just
submitted is found), else to the URLs in turn, each tried once on connection
errors. Other errors (4xx) are raised at once.

A write retried after a lost answer may have been applied the first time:

- ``submit`` / ``submit_many``: safe. Each call sends one idempotency key (a
  uuid4, or the caller's ``idempotency_key``) on every try; the broker answers a
  repeated key with the first result (same ids) instead of creating tasks again.
- ``cancel``: safe, cancelling is idempotent (a retry after the cancel was
  applied may answer 409 ``ConflictError``: the task is already cancelled).
- ``set_tenant``, ``upload_code``: safe (same values; artifacts are content-addressed).
- ``begin`` (and ``transaction()``): a retry may open a second transaction; the
  one whose answer was lost stays empty and expires after its TTL.
- ``commit`` / ``rollback``: a retry after the first one was applied answers 404
  ``NotFoundError`` (the transaction is no longer open); check its tasks' states.
"""

from __future__ import annotations

import asyncio
import random
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager, suppress
from pathlib import Path
from typing import Any, Final

import httpx

from broker.security.auth import bearer_headers
from broker.security.tls import certificate_error, client_context, describe_certificate_error

FINAL_STATES: Final = frozenset({"finished", "error", "cancelled"})
_POLL_SLICE_S: Final = 30.0  # one long-poll request waits at most this long
DEFAULT_FAILOVER_TIMEOUT_S: Final = 30.0
# A dead broker that drops packets must not use up the whole failover time.
_CONNECT_TIMEOUT_S: Final = 5.0
_BACKOFF_MIN_S: Final = 0.1
_BACKOFF_MAX_S: Final = 2.0


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


class AuthenticationError(StewardError):
    """401: no API token, or one the brokers do not know (revoked, mistyped)."""


class PermissionDeniedError(StewardError):
    """403: the token's role or tenant may not do this."""


class ConnectionFailedError(StewardError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(0, "connection_failed", f"cannot reach {url}: {reason}")


class CertificateVerifyError(ConnectionFailedError):
    """An https:// broker's certificate did not verify (unknown CA, wrong host name,
    expired): retrying does not help; give the right CA bundle (``ca_file``)."""

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(url, reason)
        self.code = "certificate_verify_failed"


class FailoverTimeoutError(UnavailableError):
    """No broker took a write within ``failover_timeout_s``; ``last_error`` says why."""

    def __init__(self, last_error: StewardError, elapsed_s: float, attempts: int) -> None:
        super().__init__(
            last_error.status,
            "failover_timeout",
            f"no broker took the request within {elapsed_s:.1f} s ({attempts} attempts); "
            f"last error: {last_error}",
        )
        self.last_error = last_error


class TaskFailedError(Exception):
    """The task ended in ``error`` or ``cancelled``; ``task`` holds its full record."""

    def __init__(self, task: dict[str, Any]) -> None:
        error = task.get("error") or task["state"]
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else task["state"]
        super().__init__(f"task {task['id']} {task['state']}: {first_line}")
        self.task = task


class TreeFailedError(Exception):
    """A tracked root's tree failed for good (no replay left); ``task`` holds the root's
    record, with ``task["tree"]["reason"]``."""

    def __init__(self, task: dict[str, Any]) -> None:
        reason = (task.get("tree") or {}).get("reason") or "failed"
        super().__init__(f"tree of task {task['id']} failed: {reason}")
        self.task = task


class TaskTimeoutError(TimeoutError):
    def __init__(self, task_id: int, timeout_s: float) -> None:
        super().__init__(f"task {task_id} not final after {timeout_s} s")
        self.task_id = task_id


def _error_for(status: int, code: str, message: str) -> StewardError:
    if status == 401:
        return AuthenticationError(status, code, message)
    if status == 403:
        return PermissionDeniedError(status, code, message)
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
    # 3xx too: a redirect the client did not follow is no answer to use.
    if response.status_code >= 300:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            raise _error_for(
                response.status_code, str(detail.get("code")), str(detail.get("message"))
            )
        raise _error_for(response.status_code, "http_error", response.text[:200])
    return body


def _error_detail(response: httpx.Response) -> dict[str, Any]:
    """The ``error`` object of an error answer ({} when there is none)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    detail = body.get("error") if isinstance(body, dict) else None
    return detail if isinstance(detail, dict) else {}


def parse_urls(url: str | Sequence[str]) -> list[str]:
    """Broker base URLs from one URL, a comma-separated list, or a sequence of either."""
    parts = url.split(",") if isinstance(url, str) else [p for u in url for p in u.split(",")]
    urls = list(dict.fromkeys(p.strip().rstrip("/") for p in parts if p.strip()))
    if not urls:
        raise ValueError("no broker URL given")
    return urls


def _timeout(timeout_s: float) -> httpx.Timeout:
    return httpx.Timeout(timeout_s, connect=min(timeout_s, _CONNECT_TIMEOUT_S))


def _idempotency_headers(key: str | None) -> dict[str, str]:
    # One key per call, sent on every try: the broker creates the tasks once.
    return {"Idempotency-Key": key if key is not None else uuid.uuid4().hex}


def _verify(ca_file: str | Path | ssl.SSLContext | None) -> ssl.SSLContext:
    """https:// brokers are always verified (host name included): against ``ca_file``
    (a PEM bundle, or a ready context) or else the system trust store."""
    if isinstance(ca_file, ssl.SSLContext):
        return ca_file
    return client_context(ca_file)


class _Router:
    """Which broker gets the next request: the leader once known, else the URLs in
    turn. Shared by the sync and async clients (no IO here)."""

    def __init__(self, urls: list[str], failover_timeout_s: float) -> None:
        self.urls = urls
        self.failover_timeout_s = failover_timeout_s
        self.leader: str | None = None
        self._index = 0

    def target(self) -> str:
        return self.leader or self.urls[self._index]

    def failed(self, base: str) -> None:
        """``base`` could not take the request: forget it as leader, go on to the next URL."""
        if base == self.leader:
            self.leader = None
        if base == self.urls[self._index]:
            self._index = (self._index + 1) % len(self.urls)


class _Call:
    """The tries of one request: what to do after each answer or transport error.

    Writes try until ``failover_timeout_s`` is over; reads try each broker once.
    Both return the pause before the next try, or raise when giving up.
    """

    def __init__(self, router: _Router, write: bool) -> None:
        self.router = router
        self.write = write
        self.started = time.monotonic()
        self.deadline = self.started + router.failover_timeout_s
        self.attempts = 0
        self.tried: set[str] = set()
        self.since_pause: set[str] = set()  # brokers tried since the last backoff
        self.redirects = 0
        self.backoff_s = _BACKOFF_MIN_S

    def target(self) -> str:
        base = self.router.target()
        self.attempts += 1
        self.tried.add(base)
        self.since_pause.add(base)
        return base

    def failed(self, base: str, exc: Exception) -> float:
        error = ConnectionFailedError(base, str(exc) or type(exc).__name__)
        if isinstance(exc, httpx.UnsupportedProtocol | httpx.InvalidURL):
            raise error from exc  # a malformed URL does not get better
        cert_error = certificate_error(exc)
        if cert_error is not None:  # nor does a certificate we do not trust
            raise CertificateVerifyError(base, describe_certificate_error(cert_error)) from exc
        self.router.failed(base)
        if not self.write:
            if self.router.target() in self.tried:
                raise error from exc
            return 0.0
        return self._pause(error)

    def answered(self, base: str, response: httpx.Response) -> float | None:
        """None: this response is the answer (success or an error to raise)."""
        status = response.status_code
        if not self.write or (status < 300 and status != 503):
            return None
        detail = _error_detail(response)
        code = str(detail.get("code", "http_error"))
        leader_url = detail.get("leader_url")
        if 300 <= status < 400 and code == "not_leader" and isinstance(leader_url, str):
            leader = leader_url.rstrip("/")
            # Brokers with stale views could send us back and forth: pause now and then.
            self.redirects += 1
            if leader != base and self.redirects <= len(self.router.urls) + 1:
                self.router.leader = leader
                if time.monotonic() < self.deadline:
                    return 0.0
        elif not (status == 503 or detail.get("retryable") is True or code == "not_leader"):
            return None
        error = UnavailableError(status, code, str(detail.get("message", response.reason_phrase)))
        self.router.failed(base)
        return self._pause(error)

    def _pause(self, error: StewardError) -> float:
        now = time.monotonic()
        if now >= self.deadline:
            raise FailoverTimeoutError(error, now - self.started, self.attempts) from error
        if self.router.target() not in self.since_pause:
            return 0.0  # a broker not tried yet this round: at once
        pause_s = min(random.uniform(self.backoff_s / 2, self.backoff_s), self.deadline - now)
        self.backoff_s = min(self.backoff_s * 2, _BACKOFF_MAX_S)
        self.since_pause.clear()
        self.redirects = 0
        return pause_s


def _task_body(
    type: str, params: Any, tenant: str | None, options: dict[str, Any]
) -> dict[str, Any]:
    # No tenant: the broker uses the token's tenant (or "default" without authentication).
    body: dict[str, Any] = {"type": type, "params": params}
    if tenant is not None:
        body["tenant"] = tenant
    body.update({k: v for k, v in options.items() if v is not None})
    return body


def _result_of(task: dict[str, Any]) -> Any:
    if task["state"] == "finished":
        return task.get("result")
    raise TaskFailedError(task)


def _tree_ended(task: dict[str, Any]) -> bool:
    tree = task.get("tree")
    return tree is not None and tree["state"] != "pending"


def _tree_result_of(task: dict[str, Any]) -> Any:
    if task["tree"]["state"] == "completed":
        return task.get("result")
    raise TreeFailedError(task)


def _task_query(wait_s: float, wait_tree: bool) -> dict[str, str] | None:
    params = {"wait_s": f"{wait_s:.3f}"} if wait_s > 0 else {}
    if wait_tree:
        params["wait_tree"] = "true"
    return params or None


def _logs_query(attempt: int | None, offset: int) -> dict[str, str]:
    query = {"offset": str(offset)} if offset else {}
    if attempt is not None:
        query["attempt"] = str(attempt)
    return query


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
