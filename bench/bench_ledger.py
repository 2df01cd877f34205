"""Durable append throughput and latency of the file ledger backend.

Usage: python bench/bench_ledger.py [--seconds-per-case 3] [--uvloop] [--dir DIR]

For 1, 32 and 1000 concurrent appenders of 200-byte entries, each appender awaits its
append and immediately issues the next; prints durable appends/s, p50/p99 append latency
and how many appends shared one fdatasync.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from typing import TYPE_CHECKING

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from ledger_load import closed_loop_appends, rate_line

from log.file import FileLedgerStore

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

ENTRY_SIZE_BYTES = 200
CONCURRENCIES = (1, 32, 1000)


async def run_case(directory: str, appenders: int, duration_s: float) -> None:
    store = FileLedgerStore(directory)
    writer = await store.create_ledger()
    payload = os.urandom(ENTRY_SIZE_BYTES)
    fsyncs = 0
    real_fdatasync = os.fdatasync

    def counting_fdatasync(fd: FileDescriptorLike) -> None:
        nonlocal fsyncs
        fsyncs += 1
        real_fdatasync(fd)

    os.fdatasync = counting_fdatasync
    try:
        latencies_s, elapsed_s = await closed_loop_appends(writer, payload, appenders, duration_s)
    finally:
        os.fdatasync = real_fdatasync
    await store.close()
    print(
        f"{rate_line(appenders, latencies_s, elapsed_s)}  "
        f"{len(latencies_s) / max(1, fsyncs):7.1f} appends/fsync"
    )


async def main_async(args: argparse.Namespace) -> None:
    for appenders in CONCURRENCIES:
        with tempfile.TemporaryDirectory(dir=args.dir) as directory:
            await run_case(directory, appenders, args.seconds_per_case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds-per-case", type=float, default=3.0)
    parser.add_argument("--uvloop", action="store_true", help="run on uvloop")
    parser.add_argument("--dir", default=None, help="where to put the ledgers (default: tmp)")
    args = parser.parse_args()
    loop_name = "uvloop" if args.uvloop else "asyncio"
    print(f"file ledger, {ENTRY_SIZE_BYTES}-byte entries, {loop_name} event loop")
    if args.uvloop:
        import uvloop

        uvloop.run(main_async(args))
    else:
        asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
