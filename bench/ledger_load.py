"""Closed-loop append load on one ledger writer, and Pulsar stores for it, shared by
bench_ledger*.py."""

from __future__ import annotations

import asyncio
import itertools
import os
import statistics
import time

from log.api import LedgerWriter
from log.pulsar import PulsarConfig, PulsarLedgerStore


async def closed_loop_appends(
    writer: LedgerWriter, payload: bytes, appenders: int, duration_s: float
) -> tuple[list[float], float]:
    """``appenders`` loops each appending and awaiting durability until ``duration_s``.

    Returns each append's latency in seconds and the elapsed seconds.
    """
    latencies_s: list[float] = []
    stop_at = time.perf_counter() + duration_s

    async def appender() -> None:
        while time.perf_counter() < stop_at:
            started = time.perf_counter()
            await writer.append(payload)
            latencies_s.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(appender() for _ in range(appenders)))
    return latencies_s, time.perf_counter() - started


def rate_line(appenders: int, latencies_s: list[float], elapsed_s: float) -> str:
    quantiles = statistics.quantiles(latencies_s, n=100)
    return (
        f"{appenders:>5} appenders: {len(latencies_s) / elapsed_s:>9,.0f} appends/s  "
        f"p50 {quantiles[49] * 1e3:6.2f} ms  p99 {quantiles[98] * 1e3:6.2f} ms"
    )


def pulsar_store(config: PulsarConfig) -> PulsarLedgerStore:
    """A Pulsar ledger store whose ledger ids come from an in-process counter (fine for one
    process on a fresh topic prefix: :func:`unique_cluster`)."""
    counter = itertools.count(1)

    async def ledger_ids() -> int:
        return next(counter)

    return PulsarLedgerStore(config, ledger_ids)


def unique_cluster() -> str:
    """A topic prefix of its own for a store (each store's ids start at 1)."""
    return f"bench{os.getpid()}x{time.time_ns()}"
