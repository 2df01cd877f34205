"""Dramatiq app for the benchmarks: one no-op actor, Redis broker, Results middleware.

Workers are started by the benchmarks as
``python -m dramatiq bench_peers.dramatiq_app --processes 2 --threads 8`` with
``BENCH_REDIS_URL`` set.

Configuration: Dramatiq's default middleware (AgeLimit, TimeLimit, ShutdownNotifications,
Callbacks, Pipelines, Retries) plus ``Results(backend=RedisBackend)``; the actor has
``store_results=True``, so every finish is written to Redis (default result TTL 10 min).
Messages are acknowledged after the actor ran (Dramatiq's default, at least once);
prefetch is 2 x threads per process (default).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import dramatiq
from dramatiq.brokers.redis import RedisBroker
from dramatiq.results import Results
from dramatiq.results.backends import RedisBackend

ACTOR_NAME = "bench_noop"
DEFAULT_URL = "redis://127.0.0.1:6379/0"


@dataclass
class DramatiqApp:
    broker: RedisBroker
    backend: RedisBackend
    noop: Any  # dramatiq.Actor


def noop() -> None:
    return None


def make_app(url: str) -> DramatiqApp:
    """A broker on ``url`` with the Results middleware, and the no-op actor on it."""
    backend = RedisBackend(url=url)
    broker = RedisBroker(url=url)  # type: ignore[no-untyped-call]
    broker.add_middleware(Results(backend=backend))  # type: ignore[no-untyped-call]
    dramatiq.set_broker(broker)
    actor = dramatiq.actor(actor_name=ACTOR_NAME, broker=broker, store_results=True)(noop)
    return DramatiqApp(broker, backend, actor)


# The worker CLI imports this module and uses the global broker it sets.
bench_app = make_app(os.environ.get("BENCH_REDIS_URL", DEFAULT_URL))
broker = bench_app.broker
