"""The systems bench_e2e.py compares, each driven the way its users call it.

A driver starts its servers and 2 worker processes under a :class:`Procs` (so they are
stopped by pid whatever happens), then offers:

- ``modes``: the submission modes it has, each with a one-line note for the table;
  ``unavailable(mode)``: why a mode cannot run in this checkout (``None``: it can);
- ``submit(mode, n, batch)``: submit ``n`` no-op tasks, returning once every one is
  acknowledged by the system; it returns a callable answering how many of them have
  not yet been *recorded* as finished (Steward: final in the broker's state, i.e. the
  finish is durable; peers: the task's result is stored in Redis);
- ``round_trip()``: submit one task and wait for its result, as the system's docs
  show.

Every wait is bounded (``WAIT_S`` per result wait; the caller bounds each run).
"""

from __future__ import annotations

import re
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar, cast

from bench_peers.harness import (
    CELERY_WORKER_ARGV,
    Procs,
    child_env,
    dramatiq_workers_argv,
    keys_present_from,
    rq_worker_argv,
    start_redis,
    start_steward,
)

WAIT_S = 5.0  # bound on one result wait in a round trip
TENANT = "bench"
FINAL = ("finished", "error", "cancelled")

Remaining = Callable[[], int]


class System:
    """Base of the drivers; see the module docstring."""

    name: ClassVar[str]
    modes: ClassVar[dict[str, str]]  # mode -> note for the table
    durable: bool = False
    failed: int = 0  # tasks of the last run that ended in error (where the system says)

    def unavailable(self, mode: str) -> str | None:
        return None

    def submit(self, mode: str, n: int, batch: int) -> Remaining:
        raise NotImplementedError

    def round_trip(self) -> None:
        raise NotImplementedError

    def log_counts(self) -> tuple[float, float] | None:
        """(log entries applied, group commits) so far, where the system says; else None."""
        return None

    def close(self) -> None:
        pass


def chunks(n: int, batch: int) -> list[int]:
    return [min(batch, n - i) for i in range(0, n, batch)]


# --- Steward -------------------------------------------------------------------------------------


class Steward(System):
    """``steward standalone`` + 2 ``steward worker``, through the public ``StewardClient``."""

    name = "steward"
    modes: ClassVar[dict[str, str]] = {
        "per-call": "client.submit() loop, each durable on return",
        "producer": "client.producer(linger_ms=L, max_batch=B): futures, durable when resolved",
        "batched": "client.submit_many(), one log entry per batch",
    }

    def __init__(self, procs: Procs, root: Path, *, slots: int, isolation: str, linger_ms: float):
        from clients.client import StewardClient

        cluster = start_steward(
            procs, root / "steward-data", workers=2, slots=slots, task_isolation=isolation
        )
        self.pids = [("broker", cluster.broker.pid), ("worker1", cluster.workers[0].pid)]
        self.url = f"http://127.0.0.1:{cluster.port}"
        self.client = StewardClient(self.url, timeout_s=60)
        self.durable = True
        self.linger_ms = linger_ms

    def close(self) -> None:
        self.client.close()

    def unavailable(self, mode: str) -> str | None:
        if mode == "producer" and not hasattr(self.client, "producer"):
            return "StewardClient has no producer() in this checkout (issue 16 adds it)"
        return None

    def _done_failed(self) -> tuple[int, int]:
        counts: dict[str, int] = self.client.cluster()["tasks"]
        done = sum(counts.get(s, 0) for s in FINAL)
        return done, done - counts.get("finished", 0)

    def submit(self, mode: str, n: int, batch: int) -> Remaining:
        base_done, base_failed = self._done_failed()
        client = self.client
        if mode == "per-call":
            for _ in range(n):
                client.submit("noop", tenant=TENANT)
        elif mode == "producer":
            producer = cast(Any, client).producer  # not in every checkout
            with producer(linger_ms=self.linger_ms, max_batch=batch) as p:
                futures = [p.submit("noop", tenant=TENANT) for _ in range(n)]
            for future in futures:
                future.result(timeout=60)  # a handle once durable, or the error raised
        elif mode == "batched":
            task = {"type": "noop", "tenant": TENANT}
            for k in chunks(n, batch):
                refused = [r for r in client.submit_many([task] * k) if isinstance(r, Exception)]
                if refused:
                    raise RuntimeError(f"submit_many: {len(refused)} refused: {refused[0]}")
        else:
            raise ValueError(mode)

        def remaining() -> int:
            done, failed = self._done_failed()
            self.failed = failed - base_failed
            return n - (done - base_done)

        return remaining

    def round_trip(self) -> None:
        self.client.submit("noop", tenant=TENANT).result(timeout=WAIT_S)

    def log_counts(self) -> tuple[float, float] | None:
        with urllib.request.urlopen(f"{self.url}/metrics", timeout=WAIT_S) as answer:
            text = answer.read().decode()
        found = [
            re.search(rf"^{name} ([0-9.e+]+)$", text, re.MULTILINE)
            for name in ("steward_entries_applied", "steward_log_group_commit_entries_count")
        ]
        if found[0] is None or found[1] is None:
            return None
        return float(found[0].group(1)), float(found[1].group(1))


