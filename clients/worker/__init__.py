"""The Steward worker: runs the broker's tasks (plain Python and PySpark).

Start one with ``python -m clients.worker --broker HOST:PORT --http-url URL`` or embed it::

    worker = Worker(WorkerConfig(broker="127.0.0.1:7070", http_url="http://127.0.0.1:8080"))
    await worker.run()  # until await worker.stop()

The names below are imported on first use: a task process (``task_processes.child``) imports this
package too and must not pay for the worker's link (asyncio, httpx) at every start.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.worker.config import WorkerConfig
    from clients.worker.link.worker_link import Worker, run_worker
    from clients.worker.runtime.task_runtime import TaskCancelled, TaskContext, TaskRuntime

__all__ = ["TaskCancelled", "TaskContext", "TaskRuntime", "Worker", "WorkerConfig", "run_worker"]

_HOMES = {
    "WorkerConfig": "clients.worker.config",
    "Worker": "clients.worker.link.worker_link",
    "run_worker": "clients.worker.link.worker_link",
    "TaskCancelled": "clients.worker.task_api",
    "TaskContext": "clients.worker.task_api",
    "TaskRuntime": "clients.worker.runtime.task_runtime",
}


def __getattr__(name: str) -> Any:
    home = _HOMES.get(name)
    if home is None:
        raise AttributeError(f"module 'clients.worker' has no attribute {name!r}")
    return getattr(importlib.import_module(home), name)
