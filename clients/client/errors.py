"""The errors the Steward clients raise, and the mapping from an API error answer to them."""

from __future__ import annotations

from typing import Any

from clients.client.transport import Response


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


def _raise_for(response: Response) -> Any:
    try:
        body = response.json()
    except ValueError:
        body = None
    # 3xx too: a redirect the client did not follow is no answer to use.
    if response.status >= 300:
        detail = body.get("error") if isinstance(body, dict) else None
        if isinstance(detail, dict):
            raise _error_for(response.status, str(detail.get("code")), str(detail.get("message")))
        raise _error_for(response.status, "http_error", response.text[:200])
    return body


def _error_detail(response: Response) -> dict[str, Any]:
    """The ``error`` object of an error answer ({} when there is none)."""
    try:
        body = response.json()
    except ValueError:
        return {}
    detail = body.get("error") if isinstance(body, dict) else None
    return detail if isinstance(detail, dict) else {}