# --- peers on Redis ------------------------------------------------------------------------------


class RedisPeer(System):
    """A peer with its own fresh redis-server (volatile, or AOF ``appendfsync always``)."""

    def __init__(self, procs: Procs, root: Path, *, durable: bool) -> None:
        import redis

        label = "durable" if durable else "volatile"
        self.server = start_redis(procs, root / f"redis-{self.name}-{label}", durable=durable)
        self.redis = redis.Redis.from_url(self.server.url)
        self.durable = durable

    def close(self) -> None:
        self.redis.close()

    def pending(self, keys: list[str]) -> Remaining:
        """How many of ``keys`` (result keys, in submission order) do not exist yet."""
        index = 0

        def remaining() -> int:
            nonlocal index
            index = keys_present_from(self.redis, keys, index)
            return len(keys) - index

        return remaining


class Dramatiq(RedisPeer):
    """``dramatiq --processes 2 --threads SLOTS`` with the Results middleware (Redis)."""

    name = "dramatiq"
    modes: ClassVar[dict[str, str]] = {
        "per-call": "actor.send() loop",
        "batched": "group(messages).run(): dramatiq 2.2.1 still enqueues one message at a time",
    }

    def __init__(self, procs: Procs, root: Path, *, durable: bool, slots: int) -> None:
        super().__init__(procs, root, durable=durable)
        from bench_peers.dramatiq_app import make_app

        env = {"BENCH_REDIS_URL": self.server.url, "dramatiq_restart_delay": "0"}
        procs.start("dramatiq-workers", dramatiq_workers_argv(slots), env=child_env(env))
        self.app = make_app(self.server.url)

    def close(self) -> None:
        self.app.broker.close()
        super().close()

    def submit(self, mode: str, n: int, batch: int) -> Remaining:
        from dramatiq import group

        key = self.app.backend.build_message_key
        if mode == "per-call":
            send = self.app.noop.send
            keys = [key(send()) for _ in range(n)]
        elif mode == "batched":
            keys = []
            for k in chunks(n, batch):
                messages = [self.app.noop.message() for _ in range(k)]
                group(messages, broker=self.app.broker).run()  # type: ignore[no-untyped-call]
                keys += [key(m) for m in messages]
        else:
            raise ValueError(mode)
        return self.pending(keys)

    def round_trip(self) -> None:
        message = self.app.noop.send()
        message.get_result(backend=self.app.backend, block=True, timeout=int(WAIT_S * 1000))


