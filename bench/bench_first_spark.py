"""How long a PySpark task waits for Spark: the first one on a warm worker, and after.

Starts a standalone broker and one worker (the demo's ``local_cluster``: ``*=4`` slots,
``local[*]``; extra worker flags after ``--``, e.g. ``-- --spark classic``), waits until the
worker is connected, then times, from submission to result, ``spark.sql`` ``SELECT 1``:

- the first Spark task on the worker (tenant ``warmup``): with ``--spark connect`` it may
  wait for the worker's Spark Connect server, which starts with the worker;
- then, on the now warm worker, tenant A's first task (a new task process and, with
  Connect, a new session; classic: a new JVM in A's process; with per-tenant Connect
  servers, a root worker's default, A's server starts too), A's second, tenant B's first
  (another tenant, another process) and B's second;
- then A's first task in a new task process of A's (another memory limit: processes are
  kept per tenant and limit) with A's server warm: what a tenant's first PySpark task on a
  worker warm for it costs (per-tenant servers: its server is up, the process is new).

Prints each in seconds. Run it on the code to compare (e.g. a checkout of an older commit
on PYTHONPATH) to get the before and after figures of docs/BENCHMARKS.md.

    python bench/bench_first_spark.py [-- WORKER_FLAG ...]
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clients.client import StewardClient
from clients.demo.run import local_cluster


def timed_query(client: StewardClient, tenant: str, memory_mb: int = 0) -> float:
    started = time.perf_counter()
    options: dict[str, Any] = {"resources": {"memory_mb": float(memory_mb)}} if memory_mb else {}
    handle = client.submit("spark.sql", {"query": "SELECT 1 AS one"}, tenant=tenant, **options)
    result = handle.result(timeout=300)
    elapsed = time.perf_counter() - started
    assert result == [{"one": 1}], result
    return elapsed


def timed_noop(client: StewardClient, tenant: str) -> float:
    started = time.perf_counter()
    client.submit("noop", tenant=tenant).result(timeout=300)
    return time.perf_counter() - started


def main(argv: list[str]) -> None:
    worker_args = argv[argv.index("--") + 1 :] if "--" in argv else []
    root = Path(tempfile.mkdtemp(prefix="steward-bench-spark-"))
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, uid {os.geteuid()}")
    print(f"worker flags: {' '.join(worker_args) or '(defaults)'}")
    with (
        local_cluster(root / "data", log=root / "steward.log", worker_args=worker_args) as url,
        StewardClient(url) as client,
    ):
        print(f"{'first Spark task on the worker':32} {timed_query(client, 'warmup'):7.2f} s")
        # What any task of a new tenant costs (a task process starts), Spark or not.
        print(f"{'warm worker: noop, new tenant':32} {timed_noop(client, 'n'):7.2f} s", flush=True)
        for label, tenant in (
            ("warm worker: tenant A, first", "a"),
            ("tenant A, second", "a"),
            ("tenant B, first", "b"),
            ("tenant B, second", "b"),
        ):
            print(f"{label:32} {timed_query(client, tenant):7.2f} s", flush=True)
        # A new task process of A's (its own memory limit), A's Spark (server) warm.
        elapsed = timed_query(client, "a", memory_mb=8000)
        print(f"{'tenant A, first in a new process':32} {elapsed:7.2f} s", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
