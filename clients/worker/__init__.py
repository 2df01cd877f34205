"""The Steward worker: runs the broker's tasks (plain Python and PySpark).

Start one with ``python -m clients.worker --broker HOST:PORT --http-url URL`` or embed it::

    worker = Worker(WorkerConfig(broker="127.0.0.1:7070", http_url="http://127.0.0.1:8080"))
    await worker.run()  # until await worker.stop()
"""

from clients.worker.config import WorkerConfig
from clients.worker.link import Worker, run_worker
from clients.worker.runtime import TaskCancelled, TaskContext, TaskRuntime

__all__ = ["TaskCancelled", "TaskContext", "TaskRuntime", "Worker", "WorkerConfig", "run_worker"]
