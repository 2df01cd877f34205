"""Event delivery latency of the event feed (``GET /api/v1/events``) under a steady load.

Starts a real ``steward standalone`` (file ledger, fsync per group commit) with
``--workers`` ``steward worker`` processes (``noop=--slots``, task isolation ``thread`` by
default: with ``process`` isolation two workers on this 2-core machine finish fewer than
1,000 tasks/s), opens the feed for the bench tenant with the public
``StewardClient.events()`` in a thread, then submits ``noop`` tasks at ``--rate`` tasks/s
(``submit_many`` batches every ``--tick-ms``) for ``--seconds``. For every event:

- delivery: the time the client parsed it minus the task's ``finished_at`` (the stamp of
  the entry that made it final, set by the leader when it logged the finish): log write
  and fsync, apply, encode, send and parse;
- end to end: the time the client parsed it minus the time its submit batch was
  acknowledged (submit -> assign -> run -> finish -> event).

Both clocks are this host's wall clock; ``finished_at`` has millisecond resolution.
Prints the achieved rates and p50 / p99 / max of both, and checks that every task's event
came exactly once.

    python bench/bench_events.py                    # 1,000 tasks/s for 20 s
    python bench/bench_events.py --rate 500 --seconds 10

Every wait is bounded; every process started is stopped by its pid on exit.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from collections import Counter
from datetime import datetime
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers.harness import Procs, percentile, start_steward

from clients.client import StewardClient

TENANT = "bench"


class Reader(threading.Thread):
    def __init__(self, url: str, timeout_s: float) -> None:
        super().__init__(daemon=True)
        self.url = url
        self.timeout_s = timeout_s
        self.received: list[tuple[int, float, float]] = []  # task id, parsed at, finished at
        self.opened = threading.Event()
        self.expected: int | None = None

    def run(self) -> None:
        with StewardClient(self.url) as client:
            events = client.events(tenant=TENANT, timeout=self.timeout_s)
            self.opened.set()
            for event in events:
                now = time.time()
                finished = datetime.fromisoformat(event.task["finished_at"]).timestamp()
                self.received.append((int(event.task["id"]), now, finished))
                if self.expected is not None and len(self.received) >= self.expected:
                    return


def run(url: str, rate: int, seconds: float, tick_ms: float) -> None:
    reader = Reader(url, seconds + 60)
    reader.start()
    reader.opened.wait(10)
    time.sleep(1.0)  # the feed's stream is open before the first task can finish
    acked: dict[int, float] = {}
    per_tick = max(1, round(rate * tick_ms / 1000))
    batch = [{"type": "noop", "tenant": TENANT} for _ in range(per_tick)]
    with StewardClient(url) as client:
        started = time.monotonic()
        next_tick = started
        while time.monotonic() - started < seconds:
            handles = client.submit_many(batch)
            now = time.time()
            for handle in handles:
                assert not isinstance(handle, Exception), handle
                acked[handle.id] = now
            next_tick += tick_ms / 1000
            pause = next_tick - time.monotonic()
            if pause > 0:
                time.sleep(pause)
        submit_s = time.monotonic() - started
    reader.expected = len(acked)
    reader.join(60)
    received = reader.received
    counts = Counter(task_id for task_id, _, _ in received)
    assert not [i for i, n in counts.items() if n > 1], "an event came twice"
    missing = set(acked) - set(counts)
    delivery = sorted((at - finished) * 1000 for _, at, finished in received)
    e2e = sorted((at - acked[task_id]) * 1000 for task_id, at, _ in received if task_id in acked)
    span = received[-1][1] - received[0][1] if len(received) > 1 else float("nan")
    print(
        f"submitted {len(acked)} tasks in {submit_s:.1f} s ({len(acked) / submit_s:.0f}/s, "
        f"target {rate}/s); events {len(received)} ({len(received) / span:.0f}/s), "
        f"missing {len(missing)}, duplicates 0"
    )
    for name, values in (("delivery (finished_at -> parsed)", delivery), ("end to end", e2e)):
        print(
            f"{name}: p50 {percentile(values, 0.5):.1f} ms, p99 {percentile(values, 0.99):.1f} "
            f"ms, max {values[-1]:.1f} ms"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", type=int, default=1_000, help="tasks/s submitted")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--tick-ms", type=float, default=20.0, help="one submit_many per tick")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--slots", type=int, default=64, help="noop slots per worker")
    parser.add_argument(
        "--task-isolation", choices=("process", "thread"), default="thread",
        help="thread (default): the workers keep up with 1,000 noop tasks/s on 2 cores",
    )  # fmt: skip
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-events-") as tmp:
        procs = Procs(Path(tmp) / "logs")
        try:
            steward = start_steward(
                procs,
                Path(tmp) / "data",
                workers=args.workers,
                slots=args.slots,
                task_isolation=args.task_isolation,
            )
            run(f"http://127.0.0.1:{steward.port}", args.rate, args.seconds, args.tick_ms)
        finally:
            procs.stop_all()


if __name__ == "__main__":
    main()
