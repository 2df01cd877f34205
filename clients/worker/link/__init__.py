"""The worker's link to the broker: one TCP connection kept up (``worker_link.py``: the
``Worker``, its reconnect loop, handshake and frames), where to connect (``discovery.py``),
the assigned tasks (``assignments.py``), reports until acknowledged (``reports.py``) and task
output (``output.py``). Logs as ``clients.worker.link``.

May import: the wire protocol (``wire``), the task runtime (``clients.worker.runtime``), the
Spark room (``clients.worker.spark``, to start the worker's servers), the worker's base
modules (config, artifacts, task_api), and from the broker what every client shares
(``broker.security``, ``broker.api.api_models``, ``broker.observability.logs``).
"""
