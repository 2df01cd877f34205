"""Celery 5 app for the benchmarks: one no-op task, Redis as broker and result backend.

Workers are started by the benchmarks as
``python -m celery -A bench_peers.celery_app worker ...`` with ``BENCH_REDIS_URL`` set.

Configuration (Celery defaults unless noted):
- JSON serialisation, results stored in Redis (``celery-task-meta-<id>``, 1 day expiry).
- ``task_acks_late`` from ``BENCH_CELERY_ACKS_LATE`` (default off = Celery's default:
  the message is acknowledged when the task starts, so a crash loses it).
- prefetch multiplier 4 (default): each worker holds up to 4 x concurrency messages.
- no task events (default); the benchmarks start workers with
  ``--without-gossip --without-mingle --without-heartbeat`` (the usual tuning for
  throughput; those only serve monitoring and worker-to-worker sync).
"""

from __future__ import annotations

import os

from celery import Celery  # type: ignore[import-untyped]

TASK_NAME = "bench.noop"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


def noop() -> None:
    return None


def make_app(url: str, *, with_results: bool = True) -> Celery:
    """The benchmark app on ``url``.

    ``with_results=False`` is a producer-only app (no result backend): it publishes
    tasks without subscribing to each task's result channel, for the throughput
    benchmark, which checks the stored results in Redis itself. The worker's app always
    stores results.
    """
    app = Celery("bench_peers", broker=url, backend=url if with_results else None)
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        task_acks_late=os.environ.get("BENCH_CELERY_ACKS_LATE", "0") == "1",
        worker_prefetch_multiplier=4,
        worker_hijack_root_logger=False,
        broker_connection_retry_on_startup=True,
        broker_pool_limit=4,
        result_expires=3600,
    )

    # shared=False: each app (the worker's, the benchmark's clients) registers its own.
    app.task(noop, name=TASK_NAME, shared=False)
    return app


app = make_app(os.environ.get("BENCH_REDIS_URL", DEFAULT_URL))
