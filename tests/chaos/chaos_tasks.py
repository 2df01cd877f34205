"""The soak's task code, uploaded as a code artifact (``chaos_tasks:record``).

Each run of a task appends a ``start`` record before its work, a ``done`` record after it,
and an ``end`` record however it ends (done, cancelled, failed) to a shared file (one
``write`` with ``O_APPEND``: lines never interleave), so the soak can prove that no attempt
of a task ran twice, and see when a stale attempt was still running while its replacement
ran (a zombie: a start of attempt n+1 before the end of attempt n).
"""

from __future__ import annotations

import json
import os
from typing import Any


def _note(path: str, event: str, task_id: int, attempt: int) -> None:
    line = json.dumps({"event": event, "task": task_id, "attempt": attempt, "pid": os.getpid()})
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def record(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    path = str(params["effects"])
    _note(path, "start", ctx.task_id, ctx.attempt)
    try:
        if ctx.cancelled.wait(float(params["seconds"])):
            ctx.check_cancelled()
        _note(path, "done", ctx.task_id, ctx.attempt)
    finally:
        _note(path, "end", ctx.task_id, ctx.attempt)
    # A tree root: its children (created with its finish, in the same log entry) are keyed
    # after it and its attempt (a tree that fails or times out replays its root, which
    # spawns them again), so the soak knows who made them.
    for index in range(int(params.get("children", 0))):
        key = f"{params['key']}-a{ctx.attempt}-c{index}"
        child = {"key": key, "seconds": params["seconds"], "effects": path}
        attempts = int(params["attempts"])  # lost with a worker as often as failed (max_lost)
        ctx.spawn("chaos_tasks:record", child, max_attempts=attempts, max_lost=attempts)
    return {"task": ctx.task_id, "attempt": ctx.attempt, "key": params["key"]}


# A second task type with the same work: the load mixes types.
again = record
