"""The task runtime: runs assigned tasks and turns their outcomes into reports
(``task_runtime.py``: ``TaskRuntime``), on the worker's threads (``thread_runs.py``) or in
task processes (``process_runs.py``), with the attempts both hold (``attempts.py``). Logs as
``clients.worker.runtime``.

May import: the wire protocol, the task processes (``clients.worker.task_processes``), the
Spark room, the worker's base modules; never the link (the link drives the runtime).
"""
