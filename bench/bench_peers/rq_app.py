"""RQ job function for the benchmarks (RQ imports jobs by dotted path in its workers).

Workers are started by the benchmarks as ``rq worker --url URL --path bench/ bench``:
RQ's default ``Worker`` class, which forks a work horse for every job (RQ's recommended
worker: a crash or leak in a job cannot take the worker down). Results are kept in
Redis (``rq:results:<job id>``, RQ's default result TTL of 500 s).
"""

from __future__ import annotations

QUEUE = "bench"


def noop() -> None:
    return None
