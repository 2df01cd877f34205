"""What a command that waits says while it waits (``submit --wait``, ``logs --follow``):
after :data:`NOTICE_AFTER_S` without an end, one line on stderr naming what it waits for,
why that may take long and how to stop waiting; on Ctrl-C, the tasks that go on and how
to cancel them (docs/CLI.md, "Waiting").
"""

from __future__ import annotations

from typing import Any, Final

from clients.client import StewardClient, StewardError

#: Seconds of waiting before the command says what it waits for.
NOTICE_AFTER_S: Final = 2.0
#: Task ids named one by one in the Ctrl-C line; runs of consecutive ids count as one.
_MAX_IDS_SHOWN: Final = 20


def _serves(worker: dict[str, Any], task_type: str) -> bool:
    """As the scheduler places (broker/workers/placement.py): a type listed by name uses
    its own capacity (even 0), any other the ``*`` pool."""
    types: dict[str, int] = worker["task_types"]
    pool = task_type if task_type in types else "*"
    return types.get(pool, 0) > 0


def _why_not_started(client: StewardClient, task: dict[str, Any]) -> str:
    """Why a waiting task has not started, as far as the caller may see the workers."""
    if task.get("waiting_for"):
        ids = ", ".join(str(i) for i in task["waiting_for"])
        return f"it runs after tasks {ids}, not all finished"
    try:
        workers = client.cluster()["workers"]
    except (StewardError, KeyError):  # a tenant token may not see the workers
        return "no worker has taken it yet"
    connected = [w for w in workers if w.get("state") == "connected"]
    if not connected:
        return "no worker is connected"
    if any("task_types" not in w for w in connected):  # a broker older than the field
        return "no worker has taken it yet"
    task_type = str(task["type"])
    serving = [w for w in connected if _serves(w, task_type)]
    if not serving:
        return f"no connected worker serves type {task_type!r}"
    tenant = task["tenant"]
    if not [w for w in serving if not w.get("tenants") or tenant in w["tenants"]]:
        return f"no connected worker serving type {task_type!r} serves tenant {tenant!r}"
    return f"the workers serving type {task_type!r} are busy or lack its resources"


def waiting_notice(client: StewardClient, task: dict[str, Any], *, tree: bool = False) -> str:
    """The one line said while waiting for ``task`` (its record as read now)."""
    task_id, state = task["id"], task["state"]
    if tree and state in ("finished", "error", "cancelled"):
        return (
            f"steward: waiting for the tree of task {task_id} to end (its tasks run on; "
            "Ctrl-C stops waiting, the tree goes on)"
        )
    if state == "running":
        return (
            f"steward: waiting for task {task_id} to end (running on worker {task['worker']}; "
            "Ctrl-C stops waiting, the task goes on)"
        )
    if state == "delayed":
        why = f"it starts after {task.get('start_after')}"
    elif state == "pending":
        why = f"its transaction {task.get('transaction')} is not committed yet"
    else:
        why = _why_not_started(client, task)
    return (
        f"steward: waiting for task {task_id} to start ({why}; "
        "Ctrl-C stops waiting, the task stays queued)"
    )


def id_ranges(ids: list[int]) -> str:
    """``3-7, 9, 12-14``: consecutive ids as ranges, at most a few runs, then how many."""
    runs: list[list[int]] = []
    for task_id in sorted(ids):
        if runs and task_id == runs[-1][1] + 1:
            runs[-1][1] = task_id
        else:
            runs.append([task_id, task_id])
    shown = [f"{a}" if a == b else f"{a}-{b}" for a, b in runs[:_MAX_IDS_SHOWN]]
    if len(runs) > _MAX_IDS_SHOWN:
        shown.append(f"... ({sum(b - a + 1 for a, b in runs[_MAX_IDS_SHOWN:])} more)")
    return ", ".join(shown)


def stopped_waiting_line(ids: list[int]) -> str:
    """What Ctrl-C of a wait says: the tasks that go on and how to stop them."""
    one = len(ids) == 1
    what = f"task {ids[0]} goes on" if one else f"tasks {id_ranges(ids)} go on"
    cancel = f"steward cancel {ids[0]}" if one else "steward cancel ID (one by one)"
    return f"steward: stopped waiting; {what} (look with steward task ID; cancel with {cancel})"
