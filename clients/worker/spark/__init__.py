"""Spark for the worker's tasks: the worker's Spark Connect server (``connect_server.py``),
a server per tenant under its uid (``tenant_servers.py``), a shared server's fair pools
(``pools.py``) and a remote server (``remote.py``, ``--spark-remote``). Logs as
``clients.worker.spark``.

May import: the worker's base modules (config, sandbox, task_api, task_env, task_identity,
spark_remote_url); nothing else of the worker.
"""
