"""Task processes, the processes that run tenant code (docs/SECURITY.md, "Task processes"):
the warm per-tenant pools (``pool.py``), one process seen from the worker
(``process_handle.py``), the process itself (``child.py``, run as
``python -m clients.worker.task_processes.child``) and the pipe protocol between them
(``pipe_protocol.py``). Logs as ``clients.worker.task_processes``.

May import: the wire protocol, the Spark room (a task's Spark session), the worker's base
modules; never the runtime or the link. The child imports only what a task needs: this
package's ``__init__`` stays empty so that starting a task process pays for nothing else.
"""
