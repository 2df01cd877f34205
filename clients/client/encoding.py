"""Request bodies and queries, and reading task answers: shared by both clients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Final, Generic, TypeVar

from clients.client.errors import TaskFailedError, TaskTimeoutError, TreeFailedError

C = TypeVar("C")  # the client a handle or transaction belongs to
H = TypeVar("H")  # the handles a transaction's submissions return

FINAL_STATES: Final = frozenset({"finished", "error", "cancelled"})
_POLL_SLICE_S: Final = 30.0  # one long-poll request waits at most this long


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


class _Waiting:
    """A handle's wait for its task (or its tree) to end, without the IO: how long the next
    long poll may wait, whether an answer ends the wait, and the timeout once it is over."""

    def __init__(
        self, task_id: int, timeout: float | None, tree: bool, now: Callable[[], float]
    ) -> None:
        self.task_id = task_id
        self.timeout = timeout
        self.tree = tree
        self.now = now
        self.deadline = None if timeout is None else now() + timeout

    def poll_s(self) -> float:
        remaining = _POLL_SLICE_S if self.deadline is None else self.deadline - self.now()
        return max(0.0, min(_POLL_SLICE_S, remaining))

    def remaining_s(self) -> float | None:
        return None if self.deadline is None else self.deadline - self.now()

    def ended(self, task: dict[str, Any]) -> bool:
        """Whether ``task`` ends the wait; raises TaskTimeoutError when the time is over."""
        if _tree_ended(task) if self.tree else task["state"] in FINAL_STATES:
            return True
        if self.deadline is not None and self.now() >= self.deadline:
            raise TaskTimeoutError(self.task_id, self.timeout or 0.0)
        return False


class _Handle(Generic[C]):
    """What the sync and async task handles hold."""

    def __init__(self, client: C, task_id: int, state: str) -> None:
        self.client = client
        self.id = task_id
        self.submitted_state = state

    def __repr__(self) -> str:
        return f"{type(self).__name__}(id={self.id})"


class _Transaction(Generic[C, H]):
    """What the sync and async transactions hold: the handles of what they submitted."""

    def __init__(self, client: C, transaction_id: int, tenant: str | None) -> None:
        self.client = client
        self.id = transaction_id
        self.tenant = tenant
        self.handles: list[H] = []
