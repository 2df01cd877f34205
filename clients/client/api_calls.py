"""The API calls both clients make, as values: :class:`Request` says what to send and which
part of the answer to return; the functions below build one per endpoint. The sync and the
async client differ only in how they send it (no IO here)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

import msgspec

from clients.client.encoding import _list_query, _logs_query, _task_body, _task_query
from clients.client.errors import StewardError, _error_for
from clients.client.routing import _idempotency_header
from clients.client.transport import request_target

H = TypeVar("H")
_JSON_HEADER: Final = "Content-Type: application/json\r\n"
_encode_json = msgspec.json.Encoder().encode


@dataclass(frozen=True, slots=True)
class Request:
    method: str
    path: str
    json: Any = None
    params: dict[str, Any] | None = None
    content: bytes | None = None
    headers: str = ""  # header lines (each ending in CRLF) of this call only
    timeout_s: float | None = None  # None: the client's own timeout
    leader: bool = False  # a read only the leader can answer (a follower redirects it)
    field: str | None = None  # return this field of the answer instead of all of it

    @property
    def write(self) -> bool:
        """Whether it follows the leader and retries like a write."""
        return self.method != "GET" or self.leader

    def wire(self, client_headers: str) -> tuple[str, bytes | None, str]:
        """What every try sends: the request target, the body, the header lines."""
        target = request_target(self.path, self.params)
        if self.json is not None:
            return target, _encode_json(self.json), client_headers + _JSON_HEADER + self.headers
        return target, self.content, client_headers + self.headers

    def decode(self, answer: Any) -> Any:
        return answer if self.field is None else answer[self.field]


def handles_or_errors(
    answers: list[dict[str, Any]], handle: Callable[[int, str], H]
) -> list[H | StewardError]:
    """A batch submission's answer: a handle or the refusal for each task."""
    return [
        handle(int(a["id"]), str(a["state"]))
        if "error" not in a
        else _error_for(409, a["error"]["code"], a["error"]["message"])
        for a in answers
    ]


def submit(
    type: str,
    params: Any,
    tenant: str | None,
    idempotency_key: str | None,
    options: dict[str, Any],
) -> Request:
    return Request(
        "POST",
        "/api/v1/tasks",
        json=_task_body(type, params, tenant, options),
        headers=_idempotency_header(idempotency_key),
    )


def submit_many(tasks: list[dict[str, Any]], idempotency_key: str | None) -> Request:
    return Request(
        "POST",
        "/api/v1/tasks",
        json={"tasks": tasks},
        headers=_idempotency_header(idempotency_key),
        field="tasks",
    )


def task(task_id: int, wait_s: float, wait_tree: bool, client_timeout_s: float) -> Request:
    # A long poll may take wait_s longer than any other request.
    return Request(
        "GET",
        f"/api/v1/tasks/{task_id}",
        params=_task_query(wait_s, wait_tree),
        timeout_s=wait_s + client_timeout_s,
    )


def tasks(
    state: str | None, tenant: str | None, type: str | None, limit: int, after: int
) -> Request:
    return Request("GET", "/api/v1/tasks", params=_list_query(state, tenant, type, limit, after))


def tree(root: int) -> Request:
    return Request("GET", f"/api/v1/trees/{root}")


def trees(state: str | None, tenant: str | None, limit: int, after: int) -> Request:
    params: dict[str, Any] = {"limit": limit, "after": after}
    if state is not None:
        params["state"] = state
    if tenant is not None:
        params["tenant"] = tenant
    return Request("GET", "/api/v1/trees", params=params)


def cancel(task_id: int) -> Request:
    return Request("POST", f"/api/v1/tasks/{task_id}/cancel")


def cancel_matching(filters: dict[str, Any]) -> Request:
    """POST /api/v1/tasks/cancel with the filters given (None values left out)."""
    body = {name: value for name, value in filters.items() if value is not None}
    return Request("POST", "/api/v1/tasks/cancel", json=body)


def logs(task_id: int, attempt: int | None, offset: int) -> Request:
    return Request(
        "GET", f"/api/v1/tasks/{task_id}/logs", params=_logs_query(attempt, offset), leader=True
    )


def begin(tenant: str | None, ttl_s: float) -> Request:
    body: dict[str, Any] = {"ttl_s": ttl_s}
    if tenant is not None:
        body["tenant"] = tenant
    return Request("POST", "/api/v1/transactions", json=body, field="id")


