"""The Jepsen run's task code, uploaded as a code artifact (``jepsen_tasks:record``).

Each run appends a ``start`` line before its work and a ``done`` line after it to a shared
file (one ``write`` with ``O_APPEND``: lines never interleave) with the monotonic time and
the network namespace it ran in (which names the worker: each worker has its own), so the
checker can see two runs of one attempt, or of one slot, overlap. The work cannot fail.
``cancellable`` is the same work under another task type (the one cancels by filter
match); ``tree_root`` also spawns ``params["children"]`` children with its finish, each
with the key ``KEY/cI``: a late report of a stale attempt that spawned again would show as
two tasks of one key.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any


def _note(params: dict[str, Any], event: str, ctx: Any) -> None:
    line = json.dumps(
        {
            "event": event,
            "task": ctx.task_id,
            "attempt": ctx.attempt,
            "worker": os.readlink("/proc/self/ns/net"),
            "time": time.monotonic(),
            "slot": params.get("slot", ""),
            "seconds": params["seconds"],
        }
    )
    fd = os.open(str(params["effects"]), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(fd, (line + "\n").encode())
    finally:
        os.close(fd)


def record(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    _note(params, "start", ctx)
    try:
        if ctx.cancelled.wait(float(params["seconds"])):
            ctx.check_cancelled()
    finally:
        _note(params, "done", ctx)  # a cancelled run ends here too
    return {"task": ctx.task_id, "attempt": ctx.attempt, "key": params["key"]}


cancellable = record


def tree_root(params: dict[str, Any], ctx: Any) -> dict[str, Any]:
    result = record(params, ctx)
    for i in range(int(params["children"])):
        child = {
            "key": f"{params['key']}/c{i}",
            "seconds": params["child_seconds"],
            "effects": params["effects"],
        }
        # As the submitted tasks: an attempt lost with its worker is retried.
        attempts = int(params["max_attempts"])
        ctx.spawn("jepsen_tasks:record", child, max_attempts=attempts, max_lost=attempts)
    return result
