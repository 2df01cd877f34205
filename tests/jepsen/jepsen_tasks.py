"""The Jepsen run's task code, uploaded as a code artifact (``jepsen_tasks:record``).

Each run appends a ``start`` line before its work and a ``done`` line after it to a shared
file (one ``write`` with ``O_APPEND``: lines never interleave) with the monotonic time and
the network namespace it ran in (which names the worker: each worker has its own), so the
checker can see two runs of one attempt, or of one slot, overlap. The work cannot fail.
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
