"""How long a PySpark task waits for Spark: the first one on a warm worker, and after.

Starts a standalone broker and one worker (the demo's ``local_cluster``: ``*=4`` slots,
``local[*]``), waits until the worker is connected, then times, from submission to result,
``spark.sql`` ``SELECT 1``: tenant A's first task (cold: its Spark session is created),
A's second (warm), tenant B's first (with task processes: another tenant, another process,
another session), B's second. Prints each in seconds. Run it on the code to compare (e.g.
a checkout of an older commit on PYTHONPATH) to get the before and after figures of
docs/BENCHMARKS.md.

    python bench/bench_first_spark.py
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clients.client import StewardClient
from clients.demo.run import local_cluster


def timed_query(client: StewardClient, tenant: str) -> float:
    started = time.perf_counter()
    handle = client.submit("spark.sql", {"query": "SELECT 1 AS one"}, tenant=tenant)
    result = handle.result(timeout=300)
    elapsed = time.perf_counter() - started
    assert result == [{"one": 1}], result
    return elapsed


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="steward-bench-spark-"))
    print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, uid {os.geteuid()}")
    with (
        local_cluster(root / "data", log=root / "steward.log") as url,
        StewardClient(url) as client,
    ):
        for label, tenant in (
            ("tenant A, first PySpark task", "a"),
            ("tenant A, second", "a"),
            ("tenant B, first", "b"),
            ("tenant B, second", "b"),
        ):
            print(f"{label:32} {timed_query(client, tenant):7.2f} s", flush=True)


if __name__ == "__main__":
    main()
