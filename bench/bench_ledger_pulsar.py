"""Durable append throughput and latency of the pulsar ledger backend against pulsar-lite.

Usage: python bench/bench_ledger_pulsar.py [--seconds-per-case 3] [--service-url URL]
[--uvloop] [--entry-bytes 200]

Starts a pulsar-lite broker on a free loopback port (unless ``--service-url`` names a running
Pulsar) and runs, like bench/bench_ledger.py for the file backend: 1, 32 and 1000 concurrent
appenders, each awaiting its append and issuing the next (durable appends/s, p50/p99), then a
burst of 1,000 appends issued at once (time until the last one is durable), then a tailing
reader catching up with 20,000 entries (entries/s). Ledger ids come from an in-process
counter (fine for one process on a fresh topic prefix).
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ledger_load import closed_loop_appends, rate_line

from clients.dev.pulsar_lite import PulsarLiteServer
from log.pulsar import PulsarConfig, PulsarLedgerStore

CONCURRENCIES = (1, 32, 1000)
BURST_APPENDS = 1000
TAIL_ENTRIES = 20_000


def make_store(service_url: str, cluster: str) -> PulsarLedgerStore:
    counter = itertools.count(1)

    async def ledger_ids() -> int:
        return next(counter)

    config = PulsarConfig.for_pulsar_lite(service_url, tenant="bench", cluster=cluster)
    return PulsarLedgerStore(config, ledger_ids)


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
    await asyncio.gather(*(writer.append(payload) for _ in range(TAIL_ENTRIES)))
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


async def main_async(args: argparse.Namespace, service_url: str) -> None:
    store = make_store(service_url, f"bench{os.getpid()}x{int(time.time())}")
    try:
        for appenders in CONCURRENCIES:
            await run_case(store, appenders, args.seconds_per_case, args.entry_bytes)
        await run_burst(store, args.entry_bytes)
        await run_tail(store, args.entry_bytes)
    finally:
        await store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds-per-case", type=float, default=3.0)
    parser.add_argument("--entry-bytes", type=int, default=200)
    parser.add_argument("--service-url", default=None, help="a running Pulsar (default: start one)")
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    args = parser.parse_args()
    if args.uvloop:
        import uvloop

        uvloop.install()
    if args.service_url is not None:
        asyncio.run(main_async(args, args.service_url))
        return
    with tempfile.TemporaryDirectory() as directory, PulsarLiteServer(directory) as server:
        print(f"pulsar-lite at {server.service_url}, {args.entry_bytes}-byte entries")
        asyncio.run(main_async(args, server.service_url))


if __name__ == "__main__":
    main()
