"""What running tasks in task processes costs per task, against running them on threads.

Drives the worker's real TaskRuntime (clients/worker/runtime/task_runtime.py) without a broker: N
no-op
tasks (the built-in ``noop``, and a one-line code artifact) one after another on one slot,
then N at once on SLOTS slots, once with ``task_isolation="thread"`` (the function called
on a worker thread) and once with ``"process"`` (a Run frame to a warm task process and a
Done frame back; the attempt's working directory made and removed). Warm: each mode first
runs a warm-up batch so processes are started and artifacts copied. Prints per-task wall
time for each mode and the difference, the figure docs/BENCHMARKS.md quotes.

    python bench/bench_isolation.py                 # 2,000 tasks, 8 slots, 3 repeats
    python bench/bench_isolation.py --tasks 5000 --slots 16 --repeats 5
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from clients.worker.config import WorkerConfig
from clients.worker.runtime.task_runtime import TaskRuntime
from wire.worker_protocol import AssignedTask, TaskReport

JOB = b"def noop(params, ctx):\n    return None\n"


class Bench:
    def __init__(self, root: Path, isolation: str, slots: int) -> None:
        work = Path(tempfile.mkdtemp(prefix="steward-bench-work-"))
        os.chmod(work, 0o711)
        self.work = work
        cache = root / f"cache-{isolation}-{slots}"
        cache.mkdir(parents=True)
        self.sha = hashlib.sha256(JOB).hexdigest()
        (cache / f"{self.sha}.py").write_bytes(JOB)
        config = WorkerConfig(
            broker="127.0.0.1:1",
            http_url="http://127.0.0.1:1",
            task_types={"*": slots},
            cache_dir=cache,
            work_dir=work / "work",
            task_isolation=isolation,
        )
        self.done = 0
        self.cond = threading.Condition()
        self.runtime = TaskRuntime(config, self.on_report)
        self.next_id = 1

    def on_report(self, report: TaskReport) -> None:
        assert report.ok, report.error
        self.runtime.forget((report.task_id, report.attempt))
        with self.cond:
            self.done += 1
            self.cond.notify_all()

    def run(self, count: int, type_name: str, *, sequential: bool) -> float:
        """Seconds for ``count`` tasks (one at a time when ``sequential``)."""
        code = self.sha if ":" in type_name else None
        start_done = self.done
        started = time.perf_counter()
        if sequential:
            for i in range(count):
                self.runtime.start(self.task(type_name, code))
                self.wait(start_done + i + 1)
        else:
            with self.runtime.batched():  # as the worker link starts one Assign frame's tasks
                for _ in range(count):
                    self.runtime.start(self.task(type_name, code))
        self.wait(start_done + count)
        return time.perf_counter() - started

    def task(self, type_name: str, code: str | None) -> AssignedTask:
        self.next_id += 1
        return AssignedTask(self.next_id, 1, type_name, "bench", b"null", code)

    def wait(self, target: int) -> None:
        deadline = time.monotonic() + 300
        with self.cond:
            while self.done < target:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"{target - self.done} tasks did not finish")
                self.cond.wait(left)

    def close(self) -> None:
        self.runtime.shutdown()
        shutil.rmtree(self.work, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tasks", type=int, default=2000)
    parser.add_argument("--slots", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="steward-bench-isolation-"))
    print(
        f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}, uid {os.geteuid()};"
        f" {args.tasks:,} tasks per run, median of {args.repeats}"
    )
    results: dict[tuple[str, str, str], float] = {}
    try:
        for isolation in ("thread", "process"):
            for shape, slots in (("one at a time, 1 slot", 1), (f"{args.slots} slots", args.slots)):
                bench = Bench(root, isolation, slots)
                try:
                    for type_name in ("noop", "job:noop"):
                        bench.run(max(50, slots * 4), type_name, sequential=slots == 1)  # warm
                        runs = [
                            bench.run(args.tasks, type_name, sequential=slots == 1)
                            for _ in range(args.repeats)
                        ]
                        per_task_ms = statistics.median(runs) / args.tasks * 1000
                        results[isolation, shape, type_name] = per_task_ms
                        print(
                            f"{isolation:8} {shape:22} {type_name:9} {per_task_ms:7.3f} ms/task"
                            f"  ({args.tasks / statistics.median(runs):,.0f} tasks/s)"
                        )
                finally:
                    bench.close()
        print("\nadded by task processes (process - thread), per task:")
        for (isolation, shape, type_name), value in results.items():
            if isolation == "process":
                added = value - results["thread", shape, type_name]
                print(f"  {shape:22} {type_name:9} {added:+7.3f} ms")
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
