"""Synchronous Python client for a Steward broker's HTTP API."""

from __future__ import annotations

from typing import Any

import httpx


class StewardError(Exception):
    """An error answered by the broker (``status`` 4xx/5xx, ``code``, ``message``)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{message} ({code}, HTTP {status})")
        self.status = status
        self.code = code
        self.message = message


class InvalidRequestError(StewardError):
    pass


class NotFoundError(StewardError):
    pass


class ConflictError(StewardError):
    pass


class TenantQueueFullError(StewardError):
    pass


class UnavailableError(StewardError):
    """The broker cannot take the request now; retrying later may succeed."""


class ConnectionFailedError(StewardError):
    def __init__(self, url: str, reason: str) -> None:
        super().__init__(0, "connection_failed", f"cannot reach {url}: {reason}")


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


class StewardClient:
    def __init__(self, url: str = "http://127.0.0.1:8080", *, timeout_s: float = 30.0) -> None:
        self.url = url.rstrip("/")
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
    ) -> Any:
        try:
            response = self._http.request(method, path, json=json, params=params)
        except httpx.HTTPError as exc:
            raise ConnectionFailedError(self.url, str(exc) or type(exc).__name__) from exc
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

    # --- tasks ----------------------------------------------------------------------

    def submit(
        self, type: str, params: Any = None, *, tenant: str = "default", **options: Any
    ) -> int:
        """Submit one task; returns its id. Options: slot, max_attempts, deadline,
        start_after, resources, transaction, code."""
        body = {"type": type, "tenant": tenant, "params": params, **options}
        return int(self._call("POST", "/api/v1/tasks", json=body)["id"])

    def submit_many(self, tasks: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Submit a batch in one log entry; per-task ``{"id","state"}`` or ``{"error"}``."""
        result: list[dict[str, Any]] = self._call("POST", "/api/v1/tasks", json={"tasks": tasks})[
            "tasks"
        ]
        return result

    def task(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/api/v1/tasks/{task_id}")
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
        query: dict[str, Any] = {"limit": limit}
        for key, value in (("state", state), ("tenant", tenant), ("type", type)):
            if value is not None:
                query[key] = value
        if after:
            query["after"] = after
        result: dict[str, Any] = self._call("GET", "/api/v1/tasks", params=query)
        return result

    def cancel(self, task_id: int) -> dict[str, Any]:
        result: dict[str, Any] = self._call("POST", f"/api/v1/tasks/{task_id}/cancel")
        return result

    # --- transactions ------------------------------------------------------------------

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

    # --- tenants and cluster -------------------------------------------------------------

    def tenant(self, name: str) -> dict[str, Any]:
        result: dict[str, Any] = self._call("GET", f"/api/v1/tenants/{name}")
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
