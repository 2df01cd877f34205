"""The three ledger engines side by side, in one run: the file ledger, pulsar-lite and real
Apache Pulsar (its bookie journalling with fsync), with the settings Steward uses on each.

Usage: python bench/bench_ledger_engines.py [--rounds 3] [--seconds-per-case 2]
[--entry-bytes 200] [--dir DIR]

Starts pulsar-lite and the Pulsar standalone of the test suite (clients/dev/pulsar_standalone.py:
one JVM, one bookie with ``journalSyncData=true``; jars from ``./scripts/fetch-engines``) on
free loopback ports, and writes file ledgers in a temporary directory on the same disk. Each
round runs every engine's cases in turn (the engines interleaved, so that a change in the
machine's load falls on all three): 1, 32 and 1000 concurrent appenders, each awaiting its
append and issuing the next (the 1000-appender case is group commit's throughput). Prints
each round's lines, then per engine and case the median over rounds of appends/s, p50 and
p99. Apache Pulsar is warmed up first (32 appenders, twice a case's time, not reported).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from collections import defaultdict
from collections.abc import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ledger_load import closed_loop_appends, pulsar_store, unique_cluster

from clients.dev.pulsar_lite import PulsarLiteServer
from clients.dev.pulsar_standalone import PulsarStandalone
from log.api import LedgerStore
from log.file import FileLedgerStore
from log.pulsar import PulsarConfig

CONCURRENCIES = (1, 32, 1000)
#: (appends/s, p50 ms, p99 ms) of one case in one round.
Figures = tuple[float, float, float]


async def measure(store: LedgerStore, appenders: int, args: argparse.Namespace) -> Figures:
    writer = await store.create_ledger()
    payload = os.urandom(args.entry_bytes)
    latencies_s, elapsed_s = await closed_loop_appends(
        writer, payload, appenders, args.seconds_per_case
    )
    await writer.close()
    quantiles = statistics.quantiles(latencies_s, n=100)
    return len(latencies_s) / elapsed_s, quantiles[49] * 1e3, quantiles[98] * 1e3


async def run(args: argparse.Namespace, directory: str) -> None:
    with (
        PulsarLiteServer(os.path.join(directory, "lite")) as lite,
        PulsarStandalone(os.path.join(directory, "standalone"), jvm_options=()) as standalone,
    ):
        print(f"pulsar-lite at {lite.service_url}")
        print(
            f"Apache Pulsar {standalone.version} standalone at {standalone.service_url} "
            f"(started in {standalone.first_start_s:.1f} s)"
        )
        file_dir = os.path.join(directory, "file-ledgers")
        engines: dict[str, Callable[[], LedgerStore]] = {
            "file": lambda: FileLedgerStore(file_dir),
            "pulsar-lite": lambda: pulsar_store(
                PulsarConfig.for_pulsar_lite(lite.service_url, cluster=unique_cluster())
            ),
            "apache-pulsar": lambda: pulsar_store(
                PulsarConfig.for_apache_pulsar(
                    standalone.service_url, standalone.admin_url, cluster=unique_cluster()
                )
            ),
        }
        warm_up = engines["apache-pulsar"]()
        try:
            writer = await warm_up.create_ledger()
            await closed_loop_appends(
                writer, os.urandom(args.entry_bytes), 32, 2 * args.seconds_per_case
            )
            await writer.close()
        finally:
            await warm_up.close()
        results: dict[tuple[str, int], list[Figures]] = defaultdict(list)
        for round_number in range(1, args.rounds + 1):
            print(f"-- round {round_number}")
            for engine, make in engines.items():
                store = make()
                try:
                    for appenders in CONCURRENCIES:
                        figures = await measure(store, appenders, args)
                        results[engine, appenders].append(figures)
                        print(line(engine, appenders, figures))
                finally:
                    await store.close()
        print(f"-- medians over {args.rounds} rounds")
        for engine in engines:
            for appenders in CONCURRENCIES:
                rounds = results[engine, appenders]
                medians = tuple(statistics.median(r[i] for r in rounds) for i in range(3))
                print(line(engine, appenders, medians))  # type: ignore[arg-type]


def line(engine: str, appenders: int, figures: Figures) -> str:
    rate, p50_ms, p99_ms = figures
    return (
        f"{engine:>13} {appenders:>5} appenders: {rate:>9,.0f} appends/s  "
        f"p50 {p50_ms:7.2f} ms  p99 {p99_ms:7.2f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds-per-case", type=float, default=2.0)
    parser.add_argument("--entry-bytes", type=int, default=200)
    parser.add_argument(
        "--dir", default=None, help="where the servers' data and the file ledgers go (default: tmp)"
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-ledger-engines-", dir=args.dir) as directory:
        asyncio.run(run(args, directory))


if __name__ == "__main__":
    main()