def commit(transaction_id: int) -> Request:
    return Request("POST", f"/api/v1/transactions/{transaction_id}/commit")


def rollback(transaction_id: int) -> Request:
    return Request("POST", f"/api/v1/transactions/{transaction_id}/rollback")


def upload_code(name: str, content: bytes, client_timeout_s: float) -> Request:
    return Request(
        "POST",
        "/api/v1/code",
        params={"name": name},
        content=content,
        timeout_s=max(client_timeout_s, 300.0),
        field="sha256",
    )


def code() -> Request:
    return Request("GET", "/api/v1/code", field="artifacts")


def delete_code(sha256: str) -> Request:
    return Request("DELETE", f"/api/v1/code/{sha256}")


def tenant(name: str) -> Request:
    return Request("GET", f"/api/v1/tenants/{name}")


def tenants() -> Request:
    return Request("GET", "/api/v1/tenants", field="tenants")


def set_tenant(name: str, limits: dict[str, Any]) -> Request:
    return Request("PUT", f"/api/v1/tenants/{name}", json=limits)


def cluster() -> Request:
    return Request("GET", "/api/v1/cluster")


def digest() -> Request:
    return Request("GET", "/api/v1/state/digest")


def create_token(
    name: str, tenant: str | None, admin: bool, worker: bool, tenants: list[str] | None
) -> Request:
    if (tenant is not None) + admin + worker != 1:
        raise ValueError("give one of a tenant, admin=True or worker=True")
    if tenants is not None and not worker:
        raise ValueError("tenants= goes with worker=True only")
    role = "admin" if admin else "worker" if worker else "tenant"
    body: dict[str, Any] = {"name": name, "role": role, "tenant": tenant}
    if tenants:
        body["tenants"] = tenants
    return Request("POST", "/api/v1/tokens", json=body)


def tokens() -> Request:
    return Request("GET", "/api/v1/tokens", field="tokens")


def revoke_token(token_id: str) -> Request:
    return Request("DELETE", f"/api/v1/tokens/{token_id}")


def create_schedule(
    name: str,
    task_type: str,
    params: Any = None,
    *,
    tenant: str | None = None,
    cron: str | None = None,
    interval_s: float | None = None,
    missed: str = "skip",
    grace_s: float | None = None,
    max_attempts: int = 1,
    max_lost: int | None = None,
) -> Request:
    task: dict[str, Any] = {"type": task_type, "params": params, "max_attempts": max_attempts}
    if max_lost is not None:  # None: the broker's default
        task["max_lost"] = max_lost
    body: dict[str, Any] = {"name": name, "task": task, "missed": missed}
    optional = {"tenant": tenant, "cron": cron, "interval_s": interval_s, "grace_s": grace_s}
    body.update({k: v for k, v in optional.items() if v is not None})
    return Request("POST", "/api/v1/schedules", json=body)


def schedules(tenant: str | None) -> Request:
    query = {"tenant": tenant} if tenant is not None else None
    return Request("GET", "/api/v1/schedules", params=query, field="schedules")


def schedule(name: str, tenant: str | None) -> Request:
    query = {"tenant": tenant} if tenant is not None else None
    return Request("GET", f"/api/v1/schedules/{name}", params=query)


def set_webhook(tenant: str, url: str, secret: str) -> Request:
    return Request("PUT", f"/api/v1/tenants/{tenant}/webhook", json={"url": url, "secret": secret})


def webhook(tenant: str) -> Request:
    return Request("GET", f"/api/v1/tenants/{tenant}/webhook")


def delete_webhook(tenant: str) -> Request:
    return Request("DELETE", f"/api/v1/tenants/{tenant}/webhook")


def delete_schedule(name: str, tenant: str | None) -> Request:
    query = {"tenant": tenant} if tenant is not None else None
    return Request("DELETE", f"/api/v1/schedules/{name}", params=query)


def pause_schedule(name: str, tenant: str | None, *, paused: bool) -> Request:
    query = {"tenant": tenant} if tenant is not None else None
    action = "pause" if paused else "resume"
    return Request("POST", f"/api/v1/schedules/{name}/{action}", params=query)


def whoami() -> Request:
    return Request("GET", "/api/v1/whoami")


def health() -> Request:
    return Request("GET", "/healthz")
