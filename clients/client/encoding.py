"""Request bodies and queries, and reading task answers: shared by both clients."""

from __future__ import annotations

from typing import Any, Final

from clients.client.errors import TaskFailedError, TreeFailedError

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
