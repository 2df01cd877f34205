"""Snapshot size, write time and load time for N waiting tasks with ~100-byte params.

    python bench/bench_snapshot.py --tasks 500000

Params are realistic JSON with a random part (a 16-hex-digit id, numbers), so
zstd cannot collapse them to nothing; the RNG is seeded.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import tempfile
import time
from pathlib import Path

from broker.core import StateMachine
from broker.core import entries as e
from snapshot.store import SnapshotStore


def build_state(task_count: int, seed: int) -> tuple[StateMachine, int]:
    rng = random.Random(seed)
    machine = StateMachine()
    params_bytes = 0
    next_id = 1
    batch_size = 1000
    for start in range(0, task_count, batch_size):
        specs = []
        for _ in range(min(batch_size, task_count - start)):
            params = json.dumps(
                {
                    "input": f"s3://lake/events/part-{rng.randrange(100000):05d}.parquet",
                    "run": f"{rng.getrandbits(64):016x}",
                    "rows": rng.randrange(1, 10**6),
                    "mode": "append",
                },
                separators=(",", ":"),
            ).encode()
            params_bytes += len(params)
            specs.append(
                e.TaskSpec(
                    id=next_id,
                    type="spark.etl",
                    tenant=f"tenant-{rng.randrange(20)}",
                    params=params,
                    max_attempts=3,
                )
            )
            next_id += 1
        machine.apply(e.SubmitTasks(time_ms=1_700_000_000_000 + start, tasks=tuple(specs)))
    return machine, params_bytes // max(1, task_count)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, default=500_000)
    parser.add_argument("--seed", type=int, default=1)
    args = parser.parse_args()

    started = time.perf_counter()
    machine, params_avg = build_state(args.tasks, args.seed)
    build_s = time.perf_counter() - started
    gc.collect()
    print(
        f"state: {args.tasks:,} waiting tasks, params {params_avg} bytes on average "
        f"(built by apply in {build_s:.1f} s)"
    )

    with tempfile.TemporaryDirectory(prefix="steward-snap-") as tmp:
        store = SnapshotStore(Path(tmp), keep=2)
        started = time.perf_counter()
        body = machine.encode_snapshot()
        encode_s = time.perf_counter() - started
        digest = machine.digest()
        started = time.perf_counter()
        info = store.write(
            cluster_id="bench", ledger_id=1, entry_id=args.tasks // 1000, digest=digest, body=body
        )
        write_s = time.perf_counter() - started
        size = info.path.stat().st_size

        started = time.perf_counter()
        loaded = store.load_newest()
        assert loaded is not None
        read_s = time.perf_counter() - started
        started = time.perf_counter()
        restored = StateMachine.from_snapshot(loaded[1])
        decode_s = time.perf_counter() - started
        if restored.digest() != digest:
            raise SystemExit("restored state differs from the original")

    print(
        f"body (msgpack): {len(body) / 1e6:.1f} MB; file (zstd level 3): {size / 1e6:.1f} MB "
        f"= {size / args.tasks:.0f} bytes per task"
    )
    print(
        f"write: encode {encode_s:.2f} s + compress/fsync/rename {write_s:.2f} s "
        f"= {encode_s + write_s:.2f} s"
    )
    print(
        f"load: read/verify/decompress {read_s:.2f} s + decode/index {decode_s:.2f} s "
        f"= {read_s + decode_s:.2f} s; digest verified equal"
    )


if __name__ == "__main__":
    main()
