"""Durable append throughput and latency of the pulsar ledger backend, on pulsar-lite or on
real Apache Pulsar.

Usage: python bench/bench_ledger_pulsar.py [--engine pulsar-lite|apache-pulsar]
[--seconds-per-case 3] [--service-url URL [--admin-url URL]] [--uvloop] [--entry-bytes 200]

Starts a server on free loopback ports (unless ``--service-url`` names a running one):
pulsar-lite, or with ``--engine apache-pulsar`` the Pulsar standalone of the test suite
(clients/dev/pulsar_standalone.py: one JVM, one bookie with ``journalSyncData=true``, jars
from ``./scripts/fetch-engines``). Then, like bench/bench_ledger.py for the file backend:
1, 32 and 1000 concurrent appenders, each awaiting its append and issuing the next (durable
appends/s, p50/p99), and a burst of 1,000 appends issued at once (time until the last one is
durable); then a reader catching up with 20,000 entries written 10 per message (entries/s:
a follower's catch-up) and the time
from an append's call until a second store's tailing reader returns it (p50/p99 of 200
sequential appends). Apache Pulsar is warmed up first (32 appenders, twice a case's time,
not reported). On pulsar-lite with ``PulsarConfig.for_pulsar_lite``; on Apache
Pulsar with ``PulsarConfig.for_apache_pulsar`` and each write variant of
:data:`WRITE_VARIANTS` (producer batching, compression) and reader queue of
:data:`READER_QUEUES`, which is how its defaults were chosen (docs/BENCHMARKS.md). Ledger ids
come from an in-process counter (fine for one process on a fresh topic prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ledger_load import closed_loop_appends, pulsar_store, rate_line, unique_cluster

from clients.dev.pulsar_lite import PulsarLiteServer
from log.pulsar import PulsarConfig, PulsarLedgerStore

CONCURRENCIES = (1, 32, 1000)
BURST_APPENDS = 1000
TAIL_ENTRIES = 20_000
TAIL_ENTRIES_PER_MESSAGE = 10
VISIBLE_APPENDS = 200
VISIBLE_TIMEOUT_S = 10.0
#: Apache Pulsar: the producer settings compared (over for_apache_pulsar's).
WRITE_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("batching off, lz4", {"batching": False, "compression": "lz4"}),
    ("batching on (1 ms), lz4", {"batching": True, "compression": "lz4"}),
    ("batching off, no compression", {"batching": False, "compression": "none"}),
)
#: Apache Pulsar: the reader receive queues compared.
READER_QUEUES = (1, 100, 1000)


async def run_case(store: PulsarLedgerStore, appenders: int, duration_s: float, size: int) -> None:
    writer = await store.create_ledger()
    payload = os.urandom(size)
    latencies_s, elapsed_s = await closed_loop_appends(writer, payload, appenders, duration_s)
    await writer.close()
    print(rate_line(appenders, latencies_s, elapsed_s))


async def run_burst(store: PulsarLedgerStore, size: int) -> None:
    writer = await store.create_ledger()
    payload = os.urandom(size)
    started = time.perf_counter()
    await asyncio.gather(*(writer.append(payload) for _ in range(BURST_APPENDS)))
    elapsed_s = time.perf_counter() - started
    await writer.close()
    print(
        f"burst of {BURST_APPENDS} appends issued at once: all durable in "
        f"{elapsed_s * 1e3:.1f} ms ({BURST_APPENDS / elapsed_s:,.0f} appends/s)"
    )


async def run_tail(store: PulsarLedgerStore, size: int) -> None:
    writer = await store.create_ledger()
    payload = os.urandom(size)
    # Many messages, as a leader's log under load has (one message per group commit).
    for _ in range(TAIL_ENTRIES // TAIL_ENTRIES_PER_MESSAGE):
        await asyncio.gather(*(writer.append(payload) for _ in range(TAIL_ENTRIES_PER_MESSAGE)))
    reader = await store.open_ledger(writer.ledger_id, recovery=False)
    started = time.perf_counter()
    next_id = 0
    while next_id < TAIL_ENTRIES:
        entries = await reader.read(next_id, 1000)
        next_id += len(entries)
    elapsed_s = time.perf_counter() - started
    await reader.close()
    await writer.close()
    print(f"reader catching up with {TAIL_ENTRIES} entries: {TAIL_ENTRIES / elapsed_s:,.0f}/s")


async def run_visible(store: PulsarLedgerStore, reading: PulsarLedgerStore, size: int) -> None:
    """Append one entry at a time; time until another store's tailing reader returns it."""
    writer = await store.create_ledger()
    reader = await reading.open_ledger(writer.ledger_id, recovery=False)
    payload = os.urandom(size)
    latencies_s: list[float] = []
    for entry_id in range(VISIBLE_APPENDS):
        started = time.perf_counter()
        await writer.append(payload)
        if not await reader.wait_for_entries(entry_id - 1, VISIBLE_TIMEOUT_S):
            raise RuntimeError(f"entry {entry_id} not visible in {VISIBLE_TIMEOUT_S} s")
        latencies_s.append(time.perf_counter() - started)
    await reader.close()
    await writer.close()
    latencies_s.sort()
    p50 = latencies_s[len(latencies_s) // 2] * 1e3
    p99 = latencies_s[int(len(latencies_s) * 0.99)] * 1e3
    print(f"append to visible in a tailing reader: p50 {p50:.2f} ms  p99 {p99:.2f} ms")


async def run_writes(config: PulsarConfig, args: argparse.Namespace) -> None:
    store = pulsar_store(config)
    try:
        for appenders in CONCURRENCIES:
            await run_case(store, appenders, args.seconds_per_case, args.entry_bytes)
        await run_burst(store, args.entry_bytes)
    finally:
        await store.close()


async def run_reads(config: PulsarConfig, args: argparse.Namespace) -> None:
    store, reading = pulsar_store(config), pulsar_store(config)
    try:
        await run_tail(store, args.entry_bytes)
        await run_visible(store, reading, args.entry_bytes)
    finally:
        await store.close()
        await reading.close()


async def main_async(args: argparse.Namespace, service_url: str, admin_url: str | None) -> None:
    if args.engine == "pulsar-lite":
        # A topic prefix per store's id counter: ids restart at 1 for each.
        for run in (run_writes, run_reads):
            config = PulsarConfig.for_pulsar_lite(
                service_url, tenant="bench", cluster=unique_cluster()
            )
            await run(config, args)
        return
    base = PulsarConfig.for_apache_pulsar(service_url, admin_url)
    print(
        f"for_apache_pulsar defaults: batching={base.batching} compression={base.compression} "
        f"reader_queue_size={base.reader_queue_size}"
    )
    # The JVM compiles its hot paths during the first seconds of load: warm it up first, so
    # the first variant is not measured on a cold broker.
    warm_up = pulsar_store(
        PulsarConfig.for_apache_pulsar(service_url, admin_url, cluster=unique_cluster())
    )
    try:
        writer = await warm_up.create_ledger()
        await closed_loop_appends(
            writer, os.urandom(args.entry_bytes), 32, 2 * args.seconds_per_case
        )
        await writer.close()
    finally:
        await warm_up.close()
    for label, overrides in WRITE_VARIANTS:
        print(f"-- writes, {label}")
        await run_writes(
            PulsarConfig.for_apache_pulsar(
                service_url, admin_url, cluster=unique_cluster(), **overrides
            ),
            args,
        )
    for queue in READER_QUEUES:
        print(f"-- reads, reader_queue_size={queue}")
        await run_reads(
            PulsarConfig.for_apache_pulsar(
                service_url, admin_url, cluster=unique_cluster(), reader_queue_size=queue
            ),
            args,
        )


@contextmanager
def started_server(engine: str, directory: str) -> Iterator[tuple[str, str | None]]:
    """The server the run starts (closed, its process group killed, on every exit path)."""
    if engine == "pulsar-lite":
        with PulsarLiteServer(directory) as lite:
            print(f"pulsar-lite at {lite.service_url}")
            yield lite.service_url, None
        return
    from clients.dev.pulsar_standalone import PulsarStandalone

    with PulsarStandalone(directory, jvm_options=()) as standalone:
        print(
            f"Apache Pulsar {standalone.version} standalone at {standalone.service_url} "
            f"(started in {standalone.first_start_s:.1f} s)"
        )
        yield standalone.service_url, standalone.admin_url


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine", choices=["pulsar-lite", "apache-pulsar"], default="pulsar-lite")
    parser.add_argument("--seconds-per-case", type=float, default=3.0)
    parser.add_argument("--entry-bytes", type=int, default=200)
    parser.add_argument("--service-url", default=None, help="a running Pulsar (default: start one)")
    parser.add_argument("--admin-url", default=None, help="its admin URL (apache-pulsar)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()
    if args.service_url is not None:
        asyncio.run(main_async(args, args.service_url, args.admin_url))
        return
    with (
        tempfile.TemporaryDirectory() as directory,
        started_server(args.engine, directory) as (
            service_url,
            admin_url,
        ),
    ):
        print(f"{args.entry_bytes}-byte entries")
        asyncio.run(main_async(args, service_url, admin_url))


if __name__ == "__main__":
    main()
