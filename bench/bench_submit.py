"""Durable submission throughput and latency of a standalone broker over HTTP.

Starts a real ``steward standalone`` subprocess on a fresh data dir (file
ledgers, fsync group commit), then drives it from this process with a lean
keep-alive HTTP/1.1 client (raw asyncio streams, so the load generator costs
as little CPU as possible on a 2-core machine). Prints figures; asserts
nothing about timing.

    python bench/bench_submit.py                     # both scenarios
    python bench/bench_submit.py --scenario single --clients 32 --seconds 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import uvloop

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_peers.harness import free_port, standalone_argv

# --auth: the broker requires tokens; requests carry a tenant's (set by main).
EXTRA_HEADERS = ""
BENCH_ADMIN_TOKEN = "bench-admin-token"


def start_broker(data_dir: Path, port: int, auth: bool = False) -> subprocess.Popen[bytes]:
    env = dict(os.environ)
    if auth:
        env["STEWARD_ADMIN_TOKEN"] = BENCH_ADMIN_TOKEN
        env["STEWARD_WORKER_TOKEN"] = "bench-worker-token"  # secrets never on argv
    proc = subprocess.Popen(
        # A free worker port too: the default (7070) may be another broker's on this machine.
        [
            *standalone_argv(data_dir, port),
            "--worker-listen",
            f"127.0.0.1:{free_port()}",
            "--log-level",
            "WARNING",
        ],
        stdout=subprocess.DEVNULL,
        env=env,
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=1) as r:
                if r.status == 200:
                    return proc
        except OSError:
            time.sleep(0.05)
    proc.kill()
    raise SystemExit("broker did not become ready within 30 s")


def tenant_token(port: int) -> str:
    """A tenant token made through the admin API (authentication on)."""
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/api/v1/tokens",
        data=json.dumps({"name": "bench", "tenant": "bench"}).encode(),
        headers={
            "Content-Type": "application/json",
            "Authorization": f"Bearer {BENCH_ADMIN_TOKEN}",
        },
        method="POST",
    )
    with urllib.request.urlopen(request, timeout=10) as answer:
        token: str = json.loads(answer.read())["token"]
    return token


def request_bytes(port: int, body: bytes) -> bytes:
    head = (
        f"POST /api/v1/tasks HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n"
        f"{EXTRA_HEADERS}\r\n"
    )
    return head.encode() + body


async def read_response(reader: asyncio.StreamReader) -> int:
    head = await reader.readuntil(b"\r\n\r\n")
    status = int(head[9:12])
    length = 0
    for line in head.split(b"\r\n"):
        if line[:15].lower() == b"content-length:":
            length = int(line[15:])
    await reader.readexactly(length)
    return status


async def client_loop(
    port: int,
    make_body: Callable[[int], bytes],
    stop_at: float,
    latencies: list[float],
    errors: list[int],
    interval_s: float = 0.0,
) -> None:
    """Closed loop, or paced at one request per ``interval_s`` when it is > 0.

    When paced, latency counts from the scheduled send time, so a stall of the
    broker shows up in the figures instead of silently lowering the load.
    """
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    seq = 0
    next_send = time.perf_counter() + random.random() * interval_s
    try:
        while time.perf_counter() < stop_at:
            payload = request_bytes(port, make_body(seq))
            seq += 1
            if interval_s > 0:
                delay = next_send - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                started = next_send
                next_send += interval_s
            else:
                started = time.perf_counter()
            writer.write(payload)
            status = await read_response(reader)
            latencies.append(time.perf_counter() - started)
            if status >= 300:
                errors.append(status)
    finally:
        writer.close()


def percentile(sorted_values: list[float], fraction: float) -> float:
    if not sorted_values:
        return float("nan")
    index = min(len(sorted_values) - 1, int(fraction * len(sorted_values)))
    return sorted_values[index]


async def run_scenario(
    port: int, clients: int, batch: int, seconds: float, warmup_s: float, rate: float = 0.0
) -> dict[str, float]:
    params = json.dumps({"payload": "x" * 60, "n": 0})

    def make_body(seq: int) -> bytes:
        # A tenant token acts for its own tenant only: the body then names none.
        tenant = "" if EXTRA_HEADERS else f'"tenant":"t{seq % 4}",'
        task = f'{{"type":"noop",{tenant}"params":{params}}}'
        if batch == 1:
            return task.encode()
        return ('{"tasks":[' + ",".join([task] * batch) + "]}").encode()

    # Warm-up (connections, JIT-free but caches, first ledger roll).
    warm: list[float] = []
    await asyncio.gather(
        *(
            client_loop(port, make_body, time.perf_counter() + warmup_s, warm, [])
            for _ in range(clients)
        )
    )
    latencies: list[float] = []
    errors: list[int] = []
    started = time.perf_counter()
    stop_at = started + seconds
    interval_s = clients / rate if rate > 0 else 0.0
    await asyncio.gather(
        *(
            client_loop(port, make_body, stop_at, latencies, errors, interval_s)
            for _ in range(clients)
        )
    )
    elapsed = time.perf_counter() - started
    latencies.sort()
    requests = len(latencies)
    return {
        "requests_per_s": requests / elapsed,
        "tasks_per_s": requests * batch / elapsed,
        "p50_ms": percentile(latencies, 0.50) * 1000,
        "p99_ms": percentile(latencies, 0.99) * 1000,
        "max_ms": (latencies[-1] if latencies else float("nan")) * 1000,
        "errors": float(len(errors)),
        "requests": float(requests),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=["batch", "single", "paced", "all"], default="all")
    parser.add_argument(
        "--rate", type=float, default=3000.0, help="paced scenario: requests/s in total"
    )
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--batch-clients", type=int, default=4)
    parser.add_argument("--batch-size", type=int, default=100)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--warmup-s", type=float, default=2.0)
    parser.add_argument(
        "--auth",
        action="store_true",
        help="authentication on: every request carries a tenant token the broker checks",
    )
    args = parser.parse_args()

    with tempfile.TemporaryDirectory(prefix="steward-bench-") as tmp:
        port = free_port()
        broker = start_broker(Path(tmp) / "data", port, auth=args.auth)
        try:
            if args.auth:
                global EXTRA_HEADERS
                EXTRA_HEADERS = f"Authorization: Bearer {tenant_token(port)}\r\n"
            print(f"machine: {os.cpu_count()} cores, python {sys.version.split()[0]}")
            scenarios = []
            if args.scenario in ("batch", "all"):
                scenarios.append(("batch", args.batch_clients, args.batch_size, 0.0))
            if args.scenario in ("single", "all"):
                scenarios.append(("single", args.clients, 1, 0.0))
            if args.scenario in ("paced", "all"):
                scenarios.append(("paced", args.clients, 1, args.rate))
            for name, clients, batch, rate in scenarios:
                figures = uvloop.run(
                    run_scenario(port, clients, batch, args.seconds, args.warmup_s, rate)
                )
                print(
                    f"{name:>6}: {clients} clients x batches of {batch}: "
                    f"{figures['tasks_per_s']:,.0f} tasks/s, "
                    f"{figures['requests_per_s']:,.0f} requests/s, "
                    f"p50 {figures['p50_ms']:.2f} ms, p99 {figures['p99_ms']:.2f} ms, "
                    f"max {figures['max_ms']:.1f} ms, errors {figures['errors']:.0f} "
                    f"({figures['requests']:.0f} requests in {args.seconds:.0f} s)"
                )
        finally:
            broker.send_signal(signal.SIGTERM)
            try:
                broker.wait(timeout=60)
            except subprocess.TimeoutExpired:
                broker.kill()


if __name__ == "__main__":
    main()