class Celery(RedisPeer):
    """2 ``celery worker -P threads -c SLOTS`` (or ``--celery-pool``), Redis broker + results."""

    name = "celery"
    modes: ClassVar[dict[str, str]] = {
        "per-call": "task.delay() loop",
        "batched": "group(sigs).apply_async(): one publish per task on one producer",
    }

    def __init__(
        self, procs: Procs, root: Path, *, durable: bool, slots: int, pool: str, acks_late: bool
    ) -> None:
        super().__init__(procs, root, durable=durable)
        from bench_peers.celery_app import TASK_NAME, make_app

        env = child_env(
            {"BENCH_REDIS_URL": self.server.url, "BENCH_CELERY_ACKS_LATE": str(int(acks_late))}
        )
        # pool "prefork" (Celery's default): SLOTS child processes per worker.
        argv = [*CELERY_WORKER_ARGV, "-P", pool, "-c", str(slots)]
        for i in (1, 2):
            procs.start(f"celery-worker-{i}", [*argv, "-n", f"bench{i}@%h"], env=env)
        # Throughput: a producer-only app, so that each call does not also subscribe to
        # the task's result channel (the run checks the stored results itself).
        self.producer_app = make_app(self.server.url, with_results=False)
        self.noop = self.producer_app.tasks[TASK_NAME]
        self.results_app = make_app(self.server.url)
        self.rt_noop = self.results_app.tasks[TASK_NAME]

    def close(self) -> None:
        self.producer_app.close()
        self.results_app.close()
        super().close()

    def submit(self, mode: str, n: int, batch: int) -> Remaining:
        from celery import group  # type: ignore[import-untyped]

        if mode == "per-call":
            delay = self.noop.delay
            ids = [delay().id for _ in range(n)]
        elif mode == "batched":
            ids = []
            for k in chunks(n, batch):
                result = group(self.noop.s() for _ in range(k)).apply_async()
                ids += [r.id for r in result.results]
        else:
            raise ValueError(mode)
        return self.pending([f"celery-task-meta-{task_id}" for task_id in ids])

    def round_trip(self) -> None:
        self.rt_noop.delay().get(timeout=WAIT_S)


class Rq(RedisPeer):
    """2 ``rq worker`` processes, one job at a time each: RQ's default forking ``Worker``
    (a work horse process forked per job), or ``SimpleWorker`` with ``simple``."""

    name = "rq"
    modes: ClassVar[dict[str, str]] = {
        "per-call": "queue.enqueue() loop",
        "batched": "queue.enqueue_many(): one Redis pipeline per batch",
    }

    def __init__(self, procs: Procs, root: Path, *, durable: bool, simple: bool) -> None:
        super().__init__(procs, root, durable=durable)
        from rq import Queue

        from bench_peers.rq_app import QUEUE

        for i in (1, 2):
            name = f"bench{i}-{uuid.uuid4().hex[:6]}"
            argv = rq_worker_argv(self.server.url, name, QUEUE, simple=simple)
            procs.start(f"rq-worker-{i}", argv)
        self.queue = Queue(QUEUE, connection=self.redis)

    def submit(self, mode: str, n: int, batch: int) -> Remaining:
        from rq import Queue

        from bench_peers.rq_app import noop

        if mode == "per-call":
            enqueue = self.queue.enqueue
            ids = [enqueue(noop).id for _ in range(n)]
        elif mode == "batched":
            ids = []
            for k in chunks(n, batch):
                jobs = self.queue.enqueue_many([Queue.prepare_data(noop) for _ in range(k)])
                ids += [job.id for job in jobs]
        else:
            raise ValueError(mode)
        return self.pending([f"rq:results:{job_id}" for job_id in ids])

    def round_trip(self) -> None:
        from bench_peers.rq_app import noop

        result = self.queue.enqueue(noop).latest_result(timeout=int(WAIT_S))
        if result is None or result.type != result.Type.SUCCESSFUL:
            raise RuntimeError(f"rq job: no successful result within {WAIT_S:g} s: {result}")
